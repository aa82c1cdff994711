"""Benchmarks, one module per command of `python -m ernie_jax.bench` (bench/cli.py dispatches):

- `offline`: the offline engine on a batch of random prompts, optionally against HF transformers (offline.py);
- `serve`: a running OpenAI-compatible server under load, like `vllm bench serve` (serve.py; HTTP only, no JAX);
- `prefix`, `capacity`: KV memory, prefix caching on/off and oversubscribed pools (kv.py);
- `itl`: decode inter-token latency while a long prompt prefills under PD (itl.py);
- `mtp`: MTP speculative decoding against plain decoding on held-out text (mtp.py);
- `eplb`: expert-parallel balancedness with redundant experts (eplb.py);
- `step-profile`: where a decode step's time goes on the host and the device (step_profile.py).
"""
