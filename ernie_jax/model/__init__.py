"""The ERNIE-4.5 MoE model: weights layout, pure forward functions and the NNX module."""

from ernie_jax.model.ernie import ErnieForCausalLM
from ernie_jax.model.forward import ForwardOutput
from ernie_jax.model.kv_cache import KVCache
from ernie_jax.model.weights import abstract_weights, init_weights, param_counts, weight_shapes

__all__ = ["ErnieForCausalLM", "ForwardOutput", "KVCache", "abstract_weights", "init_weights", "param_counts",
           "weight_shapes"]
