"""`python -m ernie_jax.bench step-profile`: where one decode step's time goes, at 1 and 16 streams.

    python -m ernie_jax.bench step-profile [--model MODEL] [--streams 1,16] [--steps 64] [--dtype bfloat16]
        [--mesh M] [--no-chain] [--num-scheduler-steps N] [--variant OP=IMPL[,OP=IMPL...] ...] [--rounds 3]

For each stream count, that many greedy requests are prefilled, then `--steps` decode steps are driven on
the instance exactly as the engine's loop drives them (`Instance.begin` / `end`, the chained decode step
in flight included), with a timer around each part the host does:
- plan: the step boundary (aborts, arrivals, whether the step in flight must be read first) and
  `Scheduler.schedule`;
- inputs: the runner's host arrays (token ids, positions, block tables, sampling arrays);
- launch: handing the programs to the runtime (`ModelPrograms.run` / `sample` / `chain_decode`: host to
  device copies and dispatch; XLA runs them asynchronously);
- read: waiting for the results and reading them (`ModelRunner.read`: the device time not hidden behind the
  host, then the copy back);
- update: `Scheduler.update` (tokens to requests: stop rules, detokenizing, page growth).
The decode program alone (its last inputs replayed, waited for each time) gives the device time; the step
wall time minus the host parts is time the host waited. The weights' bytes on the instance's devices over
the decode program's time say how near the program runs to memory bandwidth (a decode step reads every
dense weight; whether it reads every expert depends on the expert implementation). Nothing in the engine is changed: the timers wrap
the instance's methods from outside.

`--variant` (repeatable) compares execution configs (ops/execution.py) on the same weights: each variant
names fields of the config (e.g. `block_fp8_matmul=xla`; an empty one is the default choice), gets its own
engine, and `--rounds` rounds run every variant's profile one after the other, so a slow spell of the
machine hits all of them; the table has one row per round.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager

import numpy as np

PARTS = ("plan", "inputs", "launch", "read", "update")


class _Timers:
    """Seconds per part; a timed call inside another counts in its own part only (the outer part's time
    excludes it): the runner's dispatch is "inputs" less the launches inside it."""

    def __init__(self):
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.stack: list[list] = []  # [part, start, seconds of timed calls inside]

    @contextmanager
    def part(self, name: str):
        self.stack.append([name, time.perf_counter(), 0.0])
        try:
            yield
        finally:
            _, t0, inner = self.stack.pop()
            spent = time.perf_counter() - t0
            self.seconds[name] += spent - inner
            if self.stack:
                self.stack[-1][2] += spent

    def wrap(self, obj, method: str, part: str):
        original = getattr(obj, method)

        def timed(*args, **kwargs):
            with self.part(part):
                return original(*args, **kwargs)
        setattr(obj, method, timed)
        return original


def profile(llm, streams: int, steps: int, prompt_len: int, seed: int = 0) -> dict:
    """One decode-step profile of `streams` requests on the engine's (first) instance. With multi-step decode
    (num_scheduler_steps), a step is one program of several decode steps; tok/s counts the tokens."""
    from ernie_jax import SamplingParams

    engine = llm.engine
    inst = engine.instances[-1]  # colocated: the only one; PD: the decode instance
    rng = np.random.default_rng(seed)
    vocab = engine.cfg.vocab_size
    per_step = engine.instances[-1].programs.decode_steps
    sp = SamplingParams(temperature=0, max_tokens=steps * per_step + 8, ignore_eos=True)
    ids = [engine.add_request(rng.integers(3, vocab, prompt_len).tolist(), sp) for _ in range(streams)]
    while any(not engine.requests[i].output_ids for i in ids):  # prefill every prompt (its own steps)
        engine.step()
    timers = _Timers()
    runner, scheduler, programs = inst.runner, inst.scheduler, inst.programs
    originals = {}
    for obj, method, part in ((scheduler, "schedule", "plan"), (runner, "dispatch", "inputs"),
                              (programs, "run", "launch"), (programs, "sample", "launch"),
                              (programs, "chain_decode", "launch"), (runner, "read", "read"),
                              (runner, "read_in_flight", "read"), (scheduler, "update", "update")):
        originals[(obj, method)] = timers.wrap(obj, method, part)
    last_run = {}
    run = programs.run

    def remember(kind, *args, **kwargs):  # the decode program's last inputs, to replay it alone
        if kind == "decode":
            last_run["args"] = (kind, *args)
        return run(kind, *args, **kwargs)
    programs.run = remember
    walls, plan_seconds = [], []
    tokens = sum(len(engine.requests[i].output_ids) for i in ids)
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            before = dict(timers.seconds)
            begun = inst.begin()
            inst.end(begun)
            walls.append(time.perf_counter() - t0)
            plan_seconds.append({k: timers.seconds[k] - before[k] for k in PARTS})
    finally:
        for (obj, method) in originals:
            vars(obj).pop(method, None)  # the class's method again
        vars(programs).pop("run", None)
    tokens = sum(len(engine.requests[i].output_ids) for i in ids) - tokens
    while engine.has_unfinished():
        engine.step()
    # the device alone: the decode program on its last inputs, waited for each time
    import jax
    device = []
    if "args" in last_run:
        kind, *args = last_run["args"]
        for _ in range(8):
            t0 = time.perf_counter()
            jax.block_until_ready(programs.run(kind, *args)[:3])
            device.append(time.perf_counter() - t0)
    med = {k: statistics.median(p[k] for p in plan_seconds) for k in PARTS}
    wall = statistics.median(walls)
    host = sum(med.values())
    return {"streams": streams, "wall": wall, **med, "host": host, "waited": max(0.0, wall - host),
            "device": statistics.median(device) if device else float("nan"), "tok_s": tokens / sum(walls)}


def _variant_model(model: str | None, dtype: str, spec: str):
    """The model with the execution config that `spec` ("field=value,..."; "" is the default choice) names."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ernie_jax import ErnieConfig, ErnieForCausalLM
    from ernie_jax.assets import EMBEDDED_MODEL_DIR
    from ernie_jax.checkpoint import read_pretrained
    from ernie_jax.ops.base import Platform
    from ernie_jax.ops.execution import ExecutionConfig
    types = {f.name: f.type for f in dataclasses.fields(ExecutionConfig)}
    overrides = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in types:
            raise SystemExit(f"--variant {spec!r}: {key!r} is not an execution config field ({sorted(types)})")
        overrides[key] = (int(value) if types[key] in (int, "int") else
                          value.lower() in ("1", "true", "yes") if types[key] in (bool, "bool") else value)
    ex = ExecutionConfig.select(Platform.of(jax.devices()[0]), **overrides)
    jdtype = jnp.dtype(dtype)
    if model is None or os.path.isdir(model):
        cfg, weights = read_pretrained(model or EMBEDDED_MODEL_DIR, jdtype)
        return ErnieForCausalLM.from_host(cfg, weights, jdtype, None, ex)
    return ErnieForCausalLM(ErnieConfig.preset(model), rngs=nnx.Rngs(0), dtype=jdtype, execution=ex)


def step_profile(args) -> int:
    from ernie_jax.sharding.mesh import request_host_devices
    request_host_devices(args.mesh)
    import jax

    from ernie_jax import LLM

    counts = [int(x) for x in args.streams.split(",")]
    variants = args.variant or [None]
    llms = {}
    for spec in variants:
        model = args.model if spec is None else _variant_model(args.model, args.dtype, spec)
        llm = llms[spec] = LLM(model, dtype=args.dtype, mesh=args.mesh, max_num_seqs=max(counts),
                               max_model_len=args.prompt_len + args.steps * args.num_scheduler_steps + 16,
                               background_compile=False, num_scheduler_steps=args.num_scheduler_steps,
                               **({"disaggregate": False} if args.mesh else {}))
        if args.no_chain:
            for inst in llm.engine.instances:
                inst.scheduler.overlap = False
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?") if jax.default_backend() == "cpu" else jax.devices()[0].device_kind
    print(f"model {args.model or 'the embedded model'} ({args.dtype}), {jax.device_count()} {jax.default_backend()} device(s) ({cpu}), "
          f"prompt {args.prompt_len} tokens, {args.steps} steps each of up to {args.num_scheduler_steps} decode "
          f"step(s), chained: {not args.no_chain}; medians per step, ms")
    if jax.default_backend() == "cpu":
        from ernie_jax.ops.block_fp8_matmul.xla_cpu import vector_extensions
        print("CPU vector extensions:", vector_extensions())
    weight_bytes = {}
    for spec, llm in llms.items():
        weights = llm.engine.instances[-1].programs.weights
        weight_bytes[spec] = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(weights))  # device 0's
        print(f"{'' if spec is None else f'variant {spec!r}: '}{llm.engine.instances[-1].programs.execution.describe()}; "
              f"weights as the decode program reads them: {weight_bytes[spec] / 1e6:.1f} MB a device")
    llm = next(iter(llms.values()))
    if args.mesh:  # what crosses devices each step: every collective is a rendezvous of the mesh's devices
        import collections
        import re
        hlo = llm.engine.instances[-1].programs.executables("decode")[0].as_text()
        found = collections.Counter(re.findall(r"= \S+ (all-gather|all-reduce|all-to-all|collective-permute|"
                                               r"reduce-scatter)(?:-start)?\(", hlo))
        print(f"collectives in a decode program: {sum(found.values())} {dict(sorted(found.items()))}")
    print(("| variant " if args.variant else "") + "| streams | step wall | plan | inputs | launch | read (incl. wait) | "
          "update | host total | decode program alone | weight bytes / program time | tok/s |")
    print(("|---" if args.variant else "") + "|---|---|---|---|---|---|---|---|---|---|---|")
    for n in counts:
        for llm in llms.values():
            profile(llm, n, 4, args.prompt_len)  # every program and sampler variant compiled and warm
        for _ in range(args.rounds if args.variant else 1):
            for spec, llm in llms.items():
                r = profile(llm, n, args.steps, args.prompt_len, seed=1)
                ms = {k: 1e3 * v for k, v in r.items() if k not in ("streams", "tok_s")}
                print(("" if spec is None else f"| {spec or 'default'} ") +
                      f"| {n} | {ms['wall']:.2f} | {ms['plan']:.2f} | {ms['inputs']:.2f} | {ms['launch']:.2f} | "
                      f"{ms['read']:.2f} | {ms['update']:.2f} | {ms['host'] - ms['read']:.2f} + read | "
                      f"{ms['device']:.2f} | {weight_bytes[spec] / r['device'] / 1e9:.1f} GB/s | {r['tok_s']:.0f} |",
                      flush=True)
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("step-profile", help="where a decode step's time goes (host parts, device, waiting)")
    p.add_argument("--model", default=None, help="checkpoint folder or preset (default: the embedded model)")
    p.add_argument("--streams", default="1,16", help="comma-separated stream counts")
    p.add_argument("--steps", type=int, default=64, help="decode steps profiled per stream count")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--mesh", default=None)
    p.add_argument("--no-chain", action="store_true", help="read every decode step before planning the next")
    p.add_argument("--num-scheduler-steps", type=int, default=1, help="decode steps a program runs (multi-step "
                   "decode): a profiled step is then one such program")
    p.add_argument("--variant", action="append", default=None, metavar="FIELD=VALUE[,...]",
                   help="an execution config to compare (repeatable; '' is the default choice), e.g. "
                        "block_fp8_matmul=xla")
    p.add_argument("--rounds", type=int, default=3, help="rounds of alternated variants (with --variant)")
    p.set_defaults(run=step_profile)
