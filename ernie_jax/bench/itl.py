"""`python -m ernie_jax.bench itl`: decode inter-token latency of running streams while a long prompt prefills,
colocated, static PD and dynamic PD, in one run.

Each mode: an engine on --mesh devices (PD: prefill on the first half) steps on its instance threads (as
the server runs it); --streams greedy streams decode, then a --prompt-len prompt arrives. The gaps between
consecutive tokens of the streams are split into those inside the window from the long prompt's arrival to
its first token and those outside it (steady decoding). Colocated, every chunk of the long prompt sits
between two decode steps; disaggregated, the decode instance keeps stepping beside it.
"""

from __future__ import annotations

import threading
import time

import numpy as np


def _mode(args, name: str):
    from ernie_jax import LLM, SamplingParams

    kw = dict(disaggregate=False) if name == "colocated" else dict(prefill_devices=args.mesh // 2, pd_policy=name)
    llm = LLM(args.model, mesh=args.mesh, max_model_len=args.prompt_len + 64,
              max_num_seqs=args.streams + 1, max_num_batched_tokens=args.max_num_batched_tokens, **kw)
    engine = llm.engine
    vocab = llm.model.config.vocab_size
    rng = np.random.default_rng(0)
    stamps: dict[str, list[float]] = {}
    done = threading.Event()

    def on_output(req):
        stamps.setdefault(req.request_id, []).append(time.perf_counter())
        if req.request_id == "long" and req.finished:
            done.set()
    engine.start(on_output, lambda req, e: done.set())
    try:
        warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # every program's first run
        engine.add_request(rng.integers(3, vocab, args.prompt_len).tolist(), warm, request_id="warm")
        while engine.has_unfinished():
            time.sleep(0.05)
        sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        streams = [engine.add_request(rng.integers(3, vocab, 8).tolist(), sp, request_id=f"s{i}")
                   for i in range(args.streams)]
        while any(len(stamps.get(s, [])) < 8 for s in streams):
            time.sleep(0.01)
        arrival = time.perf_counter()
        engine.add_request(rng.integers(3, vocab, args.prompt_len).tolist(), warm, request_id="long")
        done.wait(600)
        first_token = stamps["long"][0]
        for s in streams:
            engine.abort(s)
        while engine.has_unfinished():
            time.sleep(0.05)
    finally:
        engine.stop()
    inside, outside = [], []
    for s in streams:
        ts = stamps[s]
        for a, b in zip(ts, ts[1:]):
            (inside if b > arrival and a < first_token else outside).append(b - a)
    decode_steps = {i.name: sum(1 for s in i.timeline if s.decode_rows and arrival < s.t1 < first_token)
                    for i in engine.instances}
    return dict(inside=inside, outside=outside, ttft=first_token - arrival, steps=decode_steps)


def itl(args) -> int:
    from ernie_jax.sharding.mesh import request_host_devices
    request_host_devices(args.mesh)
    rows = {name: _mode(args, name) for name in args.modes.split(",")}
    ms = lambda xs, q: np.percentile(xs, q) * 1e3 if xs else float("nan")  # noqa: E731
    print(f"{args.streams} streams decoding while a {args.prompt_len}-token prompt prefills in chunks of "
          f"{args.max_num_batched_tokens}; mesh {args.mesh} (PD: {args.mesh // 2} + {args.mesh // 2} devices); "
          f"model {args.model or 'embedded'}")
    print("| mode | ITL p50 during prefill | ITL p99 during prefill | ITL p50 otherwise | long prompt TTFT | "
          "decode steps during prefill |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        steps = ", ".join(f"{k} {v}" for k, v in r["steps"].items())
        print(f"| {name} | {ms(r['inside'], 50):.1f} ms | {ms(r['inside'], 99):.1f} ms | "
              f"{ms(r['outside'], 50):.1f} ms | {r['ttft'] * 1e3:.0f} ms | {steps} |")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("itl", help="decode ITL during a long prefill: colocated, static PD, dynamic PD")
    p.add_argument("--model", default=None, help="checkpoint folder or preset (default: the embedded model)")
    p.add_argument("--mesh", type=int, default=8)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--modes", default="colocated,static,dynamic")
    p.set_defaults(run=itl)
