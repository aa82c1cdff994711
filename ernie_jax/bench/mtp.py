"""`python -m ernie_jax.bench mtp`: MTP speculative decoding against plain decoding, in one run.

Two engines over the same weights (the embedded model by default), one with `--speculative-config`, serve
the same prompts at each concurrency of `--concurrency` (a run of c-prompt waves: c requests at once, the
next wave when they finish); their runs alternate, so a slow spell of a shared machine hits both. Prompts:
chat turns built from the held-out documents of `--corpus` (python -m ernie_jax.train.corpus), or, without
a corpus, a fixed set of English and Chinese questions. Reported per concurrency and engine: output tok/s,
TPOT p50, and for the MTP engine the acceptance rate per draft position and tokens per step; the ratio of
output tok/s is the speed-up. Greedy unless --temperature.

Then the 300B estimate: the decode step's extra cost of verifying k drafts (k + 1 tokens per row) and
drafting k more, from the simulator's H200 roofline (sim/cost.py) with the MTP layer's weights and FLOPs
added, and the speed-up that a given acceptance gives at each batch size.
"""

from __future__ import annotations

import time

import numpy as np

QUESTIONS = ["Tell me about the sea.", "What do you think of Mr. Darcy?", "Who is Hamlet?", "What is love?",
             "Describe the whale.", "你好", "说说曹操。", "写一首词。"]

# ERNIE-4.5-300B-A47B's MTP layer (spec section 5.1): eh_proj [2H, H] + one dense decoder layer (attention
# [H, (64 + 16) x 128] and [64 x 128, H], SwiGLU of 28,672), FP8 bytes = parameters.
MTP_300B_PARAMS = 2 * 8192 * 8192 + 8192 * 80 * 128 + 64 * 128 * 8192 + 3 * 8192 * 28672


def _prompts(llm, corpus: str | None, n: int) -> list[list[int]]:
    if corpus:
        from ernie_jax.train.corpus import load_corpus
        from ernie_jax.train.data import paragraphs
        users = [p for doc in load_corpus(corpus, "heldout") for p in paragraphs(doc["text"]) if 20 <= len(p) <= 300]
        users = [users[i] for i in np.linspace(0, len(users) - 1, n).astype(int)]  # spread over the sources
    else:
        users = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    return [llm.tokenizer.encode_chat([{"role": "user", "content": u}]) for u in users]


def _run(llm, prompts, sp, concurrency: int) -> tuple[float, int, list[float]]:
    """(wall seconds, output tokens, per-request TPOTs) of the prompts in waves of `concurrency`."""
    t0, n_out, tpots = time.perf_counter(), 0, []
    for i in range(0, len(prompts), concurrency):
        for o in llm.generate(prompt_token_ids=prompts[i:i + concurrency], sampling_params=sp):
            n_out += len(o.outputs[0].token_ids)
            tpots.append(o.metrics["tpot"])
    return time.perf_counter() - t0, n_out, [t for t in tpots if t is not None]


def h200_verify_cost(batch: int, k: int, context: int = 2048) -> tuple[float, float]:
    """(seconds of a plain decode step, of a speculative one) for `batch` sequences of `context` tokens on a
    4-H200 decode submesh: the speculative step scores batch x (k + 1) tokens (more experts touched, k + 1
    times the FLOPs, the same KV read) and runs the MTP layer over k + 1 positions plus k - 1 chained
    ones (its FP8 weights read once per layer call, its FLOPs per token)."""
    from ernie_jax.sim.cost import H200Cost
    cost, devices = H200Cost(), 4
    plain = cost.step(0, (0, 0), 0, batch, batch, batch * context, devices)
    verify = cost.step(0, (0, 0), 0, batch * (k + 1), batch * (k + 1), batch * context, devices)
    calls, tokens = k, batch * (2 * k)  # one call over k + 1 positions, k - 1 chained calls of one
    mtp = calls * MTP_300B_PARAMS / (devices * cost.hbm_bandwidth * cost.hbm_efficiency) + \
        tokens * 2 * MTP_300B_PARAMS / (devices * cost.fp8_flops * cost.decode_flops_efficiency) + \
        (calls - 1) * cost.step_overhead / 54  # step_overhead covers the model's 54 layers; a call runs one
    return plain, verify + mtp


def mtp(args) -> int:
    from ernie_jax.sharding.mesh import request_host_devices
    request_host_devices(args.mesh)
    from ernie_jax import LLM, SamplingParams
    from ernie_jax.assets import EMBEDDED_MODEL_NAME
    from ernie_jax.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig.parse(args.speculative_config)
    levels = [int(c) for c in args.concurrency.split(",")]
    kw = dict(max_model_len=args.max_model_len, max_num_seqs=max(levels), kv_cache_dtype=args.kv_cache_dtype)
    if args.mesh:
        kw.update(mesh=args.mesh, prefill_devices=args.mesh // 2)
    model = args.model or EMBEDDED_MODEL_NAME
    plain, fast = LLM(model, **kw), LLM(model, **kw, speculative_config=spec)
    prompts = _prompts(plain, args.corpus, args.num_prompts)
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.output_len,
                        ignore_eos=True, seed=0 if args.temperature else None)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for llm in (plain, fast):
        for c in levels:
            llm.generate(prompt_token_ids=prompts[:c], sampling_params=warm)
    k = spec.num_speculative_tokens
    print(f"model {model}; {spec.method}, k = {k}; {len(prompts)} prompts "
          f"({'held-out chat turns of ' + args.corpus if args.corpus else 'fixed questions'}), "
          f"{args.output_len} output tokens each, temperature {args.temperature}; {args.repeats} runs per engine, "
          "alternating; tok/s medians")
    print("| concurrency | engine | output tok/s | TPOT p50 | acceptance per position | tokens per step | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for c in levels:
        rates = {"plain": [], "mtp": []}
        tpots = {"plain": [], "mtp": []}
        stats = fast.engine.spec_stats
        before = (stats.num_drafts, stats.num_accepted_tokens, list(stats.accepted_per_pos))
        for _ in range(args.repeats):
            for name, llm in (("plain", plain), ("mtp", fast)):
                wall, n_out, t = _run(llm, prompts, sp, c)
                rates[name].append(n_out / wall)
                tpots[name] += t
        drafts = stats.num_drafts - before[0]
        per_pos = [(a - b) / drafts for a, b in zip(stats.accepted_per_pos, before[2])] if drafts else []
        per_step = 1 + (stats.num_accepted_tokens - before[1]) / drafts if drafts else 1.0
        speedup = [m / p for m, p in zip(rates["mtp"], rates["plain"])]
        for name in ("plain", "mtp"):
            accept = ", ".join(f"{a:.3f}" for a in per_pos) if name == "mtp" else "-"
            print(f"| {c} | {name} | {np.median(rates[name]):.1f} | {np.median(tpots[name]) * 1e3:.1f} ms | {accept} | "
                  f"{per_step if name == 'mtp' else 1.0:.3f} | "
                  f"{f'{np.median(speedup):.2f}x (runs: ' + ', '.join(f'{s:.2f}' for s in speedup) + ')' if name == 'mtp' else '-'} |")
    print(f"\n300B-A47B FP8 on a 4-H200 decode submesh (sim/cost.py roofline + the MTP layer), context 2,048, "
          f"k = {k}; speed-up = tokens per step x plain step / speculative step:")
    print("| batch | plain step | speculative step | extra cost | speed-up at 1.5 tokens/step | at 1.8 |")
    print("|---|---|---|---|---|---|")
    for batch in (1, 8, 32, 128):
        p, v = h200_verify_cost(batch, k)
        print(f"| {batch} | {p * 1e3:.2f} ms | {v * 1e3:.2f} ms | {v / p - 1:+.1%} | {1.5 * p / v:.2f}x | {1.8 * p / v:.2f}x |")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("mtp", help="MTP speculative decoding against plain decoding (speed-up, acceptance)")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--speculative-config", default='{"method": "mtp", "num_speculative_tokens": 1}')
    p.add_argument("--corpus", default=None, help="a corpus folder: prompts from its held-out documents")
    p.add_argument("--concurrency", default="1,16", help="comma-separated request concurrencies")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--mesh", type=int, default=None, help="PD on this many devices (half prefill); default one")
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(run=mtp)
