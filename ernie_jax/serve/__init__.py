"""The OpenAI-compatible server: `python -m ernie_jax.serve --mesh 8`.

cli.py (flags, device setup, start-up, graceful shutdown), protocol.py (request bodies -> SamplingParams),
api.py (routes, streaming, errors, disconnects), metrics.py (Prometheus).
"""
