"""What an engine says about itself: the compile report (programs, seconds, op implementations) and the
start-up summary a server logs (devices, PD split, EPLB, speculative decoding, pools)."""

from __future__ import annotations

from typing import Any, NamedTuple

from ernie_jax.ops.base import FALLBACKS


class CompileReport(NamedTuple):
    programs: list[tuple[str, Any, float]]  # (program, bucket, compile seconds)
    ops: list[dict[str, str]]  # {"op", "implementation", "passed_over", "layout_fallbacks"}


def compile_report(engine) -> CompileReport:
    """The compiled programs (name, bucket, seconds) and, per op, the implementation the programs run and
    why preferred ones were not used (ops/execution.py; layout fallbacks met while tracing included)."""
    programs = [entry for i in engine.instances for entry in i.programs.report]
    ops = engine.instances[0].programs.execution.report()
    for entry in ops:
        entry["layout_fallbacks"] = "; ".join(f"{impl} -> xla for {why}" for op, impl, why in FALLBACKS
                                              if op == entry["op"])
    return CompileReport(programs, ops)


def startup_lines(engine) -> list[str]:
    """The engine's start-up summary, a line per fact."""
    ids = lambda inst: ",".join(str(d.id) for d in inst.programs.devices)  # noqa: E731
    platform = engine.instances[0].programs.devices[0].platform
    if engine.disaggregated:
        lines = [f"mesh split: prefill on devices [{ids(engine.instance('prefill'))}], decode on devices "
                 f"[{ids(engine.instance('decode'))}] ({platform}); pd policy {engine.policy.mode}"]
    else:
        lines = [f"colocated: prefill and decode on devices [{ids(engine.instances[0])}] ({platform})"]
    if engine.balancer is not None:
        b = engine.balancer
        lines.append(f"EPLB: {b.config.num_redundant_experts} redundant experts over {b.num_devices} expert-parallel "
                     f"devices ({b.placement.slots_per_device} slots each); re-placed every "
                     f"{b.config.step_interval or '(never: on request)'} steps from the last {b.config.window_size}")
    if engine.speculative:
        lines.append(f"speculative decoding: {engine.speculative.method}, "
                     f"{engine.speculative.num_speculative_tokens} draft tokens per step from the model's MTP layer")
    lines.append("engine config: " + ", ".join(f"{k}={v}" for k, v in engine.config.summary().items()))
    report = compile_report(engine)
    for op in report.ops:
        lines.append(f"op {op['op']}: {op['implementation']}"
                     + (f" (not used: {op['passed_over']})" if op["passed_over"] else "")
                     + (f"; layout fallbacks: {op['layout_fallbacks']}" if op["layout_fallbacks"] else ""))
    pending = sum(i.programs.pending for i in engine.instances)
    loaded = sum(len(i.programs.loaded) for i in engine.instances)
    lines.append(f"compiled {len(report.programs)} programs"
                 + (f" ({loaded} loaded from the compiled-program store)" if loaded else "")
                 + f" in {engine.startup_seconds:.1f} s ("
                 + ", ".join(f"{name} {size}: {sec:.1f}s" for name, size, sec in report.programs) + ")"
                 + (f", {pending} more compiling in the background" if pending else "")
                 + f"; max_model_len {engine.max_model_len}, max_num_seqs {engine.max_num_seqs}")
    for inst in engine.instances:
        pool = inst.pool
        lines.append(f"KV pool {inst.name}: {pool.capacity} pages of {pool.page_size} tokens "
                     f"({pool.capacity * pool.page_size} tokens; sized by {inst.programs.pool_sizing}), prefix "
                     f"caching {'on' if pool.enable_caching else 'off'}")
    return lines
