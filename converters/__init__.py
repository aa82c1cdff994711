"""Checkpoint converters, run as `python -m converters.<name>` (Paddle release -> ernie_jax formats)."""
