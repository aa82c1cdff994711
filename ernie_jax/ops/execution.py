"""The execution config: which implementation each op uses, chosen once when programs are built.

A frozen, hashable value that the model's functions take as a static argument, so it is part of every
compiled program's cache key: two configs never share a trace, and nothing global decides a formulation.
`ExecutionConfig.select(platform, kernels)` walks each op's ordered implementations (ops/<op>/__init__.py)
and keeps why it passed over the preferred ones; `ops.selfcheck.self_check` may then move a kernel that
fails on this device to the next implementation. `report()` is what the start-up log, the engine's
compile report and the `ernie_jax:op_implementation_info` metric show.
"""

from __future__ import annotations

import dataclasses

from ernie_jax.ops import (block_fp8_matmul, cpu_kernels, dense_matmul, grouped_fp8_matmul, grouped_int_matmul,
                           int_weight_matmul, paged_attention, routed_experts)
from ernie_jax.ops.base import Op, Platform
from ernie_jax.ops.dense import Matmuls
from ernie_jax.ops.routed_experts.common import ExpertOptions

OPS: dict[str, Op] = {op.name: op for op in (block_fp8_matmul.OP, grouped_fp8_matmul.OP, int_weight_matmul.OP,
                                             grouped_int_matmul.OP, paged_attention.OP, routed_experts.OP,
                                             dense_matmul.OP)}
KERNEL_MODES = ("auto", "pallas", "xla")
EP_DISPATCHES = ("replicated", "all_to_all")


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    platform: Platform = Platform("cpu")
    kernels: str = "auto"  # KERNEL_MODES: "pallas" forces the kernels (interpreted off GPUs), "xla" none
    block_fp8_matmul: str = "xla"
    grouped_fp8_matmul: str = "xla"
    int_weight_matmul: str = "xla"
    grouped_int_matmul: str = "xla"
    paged_attention: str = "xla"
    routed_experts: str = "ragged"
    dense_matmul: str = "xla"
    # Expert parallelism: "all_to_all" sends each assignment to its expert's device (its cost follows the
    # routing); "replicated" computes every token's assignments to local experts and psums (no all-to-all:
    # XLA:CPU has no ragged all-to-all, and there it is the cheaper one).
    ep_dispatch: str = "replicated"
    expert_tile_rows: int = 256
    sorted_tile_rows: int = 128
    expert_capacity_midpoints: bool = True  # ops/routed_experts/capacity.expert_capacities
    expert_matvec_max_tokens: int = 2048  # ops/routed_experts: the most tokens cpu_matvec's kernel takes
    matvec_max_rows: int = 4  # ops/dense_matmul: the most rows cpu_matvec's kernel takes
    attention_block_slots: int = 64  # key slots per step of the XLA paged-attention loop
    passed_over: tuple[tuple[str, str, str], ...] = ()  # (op, implementation, why) for the report

    def __post_init__(self):
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"kernels={self.kernels!r}: expected one of {KERNEL_MODES}")
        if self.ep_dispatch not in EP_DISPATCHES:
            raise ValueError(f"ep_dispatch={self.ep_dispatch!r}: expected one of {EP_DISPATCHES}")
        for name, op in OPS.items():
            library = op.get(getattr(self, name)).library  # an unknown implementation name fails here
            if library:  # registered before any program that calls it is traced or loaded from the store
                cpu_kernels.require(library)

    @classmethod
    def select(cls, platform: Platform, kernels: str = "auto", **overrides) -> "ExecutionConfig":
        """Each op's first implementation that supports `platform`; `overrides` name implementations (or
        other fields) outright, e.g. routed_experts="sorted_tiles" for training."""
        chosen, passed = {}, []
        for name, op in OPS.items():
            if name in overrides:
                continue
            chosen[name], skipped = op.choose(platform, kernels)
            passed += [(name, impl, why) for impl, why in skipped]
        cpu = platform.backend == "cpu"
        fields = dict(platform=platform, kernels=kernels, **chosen, ep_dispatch="replicated" if cpu else "all_to_all")
        fields.update(overrides)
        fields.setdefault("passed_over", tuple(passed))
        return cls(**fields)

    def uses_kernel(self, op: str) -> bool:
        return OPS[op].get(getattr(self, op)).kernel

    @property
    def kv_bf16_bits(self) -> bool:
        """Whether bf16 KV pools are stored as uint16 bits (ops/paged_attention/storage.py): on XLA:CPU, unless
        the attention kernel (which reads bf16) runs."""
        return self.platform.backend == "cpu" and not self.uses_kernel("paged_attention")

    @property
    def cpu_fp8_values(self) -> str:
        """The dtype XLA:CPU holds block-FP8 values in (model/weights.cpu_layout; both exact): bf16 for the
        xla_cpu block-FP8 matmul, which is chosen on CPUs with native bf16 dot products, else f32."""
        return "bfloat16" if self.block_fp8_matmul == "xla_cpu" else "float32"

    @property
    def kernel_layout(self) -> bool:
        """Whether block-FP8 weights should be stored K-major (what the FP8 kernels' MMAs read)."""
        return self.uses_kernel("block_fp8_matmul") or self.uses_kernel("grouped_fp8_matmul")

    @property
    def matmuls(self) -> Matmuls:
        return Matmuls(self.block_fp8_matmul, self.grouped_fp8_matmul, self.platform, self.int_weight_matmul,
                       self.grouped_int_matmul, self.dense_matmul, self.matvec_max_rows)

    @property
    def expert_options(self) -> ExpertOptions:
        return ExpertOptions(self.matmuls, self.expert_tile_rows, self.sorted_tile_rows, self.expert_capacity_midpoints,
                             self.expert_matvec_max_tokens)

    def fall_back(self, op: str, why: str) -> "ExecutionConfig":
        """This config with `op` moved past its current implementation (a failed self-check)."""
        current = getattr(self, op)
        nxt, skipped = OPS[op].choose(self.platform, self.kernels, after=current)
        passed = self.passed_over + ((op, current, why),) + tuple((op, i, w) for i, w in skipped)
        return dataclasses.replace(self, **{op: nxt, "passed_over": passed})

    def report(self) -> list[dict[str, str]]:
        """Per op: the implementation in use and why each preferred one was not used."""
        out = []
        for name in OPS:
            why = "; ".join(f"{impl}: {reason}" for op, impl, reason in self.passed_over if op == name)
            out.append({"op": name, "implementation": getattr(self, name), "passed_over": why})
        out.append({"op": "ep_dispatch", "implementation": self.ep_dispatch, "passed_over": ""})
        if self.platform.backend == "cpu":
            out.append({"op": "cpu_fp8_values", "implementation": self.cpu_fp8_values, "passed_over": ""})
        return out

    def describe(self) -> str:
        return ", ".join(f"{r['op']}={r['implementation']}" + (f" ({r['passed_over']})" if r["passed_over"] else "")
                         for r in self.report())


REFERENCE = ExecutionConfig()  # every op on its XLA reference: what the model's functions default to
