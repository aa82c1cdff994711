"""Compiled CPU kernels: C++ sources beside this file, built with the machine's C++ compiler on first use and
called from XLA:CPU programs through jax.ffi.

A decode step of a small model on XLA:CPU is mostly overhead around little arithmetic (benchmarks/RESULTS.md,
"Compiled CPU kernels"): a matmul with a few rows runs through a library GEMM that repacks its weights on
every call, a mixture of experts is computed for every expert at a common row capacity, and paged attention
gathers every block of key slots into new arrays and runs a dozen small operations on each. `matvec.cc`
reads only the chosen experts' weights, once per step, as a streaming matrix-vector product (and a few rows
against a dense weight the same way); `paged_attention.cc` reads each sequence's slots in place, once.
`common.h` holds what they share.

A source (with common.h) is compiled once per machine into a cache (`$ERNIE_JAX_KERNEL_CACHE`, default
`~/.cache/ernie_jax/cpu_kernels`), named by a hash of the sources, the compiler's version, the jaxlib headers
and this CPU's flags (`-march=native`: a library built for one CPU is never loaded on another), written to
a temporary file and renamed, so concurrent processes never see half a library. `unavailable()` says why a
kernel cannot be used here (no compiler, a failed build), and the execution config then keeps the XLA
implementation and reports why: nothing falls back silently.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax

from ernie_jax.ops.base import Platform
from ernie_jax.ops.block_fp8_matmul.xla_cpu import cpu_flags

log = logging.getLogger("ernie_jax.ops")

SOURCE_DIR = pathlib.Path(__file__).parent
# kernel library -> the jax.ffi targets it defines (target name = handler symbol)
TARGETS = {"matvec": ("ErnieJaxExpertMatvec", "ErnieJaxMatvecT"),
           "paged_attention": ("ErnieJaxPagedDecodeAttention",)}
_LOADED: list[ctypes.CDLL] = []  # the libraries loaded in this process
_parallel_work = 0  # set_parallel_work


def compiler() -> str:
    return os.environ.get("CXX") or "c++"


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.path.expanduser(os.environ.get("ERNIE_JAX_KERNEL_CACHE", "~/.cache/ernie_jax/cpu_kernels")))


def _command(source: pathlib.Path, output: str) -> list[str]:
    return [compiler(), "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w",
            f"-I{jax.ffi.include_dir()}", f"-I{SOURCE_DIR}", str(source), "-o", output]


@functools.cache
def _library(name: str) -> ctypes.CDLL | str:
    """The loaded library `name`, built first if the cache lacks it, or why it cannot be."""
    source = SOURCE_DIR / f"{name}.cc"
    cxx = shutil.which(compiler())
    if cxx is None:
        return f"no C++ compiler ({compiler()!r} not found; set CXX)"
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"the C++ compiler {cxx} does not run: {e}"
    digest = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h"))]
    for part in (source.read_bytes(), *headers, version.encode(), jax.ffi.include_dir().encode(),
                 jax.__version__.encode(), " ".join(sorted(cpu_flags())).encode(),
                 " ".join(_command(source, "")).encode()):
        digest.update(part)
    path = cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            done = subprocess.run(_command(source, tmp), capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr[-300:])
                return f"building {source.name} with {cxx} failed: {first.strip()}"
            os.replace(tmp, path)
            log.info("built CPU kernel %s -> %s", source.name, path)
        except (OSError, subprocess.SubprocessError) as e:
            return f"building {source.name} with {cxx} failed: {e}"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError as e:
        return f"loading {path} failed: {e}"
    for symbol in TARGETS[name]:
        jax.ffi.register_ffi_target(symbol, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    lib.ErnieJaxSetParallelWork(ctypes.c_int64(_parallel_work))
    _LOADED.append(lib)
    return lib


def set_parallel_work(work: int) -> None:
    """The multiply-adds below which a kernel call runs on its calling thread alone, in every kernel library
    of this process, loaded or not yet (common.h, parallel_for). A speed setting only: which threads run never
    changes a result."""
    global _parallel_work
    _parallel_work = int(work)
    for lib in _LOADED:
        lib.ErnieJaxSetParallelWork(ctypes.c_int64(_parallel_work))


def unavailable(name: str) -> str | None:
    """None once the kernel library `name` is built, loaded and its targets registered; else why not."""
    lib = _library(name)
    return lib if isinstance(lib, str) else None


def require(name: str) -> None:
    """Registers the kernel library `name`'s targets, or raises naming why it cannot be built here."""
    why = unavailable(name)
    if why:
        raise RuntimeError(f"CPU kernel {name}: {why}")


def supports(library: str):
    """An Implementation's supports() for one that calls `library`: XLA:CPU, where the library builds."""
    def check(platform: Platform) -> str | None:
        if platform.backend != "cpu":
            return f"a CPU kernel (backend is {platform.backend})"
        return unavailable(library)
    return check
