"""ernie_jax: a JAX/XLA inference stack for Baidu's ERNIE-4.5 MoE models."""

from ernie_jax.checkpoint import CheckpointError, load_pretrained
from ernie_jax.config import ConfigError, ErnieConfig
from ernie_jax.llm import LLM, CompletionOutput, RequestError, RequestOutput
from ernie_jax.model import ErnieForCausalLM, param_counts
from ernie_jax.sampling import SamplingParams, SamplingParamsError

__all__ = ["LLM", "CheckpointError", "CompletionOutput", "ConfigError", "ErnieConfig", "ErnieForCausalLM",
           "RequestError", "RequestOutput", "SamplingParams", "SamplingParamsError", "load_pretrained",
           "param_counts"]
