"""ernie_jax: a JAX/XLA inference stack for Baidu's ERNIE-4.5 MoE models.

The public names load on first use, so command-line clients that need none of them (the serving
benchmark, `--help`) start without importing JAX.
"""

import importlib

_EXPORTS = {
    "LLM": "ernie_jax.llm", "CompletionOutput": "ernie_jax.llm", "RequestError": "ernie_jax.llm",
    "RequestOutput": "ernie_jax.llm", "CheckpointError": "ernie_jax.checkpoint",
    "load_pretrained": "ernie_jax.checkpoint", "ConfigError": "ernie_jax.config", "ErnieConfig": "ernie_jax.config",
    "ErnieForCausalLM": "ernie_jax.model", "param_counts": "ernie_jax.model",
    "SamplingParams": "ernie_jax.sampling", "SamplingParamsError": "ernie_jax.sampling",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ernie_jax' has no attribute {name!r}")
