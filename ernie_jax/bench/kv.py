"""KV memory benchmarks: `python -m ernie_jax.bench prefix ...` and `python -m ernie_jax.bench capacity ...`.

prefix: N requests sharing one system prompt (random token ids, --prefix-len) with distinct questions
(--suffix-len), all submitted at once, on two engines of the same model, prefix caching on and off; TTFT
p50/p99, wall time, tokens/s and the prefill tokens each computed. The runs alternate (--repeats), so a
slow spell of a shared machine hits both.

capacity: N chats without max_tokens on the embedded model (so a request's worst case is max_model_len)
that stop on their own, on a pool too small for their worst cases but big enough for their real lengths;
reports the peak of requests holding a seat, steps, wall time, output tokens/s and preemptions. It uses only
the engine API older commits have as well (add_request, step, running, prefilling), so running this file
as a script against an older checkout (`PYTHONPATH=OLD python ernie_jax/bench/kv.py capacity`) measures
the reserve-the-worst-case rule on the same machine.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

QUESTIONS = ["Tell me about the sea.", "请介绍一下三国演义。", "What did Elizabeth say to Darcy?", "写一首宋词。",
             "Who is Ahab?", "Describe the weather in London.", "What is a whale?", "说说诸葛亮。"]


def _ms(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3


def prefix(args) -> int:
    from ernie_jax import LLM, SamplingParams

    engines = {on: LLM(args.model, dtype=args.dtype, max_model_len=args.prefix_len + args.suffix_len + args.output_len,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       enable_prefix_caching=on) for on in (True, False)}
    vocab = engines[True].model.config.vocab_size
    rng = np.random.default_rng(0)
    system = rng.integers(3, vocab, args.prefix_len).tolist()
    prompts = [system + rng.integers(3, vocab, args.suffix_len).tolist() for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for llm in engines.values():  # warm-up: every program's first run pays one-off costs
        llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(temperature=0, max_tokens=2))
    rows = {on: {"ttft": [], "wall": [], "computed": [], "tokens": 0} for on in engines}
    outputs = {}
    for _ in range(args.repeats):
        for on, llm in engines.items():
            for pool in llm.engine.pools.values():
                pool.reset_cache()  # every run starts cold: the first request computes the system prompt
            before = llm.engine.counter("prefill_tokens")
            t0 = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
            r = rows[on]
            r["wall"].append(time.perf_counter() - t0)
            r["ttft"] += [o.metrics["ttft"] for o in outs]
            r["computed"].append(llm.engine.counter("prefill_tokens") - before)
            r["tokens"] = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
            outputs[on] = [o.outputs[0].token_ids for o in outs]
    cfg = engines[True].model.config
    print(f"model {args.model}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}; {args.num_prompts} "
          f"requests = {args.prefix_len}-token shared prefix + {args.suffix_len}-token question, "
          f"{args.output_len} output tokens; max_num_seqs {args.max_num_seqs}; {args.repeats} runs each, alternating")
    print("| prefix caching | TTFT p50 | TTFT p99 | wall s | requests/s | total tok/s | prefill tokens computed |")
    print("|---|---|---|---|---|---|---|")
    for on, r in rows.items():
        wall = float(np.median(r["wall"]))
        print(f"| {'on' if on else 'off'} | {_ms(r['ttft'], 50):.0f} ms | {_ms(r['ttft'], 99):.0f} ms | {wall:.2f} | "
              f"{args.num_prompts / wall:.2f} | {r['tokens'] / wall:.0f} | {r['computed'][-1]} |")
    same = sum(a == b for a, b in zip(outputs[True], outputs[False]))
    print(f"greedy outputs identical with and without the cache for {same}/{args.num_prompts} requests")
    return 0


def capacity(args) -> int:
    from ernie_jax import LLM, SamplingParams
    from ernie_jax.assets import EMBEDDED_MODEL_DIR

    llm = LLM(args.model or EMBEDDED_MODEL_DIR, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              num_gpu_blocks_override=args.num_pages + 1)
    engine = llm.engine
    chats = [llm.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], True)
             for i in range(args.num_prompts)]
    warm = engine.add_request(chats[0], SamplingParams(temperature=0, max_tokens=2))
    engine.run_until_done([warm])
    ids = [engine.add_request(c, SamplingParams(temperature=0.7, seed=i, max_tokens=None))
           for i, c in enumerate(chats)]
    reqs = [engine.requests[i] for i in ids]
    peak, steps = 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
        peak = max(peak, len(engine.running) + len(engine.prefilling))
    wall = time.perf_counter() - t0
    n_out = sum(len(r.output_ids) for r in reqs)
    lens = [len(r.prompt_ids) + len(r.output_ids) for r in reqs]
    on_demand = hasattr(engine, "counter")  # this script also runs against the checkout before pages on demand
    preempted = engine.counter("num_preemptions") if on_demand else "n/a"
    rule = "pages on demand" if on_demand else "reserve the worst case"
    print(f"{args.num_prompts} chats, no max_tokens (worst case {args.max_model_len} tokens each); real lengths "
          f"p50 {np.median(lens):.0f}, max {max(lens)} tokens; pool {args.num_pages} pages of "
          f"{engine.page_size} tokens; max_num_seqs {args.max_num_seqs}")
    print("| KV rule | peak requests running | steps | wall s | output tok/s | preemptions |")
    print("|---|---|---|---|---|---|")
    print(f"| {rule} | {peak} | {steps} | {wall:.2f} | {n_out / wall:.1f} | {preempted} |")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("prefix", help="a shared system prompt with and without prefix caching")
    p.add_argument("--model", default="bench-512", help="preset or checkpoint folder")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1)
    p.set_defaults(run=prefix)
    c = sub.add_parser("capacity", help="chats without max_tokens on a pool smaller than their worst case")
    c.add_argument("--model", default=None, help="checkpoint folder with a tokenizer (default: the embedded model)")
    c.add_argument("--num-prompts", type=int, default=64)
    c.add_argument("--max-model-len", type=int, default=1024)
    c.add_argument("--max-num-seqs", type=int, default=32)
    c.add_argument("--num-pages", type=int, default=128, help="KV pages (besides the null page)")
    c.set_defaults(run=capacity)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ernie_jax/bench/kv.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_parsers(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
