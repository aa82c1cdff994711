"""Checkpoint I/O: safetensors reading, the declarative layout tables and `load_pretrained`."""

from ernie_jax.checkpoint.loader import load_pretrained, read_pretrained, read_weights
from ernie_jax.checkpoint.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "load_pretrained", "read_pretrained", "read_weights"]
