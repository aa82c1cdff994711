"""What every op shares: the platform an implementation is chosen for, and an op's ordered implementations.

An op (block_fp8_matmul/, paged_attention/, ...) is an `Op`: a name and an ordered tuple of
`Implementation`s, preferred first. Each implementation says whether it supports a `Platform` (a reason
string when not, None when it does); `Op.choose` walks the list and takes the first that does, keeping
the reasons of those it passed over for the start-up report. Layout limits that only a call can know (a
sharded weight whose shards do not hold whole scale blocks) are checked where the call is made and
reported through `note_fallback`, which logs each distinct fallback once: nothing falls back silently.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

log = logging.getLogger("ernie_jax.ops")

FP8_MMA_CAPABILITY = (8, 9)  # e4m3 tensor-core MMAs: Ada (8.9) and Hopper (9.0) onward


@dataclasses.dataclass(frozen=True)
class Platform:
    """The devices programs are built for. compute_capability: (major, minor) of a CUDA GPU, else None.
    interpret: run Pallas kernels in the Pallas interpreter (kernels forced on a CPU: tests and checks)."""
    backend: str  # "cpu" | "gpu" | "tpu"
    compute_capability: tuple[int, int] | None = None
    device_kind: str = ""

    @classmethod
    def of(cls, device) -> "Platform":
        cc = getattr(device, "compute_capability", None)
        if isinstance(cc, str):
            cc = tuple(int(p) for p in cc.split(".")[:2])
        return cls(device.platform, cc, getattr(device, "device_kind", ""))

    @property
    def interpret(self) -> bool:
        return self.backend != "gpu"


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to compute an op. `supports(platform)` -> None, or why this implementation cannot run there.
    kernel: a Pallas kernel (self-checked at start-up; excluded by `--kernels xla`). library: the compiled CPU
    kernel library it calls (ops/cpu_kernels), registered whenever an execution config names it."""
    name: str
    fn: Callable
    supports: Callable[[Platform], str | None] = lambda platform: None
    kernel: bool = False
    library: str | None = None


class Op:
    def __init__(self, name: str, implementations: tuple[Implementation, ...]):
        self.name, self.implementations = name, tuple(implementations)

    def names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.implementations)

    def get(self, name: str) -> Implementation:
        for impl in self.implementations:
            if impl.name == name:
                return impl
        raise ValueError(f"op {self.name}: unknown implementation {name!r}; expected one of {self.names()}")

    def choose(self, platform: Platform, kernels: str = "auto", after: str | None = None
               ) -> tuple[str, list[tuple[str, str]]]:
        """The first implementation that supports `platform` (after `after`, when given) -> (name, the
        (implementation, reason) pairs passed over). kernels: "auto" | "pallas" (kernels wherever they
        are implemented: interpreted off GPUs) | "xla" (no kernels)."""
        skipped, start = [], 0 if after is None else self.names().index(after) + 1
        for impl in self.implementations[start:]:
            if impl.kernel and kernels == "xla":
                why = "--kernels xla"
            else:
                why = impl.supports(platform)
                if why and impl.kernel and kernels == "pallas" and platform.backend != "gpu":
                    why = None  # forced onto a CPU: the kernel runs in the Pallas interpreter
            if why is None:
                return impl.name, skipped
            skipped.append((impl.name, why))
        raise ValueError(f"op {self.name}: no implementation supports {platform}: {skipped}")


def kernel_platform(need_fp8_mma: bool) -> Callable[[Platform], str | None]:
    """supports() of a Pallas-Triton kernel: a CUDA GPU, with e4m3 MMAs when the kernel multiplies in FP8."""
    def supports(platform: Platform) -> str | None:
        if platform.backend != "gpu":
            return f"a Pallas-Triton GPU kernel (backend is {platform.backend})"
        cc = platform.compute_capability
        if need_fp8_mma and (cc is None or tuple(cc) < FP8_MMA_CAPABILITY):
            return f"FP8 MMA needs compute capability 8.9 or higher (this GPU: {cc})"
        return None
    return supports


def interpret(platform: Platform | None) -> bool:
    """Whether a Pallas kernel runs in the interpreter: off GPUs. A call that names no platform takes JAX's
    default backend's (a GPU benchmark once ran the kernels interpreted because it named none)."""
    if platform is None:
        import jax
        return jax.default_backend() != "gpu"
    return platform.interpret


def only_on(backend: str, why: str) -> Callable[[Platform], str | None]:
    return lambda platform: None if platform.backend == backend else why


_noted: set[tuple[str, str, str]] = set()
FALLBACKS: list[tuple[str, str, str]] = []  # (op, implementation not used, why), for reports; never read to choose


def note_fallback(op: str, implementation: str, why: str) -> None:
    """A call could not take its configured implementation (a layout limit) and took the next one."""
    key = (op, implementation, why)
    if key not in _noted:
        _noted.add(key)
        FALLBACKS.append(key)
        log.warning("op %s: %s not used for this layout (%s); using the next implementation", op,
                    implementation, why)
