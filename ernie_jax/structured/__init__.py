"""Structured output: what a request's text must match, as a grammar (spec.py), the per-request matcher
that masks the tokens it cannot take next (guide.py, over llguidance), tool calls in ERNIE-4.5's format
(tools.py) and the split of a thinking model's reasoning from its answer (reasoning.py).

The engine holds one `Guides` per tokenizer; a request with `SamplingParams.structured_outputs` gets its
own `Guide`, whose token bitmask the runner hands to the sampler and which advances with each token the
output processor appends. Plain Python and numpy; no JAX.
"""

from ernie_jax.structured.spec import StructuredOutputError, StructuredOutputsParams

__all__ = ["StructuredOutputError", "StructuredOutputsParams"]
