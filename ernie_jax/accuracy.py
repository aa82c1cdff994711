"""Accuracy of reduced-precision variants against a reference model: logit metrics and the FP8 report.

`logit_metrics` compares two logit tensors (max and mean abs error, top-1 agreement, mean KL divergence of
the reference distribution to the tested one). `fp8_report` runs one checkpoint four ways on the same
tokens (the stored weights in f32 compute as reference; FP8 weight-only; FP8 w8a8; FP8 KV cache), through
the KV cache so the cache's quantization is included. benchmarks/fp8_accuracy.py prints it; the tests
assert bounds on the tiny golden models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ernie_jax.checkpoint import load_pretrained


def logit_metrics(reference: np.ndarray, test: np.ndarray) -> dict[str, float]:
    reference, test = np.asarray(reference, np.float64), np.asarray(test, np.float64)
    logp = jax.nn.log_softmax(reference, axis=-1)
    logq = jax.nn.log_softmax(test, axis=-1)
    kl = np.asarray(jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1))
    return {"max_abs": float(np.abs(test - reference).max()), "mean_abs": float(np.abs(test - reference).mean()),
            "top1_agreement": float((test.argmax(-1) == reference.argmax(-1)).mean()), "kl": float(kl.mean())}


def _cached_logits(model, ids: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    B, T = ids.shape
    cache = model.init_cache(B, T, kv_cache_dtype)
    return np.asarray(model.forward(ids, np.broadcast_to(np.arange(T), (B, T)), cache).logits)


def fp8_report(path: str, ids: np.ndarray) -> dict[str, dict[str, float]]:
    """Metrics of each FP8 variant of the checkpoint at `path` against its own weights in f32 compute."""
    reference = _cached_logits(load_pretrained(path, dtype=jnp.float32), ids, "auto")
    rows = {}
    for name, kw, kv in (("fp8 weight-only", dict(quantization="fp8", fp8_compute="weight_only"), "auto"),
                         ("fp8 w8a8", dict(quantization="fp8", fp8_compute="w8a8"), "auto"),
                         ("fp8 kv cache", {}, "fp8"),
                         ("bf16 kv cache", {}, "bfloat16")):
        rows[name] = logit_metrics(reference, _cached_logits(load_pretrained(path, dtype=jnp.float32, **kw), ids, kv))
    return rows
