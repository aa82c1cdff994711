"""The compiled programs of one (sub)mesh: its weights placed, its KV page pool, and one ahead-of-time compiled
executable per bucketed shape (engine/shapes.py) of the step functions (engine/step_functions.py).

Prefill programs have shape (B, T), decode programs a batch size B (one token for each of B sequences, or
k + 1 with speculative decoding). Every executable donates the pool and has explicit input and output
shardings, so the pool is updated in place and never leaves its devices. `compile_startup` compiles the
largest bucket of each kind (of `startup_kinds`), which serves any request, for all of an engine's instances
at once; `compile_rest` the others,
which join `shapes` as each is ready (`take_rest` hands them to a compile thread behind a serving
engine). A prefill that also returns prompt logprobs compiles on first use unless listed in
score_buckets. `report` lists programs and compile seconds (they compile in parallel, so they overlap).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from ernie_jax.engine.compile_pool import compile_all
from ernie_jax.engine.config import CacheConfig
from ernie_jax.engine.cpu_rules import cpu_expert_groups, kernel_parallel_work, platform
from ernie_jax.engine.executable_store import ExecutableStore, describe
from ernie_jax.engine.expert_moves import move_experts
from ernie_jax.engine.multihost import collective
from ernie_jax.engine.pool_sizing import size_pool
from ernie_jax.engine.sampling_inputs import SAMPLING_ARGS
from ernie_jax.engine.shapes import ShapeTable
from ernie_jax.engine.step_functions import _chain_decode, _chain_verify, lower_step, step_program
from ernie_jax.model.ernie import ErnieForCausalLM
from ernie_jax.model.forward import rope_cache
from ernie_jax.model.kv_cache import KV_CACHE_DTYPES, KVCache
from ernie_jax.model.weights import cpu_layout
from ernie_jax.ops import cpu_kernels
from ernie_jax.ops.paged_attention.storage import pool_dtype
from ernie_jax.sampling import sample

log = logging.getLogger("ernie_jax.engine")


class ModelPrograms:
    def __init__(self, model: ErnieForCausalLM, name: str, cache: CacheConfig, *, max_pages_per_seq: int,
                 prefill_buckets: list[tuple[int, int]], decode_buckets: list[int],
                 score_buckets: tuple[int, ...] = (), batch_invariant: bool = False, speculative_tokens: int = 0,
                 expert_placement=None, pages_without_memory_limit: int = 0,
                 startup_kinds: tuple[str, ...] = ("prefill", "decode"), decode_steps: int = 1):
        """prefill_buckets: (B, T) shapes, with (1, T) for every chunk length T; decode_buckets: batch sizes.
        cache: the pool's pages (num_gpu_blocks_override, the null page included), or None to size it from
        device memory: gpu_memory_utilization (default 0.9, vLLM's) of each device's memory minus what is
        resident, or, where the platform reports no memory limit, pages_without_memory_limit (and
        gpu_memory_utilization must not be given); block_size; kv_cache_dtype. `pool_sizing` says which rule
        sized the pool.
        score_buckets: chunk lengths whose prompt-scoring prefill compiles with the other buckets (a
        server's, in the background); any other length compiles on first use.
        decode_steps: n > 1 for multi-step decode (without speculative tokens): each decode bucket also compiles
        a program that runs n decode steps (step_functions._multi_step), after the other buckets.
        speculative_tokens: k > 0 for MTP speculative decoding: the pool holds the MTP block's KV too,
        prefill programs also draft k tokens, decode programs verify k drafts (T = k + 1) and draft again.
        expert_placement: the redundant-expert placement the model's weights were laid out in (EPLB), or None.
        startup_kinds: the kinds whose largest bucket compile_startup() compiles; the rest wait for
        compile_rest() or take_rest() (in order of use, below)."""
        self.cfg, self.plan, self.name, self.execution = model.config, model.plan, name, model.execution
        self.leader = None  # a mesh across processes: the followers replay each @collective call (multihost.py)
        self.kv_across = None  # and a KV connector's page moves there (spanning_pool.py; serve/distributed.py sets it)
        self.k = speculative_tokens
        self.decode_steps = 1 if speculative_tokens else decode_steps  # multi-step decode (not with MTP)
        self.expert_placement = expert_placement
        self.expert_shape = (self.cfg.num_moe_layers, self.cfg.moe_num_experts)
        self.weights = model.weights()
        if platform(model) == "cpu":
            groups = cpu_expert_groups(self.cfg.moe_num_experts) if self.plan is None else 1
            self.weights = cpu_layout(self.weights, expert_groups=groups,  # why: weights.cpu_layout
                                      fp8_values=self.execution.cpu_fp8_values)
            cpu_kernels.set_parallel_work(kernel_parallel_work(self.weights, self.decode_steps))
        page_size, num_pages = cache.block_size, cache.num_gpu_blocks_override
        self.page_size, self.max_pages = page_size, max_pages_per_seq
        if self.plan is not None:
            self.devices = list(self.plan.mesh.devices.flat)
            self.replicated = NamedSharding(self.plan.mesh, P())
        else:
            self.devices = [next(iter(jax.tree.leaves(self.weights)[0].devices()))]
            self.replicated = SingleDeviceSharding(self.devices[0])
        # An instance across processes may hold none of this process's devices (PD with a submesh per
        # process): what the leader reads of its results is brought onto the leader's first device (fetch).
        self.remote = not any(d.process_index == jax.process_index() for d in self.devices)
        self.local = all(d.process_index == jax.process_index() for d in self.devices)
        self.home = SingleDeviceSharding(jax.devices()[0])  # process 0's first device (devices sort by process)
        self.first = SingleDeviceSharding(self.devices[0])
        self.weights["rope_cache"] = jax.device_put(rope_cache(self.cfg, page_size * max_pages_per_seq),
                                                    self.replicated)
        dtype = pool_dtype(KV_CACHE_DTYPES[cache.kv_cache_dtype] or model.dtype, self.execution.kv_bf16_bits)
        shardings = lambda c: c.shardings(self.plan) if self.plan is not None else \
            jax.tree.map(lambda _: self.replicated, c)  # noqa: E731
        new_cache = lambda pages: KVCache.create(self.cfg, pages, page_size, dtype, self.k > 0)  # noqa: E731
        self.cache_shardings = shardings(jax.eval_shape(lambda: new_cache(1)))  # the same for any page count
        w_shardings = jax.tree.map(lambda a: a.sharding, self.weights)
        build = functools.partial(step_program, self.cfg, self.plan, self.execution, w_shardings,
                                  self.cache_shardings, self.replicated, batch_invariant)
        if self.k:
            self._jit, self._verify_jit = build(kind="spec_prefill", k=self.k), build(kind="verify", k=self.k)
        else:
            self._jit = self._verify_jit = build()
        self._score_jit = build(kind="score")
        self._multi_jit = build(kind="multi", k=self.decode_steps) if self.decode_steps > 1 else None
        extra = lambda B: ((B,),) if self.k else ()  # noqa: E731 -- next_tokens / max_accept
        # The largest single-chunk prefill and the largest decode batch serve any request (padded), so those
        # compile first; the rest compile in compile_rest() now, or behind a serving engine (take_rest()).
        largest = [("prefill", 1, max(T for _, T in prefill_buckets))] if prefill_buckets else []
        largest += [("decode", max(decode_buckets), self.k + 1)] if decode_buckets else []
        first = [k for k in largest if k[0] in startup_kinds]
        weights_abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                        self.weights)

        def lowering(key, cache_abstract):
            kind, B, T = key
            jitted = {"prefill": self._jit, "decode": self._verify_jit, "score": self._score_jit,
                      "multi": self._multi_jit}[kind]
            tokens = 1 if kind == "multi" else T  # a multi-step program's T is its steps, of one token a row
            return lower_step(jitted, weights_abstract, cache_abstract, self.replicated, B, tokens, self.max_pages,
                              ((1, T),) if kind == "score" else extra(B), sampling=kind != "score")

        # the buckets with the most tokens of each kind allocate the most while they run, beside their arguments
        heaviest = [("prefill", *max(prefill_buckets, key=lambda bt: bt[0] * bt[1]))] if prefill_buckets else []
        heaviest += [k for k in largest if k[0] == "decode"]

        def temporaries(pages):
            probe = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                 jax.eval_shape(lambda: new_cache(pages)), self.cache_shardings)
            return max((lowering(key, probe).compile().memory_analysis().temp_size_in_bytes for key in heaviest),
                       default=0)
        num_pages, self.pool_sizing = size_pool(
            self.cfg, dtype=dtype, page_size=page_size, mtp=self.k > 0, shardings=shardings, devices=self.devices,
            num_pages=num_pages, memory_utilization=cache.gpu_memory_utilization,
            pages_without_memory_limit=pages_without_memory_limit, name=name, temporaries=temporaries)
        self.num_pages = num_pages
        self._new_cache = functools.partial(new_cache, num_pages)
        self.cache = jax.device_put(self._new_cache(), self.cache_shardings)
        self.report: list[tuple[str, int, float]] = []
        # Weights and pool as shapes and shardings: what lowering needs (the pool's buffers are donated).
        cache_abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                      self.cache)
        # Programs by key (kind, B, T): kind "prefill", "decode", "score" (a prefill chunk that returns its
        # prompt logprobs; compiled on first use unless listed in score_buckets) or "multi" (T decode steps of
        # one token a row), B rows of T tokens (a decode row's T = 1 + the speculative tokens it verifies).
        self._programs: dict[tuple[str, int, int], Any] = {}
        self.shapes = ShapeTable()  # the compiled buckets
        # Tracing and lowering a program costs about as much as loading it from the compilation cache, so
        # each bucket is lowered by its own compile job, not all of them before the first one compiles.
        keys = [("prefill", B, T) for B, T in prefill_buckets] + [("decode", B, self.k + 1) for B in decode_buckets]
        keys += [("score", 1, T) for T in score_buckets]
        keys += [("multi", B, self.decode_steps) for B in decode_buckets] if self._multi_jit else []
        self._lower = functools.partial(lowering, cache_abstract=cache_abstract)  # key -> Lowered
        # key -> () -> the bucket's program ready to compile(): a Lowered, or an executable from the store
        self._preparers = {key: functools.partial(self._prepared, key) for key in keys}
        self.pending = len(self._preparers)  # buckets not compiled yet
        # A warm start loads programs from the store without lowering them (engine/executable_store.py); the
        # key holds everything `lowering` reads besides the bucket.
        self._store = ExecutableStore.configured(self.devices)
        self.loaded: list[tuple[str, int, int]] = []  # the buckets whose program came from the store
        self._signature = (repr(self.cfg), repr(self.plan), repr(self.execution), batch_invariant, self.k,
                           self.max_pages, describe(weights_abstract), describe(cache_abstract),
                           describe(self.replicated)) if self._store else None
        self._first = first

        # The rest in order of use: the startup kinds' buckets from the smallest (light traffic runs those),
        # then the other kind's largest (role switching can start), its other buckets, prompt scoring.
        def order(key):
            kind, B, T = key
            if kind == "score":
                return (3, 0, (B, T))
            if kind in startup_kinds:
                return (0, kind != "decode", (B, T))
            return (1 if key in largest else 2, kind != "decode", (B, T))
        self._rest = sorted(set(self._preparers) - set(first), key=order)

    def _prepared(self, key: tuple[str, int, int]):
        """The bucket's program ready to compile(): the store's executable, else its Lowered (stored once
        compiled)."""
        if self._store is None:
            return self._lower(key)
        store_key = self._store.key(self._signature, key)
        exe = self._store.load(store_key)
        if exe is not None:
            self.loaded.append(key)
            return _Stored(exe)
        return _ToStore(self._lower(key), self._store, store_key)

    def startup_jobs(self) -> dict:
        """The largest bucket of each start-up kind, as compile jobs (compile_startup)."""
        return self._jobs(self._first)

    def _jobs(self, keys) -> dict:
        return {key: (lambda key=key: self._preparers[key]().compile()) for key in keys}

    def compile_rest(self, workers: int | None = None) -> None:
        """Compile the buckets the constructor left (all but the largest of each kind)."""
        keys, self._rest = self._rest, []
        if not keys:
            return
        t0 = time.perf_counter()
        compile_all(self._jobs(keys), self._publish, workers)
        log.info("%s: %d more buckets compiled in %.1f s", self.name, len(keys), time.perf_counter() - t0)

    def take_rest(self) -> list[tuple[Any, Any]]:
        """The buckets left to compile, in order, as (lower() -> Lowered or stored program, on_done(executable,
        seconds)) pairs for compile_pool.compile_behind (which a shutting-down engine cancels); compile_rest()
        then has nothing left."""
        keys, self._rest = self._rest, []
        return [(self._preparers[key], functools.partial(self._publish, key)) for key in keys]

    def _publish(self, key: tuple[str, int, int], exe, seconds: float) -> None:
        kind, B, T = key
        self.pending -= 1
        self._programs[key] = exe
        if kind == "score":
            self.report.append((f"{self.name} prefill+prompt_logprobs", T, seconds))
            return
        self.shapes.add(kind, (B, T) if kind in ("prefill", "multi") else B)
        label = B if kind == "decode" else f"{B}x{T} steps" if kind == "multi" else T if B == 1 else f"{B}x{T}"
        self.report.append((f"{self.name} {kind}", label, seconds))

    @property
    def ready(self) -> dict[str, list]:
        """The compiled buckets by kind (shapes.ready)."""
        return self.shapes.ready

    def executables(self, kind: str) -> list:
        return [exe for (k, _, _), exe in self._programs.items() if k == kind]

    def _program(self, key: tuple[str, int, int]):
        """The executable of a bucket. A follower process (multihost.py) may be asked for one its background
        compile has not reached yet: the leader compiled it first; it compiles here now."""
        exe = self._programs.get(key)
        if exe is None:
            log.info("%s: compiling %s on first use", self.name, key)
            t0 = time.perf_counter()
            exe = self._preparers[key]().compile()
            self._programs[key] = exe
            self.report.append((f"{self.name} {key[0]} on first use", key[1:], time.perf_counter() - t0))
        return exe

    @collective
    def place_experts(self, new) -> None:
        """EPLB: move the routed experts into a new placement's slots (engine/expert_moves.py)."""
        move_experts(self.weights, self.expert_placement, new, self.put)
        self.expert_placement = new

    def cache_intact(self) -> bool:
        """Whether the KV pool holds what the programs wrote: every buffer alive (not consumed by a donating
        program that then failed) and computed without a device error."""
        leaves = jax.tree.leaves(self.cache)
        if any(x.is_deleted() for x in leaves):
            return False
        try:
            jax.block_until_ready(leaves)
        except Exception:  # noqa: BLE001 -- the program that wrote it failed on the device
            return False
        return True

    @collective
    def reset_cache(self) -> None:
        """A fresh (zeroed) pool in place of one a failed program may have consumed: every program donates
        the pool, so after a device-side error the old buffers can be gone."""
        self.cache = jax.device_put(self._new_cache(), self.cache_shardings)

    def send(self, tree):
        """Start bringing a tree of this instance's device arrays (None leaves kept) to this process; fetch()
        takes what this returns. Here that is the tree itself, unless this process holds none of the
        instance's devices: then the copies onto its first device start now, right behind the step that
        computes them (a copy asked for at read time would queue behind the next step, dispatched by then)."""
        if not self.remote:
            return tree
        leaves, treedef = jax.tree.flatten(tree)
        # an empty array (no top logprobs asked) is made at fetch(): a cross-host copy of no bytes never lands
        return _Sent(treedef, [(x.shape, x.dtype) for x in leaves], self.bring_home([x for x in leaves if x.size]))

    def fetch(self, sent):
        """What send() started, as numpy arrays on this process."""
        if not isinstance(sent, _Sent):
            return jax.device_get(sent)
        try:
            got = iter(jax.device_get(sent.arrays))
        except Exception as e:  # the process holding them is gone (or its link): the instance cannot go on
            if self.leader is not None:
                self.leader.fail(f"{self.name}: a step's results did not arrive from the process holding its "
                                 f"devices ({e})")
            raise
        return jax.tree.unflatten(sent.treedef, [next(got) if np.prod(shape) else np.zeros(shape, dtype)
                                                 for shape, dtype in sent.leaves])

    @collective
    def bring_home(self, arrays: list):
        """The arrays (replicated on this mesh) copied onto the leader's first device: sent by the process
        holding this mesh's first device (JAX's cross-host transfer), received by the leader."""
        # A cross-host copy keeps the device set's size: the results are replicated, so the first device's
        # copy crosses (on the other processes, an array with no shards there stands for it).
        if self.first.device_set <= set(jax.local_devices()):
            for x in arrays:
                if not x.sharding.is_fully_replicated:
                    raise ValueError(f"{self.name}: a step result of shape {x.shape} is not replicated on its mesh "
                                     f"({x.sharding}); its first device's copy is not the whole of it")
            one = [next(s.data for s in x.addressable_shards if s.device == self.devices[0]) for x in arrays]
        else:
            one = [jax.make_array_from_single_device_arrays(x.shape, self.first, [], dtype=x.dtype) for x in arrays]
        return jax.device_put(one, self.home)

    @collective
    def put(self, x):
        """Explicit host -> device copy onto this mesh (replicated); a pytree goes in one call."""
        return jax.device_put(x, self.replicated)

    def _step_inputs(self, tree):
        """A step's host inputs as its program takes them. Where this process holds every device of the mesh,
        the numpy arrays go to the jitted program as they are: its dispatch copies them onto the replicated
        in_shardings in C++, several times faster than `put` of the same ten small arrays, which took as long as
        a small model's whole decode program (benchmarks/RESULTS.md). The call that takes them allows that
        host-to-device copy by name (jax.transfer_guard), so a guard still catches any other. A mesh across
        processes takes the explicit copy."""
        return tree if self.local else self.put(tree)

    @collective
    def run(self, kind: str, ids, positions, logit_positions, block_tables, arrays: dict[str, Any], extra=None,
            steps: int = 1):
        """One prefill chunk or decode step, sampling the logits with `arrays` (Engine._sampling_arrays) as
        _step does; returns (logits, expert token counts, sampled), all on device, and with speculative
        decoding the drafts [B,k] too. extra [B]: the speculative programs' next_tokens / max_accept.
        steps > 1: that many decode steps in one program (its sampled leaves [B, steps, ...])."""
        fn = self._program(("multi", ids.shape[0], steps) if steps > 1 else (kind, *ids.shape))
        sampling = tuple(arrays[name] for name in SAMPLING_ARGS)
        extra = () if extra is None else (extra,)
        ids, positions, logit_positions, block_tables, extra, sampling = self._step_inputs(
            (ids, positions, logit_positions, block_tables, extra, sampling))
        with jax.transfer_guard_host_to_device("allow"):  # the step's numpy inputs (_step_inputs), nothing else
            logits, self.cache, counts, sampled, *drafts = fn(self.weights, ids, positions, self.cache,
                                                              logit_positions, block_tables, *extra, sampling)
        return (logits, counts, sampled, *drafts)

    @collective
    def run_scored(self, ids, positions, logit_positions, block_tables, targets):
        """A prefill chunk that also returns prompt logprobs: (logits, counts, (target_lp [1,T],
        top ids [1,T,MAX_LOGPROBS], top logprobs)). The program for a chunk length compiles on first use."""
        T = ids.shape[1]
        key = ("score", 1, T)
        if key not in self._programs:
            log.info("%s: compiling the prompt-scoring prefill for %d tokens on first use", self.name, T)
            t0 = time.perf_counter()
            self._programs[key] = self._prepared(key).compile()
            self.report.append((f"{self.name} prefill+prompt_logprobs", T, time.perf_counter() - t0))
        ids, positions, logit_positions, block_tables, targets = self._step_inputs(
            (ids, positions, logit_positions, block_tables, targets))
        with jax.transfer_guard_host_to_device("allow"):  # the step's numpy inputs (_step_inputs), nothing else
            logits, self.cache, counts, scores = self._programs[key](self.weights, ids, positions, self.cache,
                                                                     logit_positions, block_tables, targets)
        return logits, counts, scores

    @collective
    def chain_decode(self, sampled_tokens, batch: int):
        """The decode step's input ids [B,1] from the tokens [B] of a decode step not read yet (on the device)."""
        return _chain_decode(sampled_tokens, batch)

    @collective
    def chain_verify(self, tokens, accepted, drafts, positions, steps):
        """The inputs of the verify step after a verify step of the same batch that is not read yet (its
        tokens [B,k+1], accepted counts, drafts, positions and sampling steps, on the device): ids [B,k+1]
        (each row's token at its accepted index, then its new drafts), and positions and sampling steps moved
        past the tokens it emitted, all computed on the device."""
        return _chain_verify(tokens, accepted, drafts, positions, steps)

    @collective
    def sample(self, logits, arrays: dict[str, Any], num_logprobs: int):
        args = self.put(arrays)  # None entries stay None
        penalties = args.pop("penalties")
        return sample(logits, **args, penalties=penalties, num_logprobs=num_logprobs)


def compile_startup(instances: list[ModelPrograms]) -> None:
    """Every instance's start-up programs on one thread pool: each compile (or load) is CPU work of its own,
    so a PD engine's two instances take one program's time, not two."""
    jobs = {(i, key): job for i, programs in enumerate(instances) for key, job in programs.startup_jobs().items()}
    compile_all(jobs, lambda ik, exe, seconds: instances[ik[0]]._publish(ik[1], exe, seconds))


class _Sent(NamedTuple):
    """Results of an instance on other processes' devices, being copied to this one (ModelPrograms.send)."""
    treedef: Any
    leaves: list  # (shape, dtype) of each leaf
    arrays: list  # the copies of the leaves that hold data, on this process's first device


class _Stored:
    """An executable loaded from the store, where a Lowered is expected: compile() hands it over."""

    def __init__(self, exe):
        self.exe = exe

    def compile(self):
        return self.exe


class _ToStore:
    """A Lowered whose compile() also stores the executable."""

    def __init__(self, lowered, store: ExecutableStore, key: str):
        self.lowered, self.store, self.key = lowered, store, key

    def compile(self):
        return self.store.compile(self.key, self.lowered)
