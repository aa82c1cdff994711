"""`python -m ernie_jax.sim.calibrate --out cpu_cost.json`: fit the simulator's cost model to this machine and
check that it predicts the real engine.

For colocated serving (one instance on --mesh devices) and dynamic PD (two instances of half as many): the
real engine (the embedded model unless --model) serves a calibration trace on its instance threads,
requests arriving on the trace's clock; the instances' StepRecords and the KV hand-overs' measured times
fit a `FittedCost` (sim/cost.py). Then the same engine serves a second trace (another seed) and the
simulator replays that trace against the fitted model with the engine's settings; the table compares
TTFT and TPOT p50, measured and predicted. The fitted model is written to --out for
`python -m ernie_jax.sim --cost cpu_cost.json`.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import numpy as np

from ernie_jax.engine.request import Request
from ernie_jax.sampling import SamplingParams
from ernie_jax.sim.cost import FittedCost
from ernie_jax.sim.simulator import SimConfig, simulate
from ernie_jax.sim.traces import TraceRequest, make_trace


def replay(engine, trace: list[TraceRequest], *, seed: int = 0, timeout: float = 900) -> list[Request]:
    """Serve `trace` on the engine's instance threads, each request added at its arrival time (random prompt
    tokens, greedy, exactly its output length); returns the finished requests."""
    rng = np.random.default_rng(seed)
    vocab = engine.cfg.vocab_size
    prompts = [rng.integers(3, vocab, t.prompt_len).tolist() for t in trace]
    errors: list[BaseException] = []
    engine.start(lambda req: None, lambda req, e: errors.append(e))
    reqs = []
    try:
        t0 = time.perf_counter() - trace[0].arrival
        for i, (t, prompt) in enumerate(zip(trace, prompts)):
            time.sleep(max(0.0, t0 + t.arrival - time.perf_counter()))
            with engine.lock:  # the request cannot finish before it is in hand
                rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=t.output_len,
                                                                ignore_eos=True), request_id=f"replay-{i}")
                reqs.append(engine.requests[rid])
        deadline = time.perf_counter() + timeout
        while engine.has_unfinished() and not errors:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"the engine did not finish the trace within {timeout} s")
            time.sleep(0.02)
    finally:
        engine.stop()
    if errors:
        raise RuntimeError(f"the engine failed during the replay: {errors[0]!r}") from errors[0]
    return reqs


def _p50(xs) -> float:
    return float(np.median([x for x in xs if x is not None]))


def calibrate(args) -> int:
    from ernie_jax.sharding.mesh import request_host_devices
    request_host_devices(args.mesh)
    from ernie_jax import LLM
    from ernie_jax.engine.cpu_rules import min_decode_rows

    trace = lambda seed: make_trace(args.trace, args.rate, args.num_requests, seed=seed, scale=args.scale,  # noqa: E731
                                    max_model_len=args.max_model_len)
    timelines, num_pages, transfer, rows = {}, {}, (0.0, 0), []
    for mode in ("colocated", "dynamic"):
        kw = dict(disaggregate=False) if mode == "colocated" else dict(prefill_devices=args.mesh // 2, pd_policy=mode)
        llm = LLM(args.model, mesh=args.mesh, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, **kw)
        engine = llm.engine
        devices = args.mesh if mode == "colocated" else args.mesh // 2
        replay(engine, trace(1))
        timelines[devices] = [list(i.timeline) for i in engine.instances]
        num_pages[devices] = engine.instances[0].pool.capacity
        if engine.disaggregated:  # every hand-over so far: seconds, KV tokens
            moved = engine.instance("prefill").transfer
            transfer = (moved.seconds, moved.pages * engine.page_size)
        settings = dict(max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
                        block_size=engine.page_size, max_model_len=engine.max_model_len,
                        enable_prefix_caching=engine.instances[0].pool.enable_caching,
                        min_decode_rows=min_decode_rows(llm.model))
        cost = FittedCost.fit(timelines, transfer_seconds=transfer[0], transfer_tokens=transfer[1], num_pages=num_pages,
                              settings={**settings, "scale": args.scale}, name=args.name, ttft_slo=args.ttft_slo,
                              tpot_slo=args.tpot_slo)
        measured = replay(engine, trace(0))
        cfg = SimConfig(mode, args.mesh, args.mesh // 2 if engine.disaggregated else 0, **settings)
        predicted = simulate(trace(0), cost, cfg).requests
        rows.append((mode, [_p50(r.metrics.ttft for r in measured), _p50(r.tpot for r in measured)],
                     [_p50(r.metrics.ttft for r in predicted), _p50(r.tpot for r in predicted)]))
        del llm, engine, measured
        gc.collect()
    cost.save(args.out)
    print(f"cost model {args.name!r} -> {args.out}: {cost.describe()}; hand-over "
          f"{cost.transfer_per_token * 1e6:.2f} us per KV token")
    print(f"check: trace {args.trace} (seed 0; fitted on seed 1), {args.num_requests} requests at {args.rate:g}/s, "
          f"scale {args.scale:g}; mesh {args.mesh}; max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}, max_model_len {args.max_model_len}")
    print("| mode | TTFT p50 measured | predicted | error | TPOT p50 measured | predicted | error |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for mode, (m_ttft, m_tpot), (p_ttft, p_tpot) in rows:
        e_ttft, e_tpot = p_ttft / m_ttft - 1, p_tpot / m_tpot - 1
        worst = max(worst, abs(e_ttft), abs(e_tpot))
        print(f"| {mode} | {m_ttft * 1e3:.0f} ms | {p_ttft * 1e3:.0f} ms | {e_ttft:+.0%} | {m_tpot * 1e3:.1f} ms | "
              f"{p_tpot * 1e3:.1f} ms | {e_tpot:+.0%} |")
    print(f"largest error {worst:.0%} (target: within 25 %)")
    return 0 if worst <= args.tolerance else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.sim.calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="cpu_cost.json")
    ap.add_argument("--model", default=None, help="checkpoint folder or preset (default: the embedded model)")
    ap.add_argument("--name", default="this CPU, embedded model")
    ap.add_argument("--mesh", type=int, default=8)
    ap.add_argument("--trace", default="mixed")
    ap.add_argument("--rate", type=float, default=0.5, help="mean arrivals per second (a load both modes serve)")
    ap.add_argument("--num-requests", type=int, default=50)
    ap.add_argument("--scale", type=float, default=0.25, help="multiply every trace length")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=128)
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="the fitted model's TTFT target, seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.1, help="the fitted model's TPOT target, seconds")
    ap.add_argument("--tolerance", type=float, default=0.25, help="exit 1 when a prediction is further off")
    return calibrate(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
