"""Compiled step programs kept on disk under a key of what they are built from, so that a warm start loads
them without tracing or lowering anything.

JAX's persistent compilation cache is keyed by the lowered program: to find an entry, the step function must
first be traced and lowered, which holds the GIL and costs about as much as a cache hit saves on a small
model (benchmarks/RESULTS.md, "Warm start without lowering"). This store keys a program by everything its
lowering is a function of, known before tracing:
- the program: its kind and bucket (B, T), the model config, the sharding plan, the execution config, the
  speculative depth, pages per sequence, batch invariance;
- its arguments' shapes, dtypes, pytree structure (with static fields such as a BlockFP8's block) and
  shardings, device ids included;
- the software: the jax and jaxlib versions, the backend's platform version, XLA_FLAGS, JAX's config values,
  and a hash of the package's source files the step functions import, transitively (an edit there makes new
  keys; entries are never trusted across versions);
and stores `jax.experimental.serialize_executable`'s bytes (zlib-compressed) under the key's hash, beside
JAX's cache (the store is on exactly when that cache is), trimmed to `max_bytes`, least recently used first.

An entry that cannot be read or loaded is logged with its file and compiled again. A mesh with devices of
other processes never uses the store (each process must lower the same program as its peers). A program that
JAX's cache supplied is not stored: XLA:CPU re-serializes a loaded executable without some of its kernels
(running the copy fails with "Function ... not found"), so only programs compiled here are stored, and a
program whose key changed but whose HLO did not keeps the lowering path until its HLO changes.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import logging
import os
import pathlib
import pickle
import tempfile
import threading
import zlib
from typing import Any

import jax
from jax import monitoring
from jax.experimental import serialize_executable

log = logging.getLogger("ernie_jax.engine")

SUBDIR = "ernie_jax_programs"
FORMAT = 1  # bump when what an entry holds changes


_compiles = threading.local()  # .cache_hit: whether this thread's compile was a JAX persistent-cache hit


def _note_cache_hit(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _compiles.cache_hit = True


@functools.lru_cache(maxsize=1)
def _listen() -> None:
    monitoring.register_event_listener(_note_cache_hit)


ROOT_MODULE = "ernie_jax.engine.step_functions"  # what every stored program is traced from


def _module_file(root: pathlib.Path, module: str) -> pathlib.Path | None:
    base = root.joinpath(*module.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def traced_sources() -> list[pathlib.Path]:
    """The package's source files a step program is traced from: the step functions and every ernie_jax module
    they import, transitively (read from the import statements), and the C++ kernel sources beside them (a
    program calls a compiled CPU kernel by name). Edits elsewhere (the server, the router, benchmarks) leave
    the stored programs valid."""
    root = pathlib.Path(__file__).resolve().parents[1]
    todo, seen = [ROOT_MODULE], {}
    while todo:
        module = todo.pop()
        path = _module_file(root, module)
        if path is None or module in seen:
            continue
        seen[module] = path
        for node in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.startswith("ernie_jax")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ernie_jax"):
                todo.append(node.module)  # and its names, where they are submodules
                todo += [f"{node.module}.{a.name}" for a in node.names]
    kernels = {src for path in seen.values() for pattern in ("*.cc", "*.h") for src in path.parent.glob(pattern)}
    return sorted(set(seen.values()) | kernels)


_hash_lock = threading.Lock()  # compile threads ask at once; ast.parse is not safe across threads in 3.11


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in traced_sources():
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def source_hash() -> str:
    """sha256 over the traced sources (paths and contents): a program traced from other code is another
    program."""
    with _hash_lock:
        return _source_hash()


def _sharding_text(s) -> str:
    mesh = getattr(s, "mesh", None)
    if mesh is not None:  # NamedSharding: the spec, the mesh's axes and its devices in mesh order
        return (f"{s.spec}|{dict(mesh.shape)}|{mesh.device_ids.ravel().tolist()}"
                f"|{getattr(s, 'memory_kind', None)}")
    return f"{type(s).__name__}{sorted(d.id for d in s.device_set)}|{getattr(s, 'memory_kind', None)}"


def describe(tree) -> str:
    """A pytree of arrays or ShapeDtypeStructs (and their shardings) as text: structure, then per leaf its
    shape, dtype and sharding."""
    def leaf(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            s = getattr(x, "sharding", None)
            return f"{tuple(x.shape)}{x.dtype}@{_sharding_text(s) if s is not None else None}"
        if hasattr(x, "device_set"):
            return _sharding_text(x)
        return repr(x)
    leaves, structure = jax.tree.flatten(tree)
    return f"{structure}:{[leaf(x) for x in leaves]}"


def _environment() -> str:
    backend = jax.devices()[0].client
    config = sorted((k, repr(v)) for k, v in jax.config.values.items()
                    if "cache" not in k and "log" not in k)
    import jaxlib
    return repr((FORMAT, jax.__version__, jaxlib.__version__, backend.platform, backend.platform_version,
                 os.environ.get("XLA_FLAGS", ""), config, source_hash()))


class ExecutableStore:
    """Serialized executables in `directory` by key (see the module docstring)."""

    def __init__(self, directory: str, devices, max_bytes: int = 2 << 30):
        self.directory = pathlib.Path(directory)
        self.devices = list(devices)  # the programs' device assignment (a mesh's devices in mesh order)
        self.max_bytes = max_bytes

    @classmethod
    def configured(cls, devices) -> "ExecutableStore | None":
        """The store for programs on `devices` (their device assignment, in order) beside JAX's persistent
        compilation cache, or None: no cache configured (or JAX's cache turned off), or `devices` include
        another process's (a program spanning processes is lowered by every process alike)."""
        root = jax.config.jax_compilation_cache_dir
        if not root or not jax.config.jax_enable_compilation_cache:
            return None
        if any(d.process_index != jax.process_index() for d in devices):
            return None
        _listen()
        return cls(os.path.join(os.path.expanduser(root), SUBDIR), devices)

    @staticmethod
    def key(*parts: Any) -> str:
        """The hash of a program's description (texts from `describe` and reprs) and of the environment."""
        return hashlib.sha256(repr((parts, _environment())).encode()).hexdigest()

    def _path(self, key: str) -> pathlib.Path:
        return self.directory / f"{key}.exe"

    def load(self, key: str):
        """The executable stored under `key`, or None (absent, or unreadable: logged, then compiled anew)."""
        path = self._path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("compiled program %s could not be read (%s); compiling it", path, e)
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(zlib.decompress(blob))
            exe = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                             execution_devices=self.devices)
        except Exception as e:  # noqa: BLE001 -- any damage to an entry means: compile it again
            log.warning("compiled program %s could not be loaded (%s: %s); compiling it", path, type(e).__name__, e)
            return None
        os.utime(path)  # recently used: trimming keeps it
        return exe

    def save(self, key: str, exe) -> None:
        """Store `exe` under `key` (written to a temporary file, then renamed: a concurrent reader sees a
        whole entry or none). A program that cannot be serialized or written is logged and not stored."""
        try:
            blob = zlib.compress(pickle.dumps(serialize_executable.serialize(exe)), 1)
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
        except Exception as e:  # noqa: BLE001 -- the program still runs; only the next start is slower
            log.warning("compiled program not stored in %s (%s: %s)", self.directory, type(e).__name__, e)
            return
        self._trim()

    def _trim(self) -> None:
        entries = []
        for p in self.directory.glob("*.exe"):
            try:
                st = p.stat()
            except FileNotFoundError:  # another process trimmed it
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size

    def compile(self, key: str, lowered):
        """lowered.compile(), stored under `key` unless JAX's persistent cache supplied it (module docstring)."""
        _compiles.cache_hit = False
        exe = lowered.compile()
        if _compiles.cache_hit:
            log.debug("compiled program %s came from JAX's cache: not stored", key[:12])
        else:
            self.save(key, exe)
        return exe
