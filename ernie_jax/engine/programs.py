"""The compiled programs of one (sub)mesh: chunked prefill and batched decode over a paged KV pool.

`ModelPrograms` holds a model's weights placed on its mesh, the KV page pool of that mesh, and one
ahead-of-time compiled executable per bucket: prefill per shape (B, T) (B prompt chunks of up to T
tokens, each written into the pool through its request's block table, logits at each chunk's last real
token), decode per batch size B (one token for each of B sequences). Every executable donates the pool
and has explicit input and output shardings, so the pool is updated in place and never leaves its
devices. `compile_report` lists buckets and seconds (programs compile in parallel, so the seconds
overlap). The constructor compiles the largest bucket of each kind, which serves any request;
`compile_rest` the others, which the engine uses from the moment each is ready (so they can compile
behind a serving engine). A prefill variant that also returns prompt logprobs compiles on first use.
Every program also counts the tokens routed to each expert of each MoE layer (the server's load
metrics). The page transfer between two pools (prefill/decode disaggregation) lives here too.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from ernie_jax.model.ernie import ErnieForCausalLM
from ernie_jax.model.forward import forward, mtp_draft, rope_cache
from ernie_jax.model.kv_cache import KV_CACHE_DTYPES, KVCache
from ernie_jax.model.weights import QUANTIZABLE, cpu_layout
from ernie_jax.ops.paged_attention.storage import pool_dtype
from ernie_jax.quant import BlockFP8
from ernie_jax.sampling import MAX_LOGPROBS, sample, speculative_verify

log = logging.getLogger("ernie_jax.engine")


def _step(weights, input_ids, positions, cache, logit_positions, block_tables, sampling, *, cfg, plan, ex,
          batch_invariant):
    """-> (logits [B,V] at logit_positions, cache, expert token counts [L_moe,E], sampled).

    sampling: (temperature, top_p, top_k, seeds, steps), each [B]; `sampled` is sampling.sample's result for
    them without min-p, penalties or logprob alternatives: most batches need nothing more (plain_sampling),
    and sampling inside the step saves launching a second program per step. Other batches sample the
    returned logits."""
    out = forward(weights, cfg, input_ids, positions, cache, logit_positions, plan, block_tables, batch_invariant, ex)
    counts = _expert_counts(out.expert_ids, logit_positions, input_ids.shape, cfg)
    return out.logits, out.cache, counts, sample(out.logits, *sampling)


SAMPLING_ARGS = ("temperature", "top_p", "top_k", "seeds", "steps")  # _step's sampling arrays, in order


def _spec_prefill_step(weights, input_ids, positions, cache, logit_positions, block_tables, next_tokens, sampling,
                       *, cfg, plan, ex, batch_invariant, k):
    """_step that also runs the MTP block over the chunk (writing its KV) and drafts k tokens after each
    row's last real token. next_tokens [B]: the prompt token after the chunk, or -1 when the chunk ends the
    prompt (then it is the token sampled here). -> _step's outputs and drafts [B,k]."""
    out = forward(weights, cfg, input_ids, positions, cache, logit_positions, plan, block_tables, batch_invariant, ex)
    counts = _expert_counts(out.expert_ids, logit_positions, input_ids.shape, cfg)
    sampled = sample(out.logits, *sampling)
    B = input_ids.shape[0]
    last = jnp.maximum(logit_positions, 0)
    following = jnp.where(next_tokens >= 0, next_tokens, sampled[0])
    next_ids = jnp.concatenate([input_ids[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    next_ids = next_ids.at[jnp.arange(B), last].set(following)  # x_{t+1} for every position t of the chunk
    drafts, cache = mtp_draft(weights, cfg, next_ids, out.hidden, positions, out.cache, block_tables, last, k, plan, ex)
    return out.logits, cache, counts, sampled, drafts


@jax.jit
def _chain_verify(tokens, accepted, drafts, positions, steps):
    last = jnp.take_along_axis(tokens, accepted[:, None], axis=1)
    return jnp.concatenate([last, drafts], axis=1), positions + accepted[:, None] + 1, steps + accepted + 1


def _verify_step(weights, input_ids, positions, cache, logit_positions, block_tables, max_accept, sampling, *, cfg,
                 plan, ex, batch_invariant, k):
    """One speculative decode step: input_ids [B,k+1] = (each row's last token, its k drafts) at positions
    [B,k+1]. The target scores all k+1 (writing their KV; a rejected draft's slots are rewritten by the next
    step before any query reads them), sampling.speculative_verify accepts a prefix of the drafts, and the
    MTP block reads (emitted token, target state) at each position and drafts the next k after the last
    accepted one. logit_positions [B]: k for real rows, -1 for padding. -> (logits [B,V] after the last
    token, cache, counts, (tokens [B,k+1], accepted [B]), drafts [B,k])."""
    out = forward(weights, cfg, input_ids, positions, cache, None, plan, block_tables, batch_invariant, ex)
    counts = _expert_counts(out.expert_ids, logit_positions, input_ids.shape, cfg)
    tokens, accepted = speculative_verify(out.logits, input_ids[:, 1:], *sampling, max_accept)
    drafts, cache = mtp_draft(weights, cfg, tokens, out.hidden, positions, out.cache, block_tables, accepted, k, plan,
                              ex)
    return out.logits[:, 0], cache, counts, (tokens, accepted), drafts


def plain_sampling(arrays: dict[str, Any], num_logprobs: int) -> bool:
    """Whether _step's own sample serves a batch with these sampling arrays (Engine._sampling_arrays)."""
    return arrays["min_p"] is None and arrays["penalties"] is None and num_logprobs == 0


def _score_step(weights, input_ids, positions, cache, logit_positions, block_tables, targets, *, cfg, plan, ex,
                batch_invariant, num_top):
    """Prefill that also scores the chunk: the logprob of targets[b,t] (the next prompt token) after each
    position, with the top `num_top` alternatives -- prompt logprobs, what `echo` + `logprobs` return."""
    B, T = input_ids.shape
    out = forward(weights, cfg, input_ids, positions, cache, None, plan, block_tables, batch_invariant, ex)
    logprobs = jax.nn.log_softmax(out.logits, axis=-1)  # [B,T,V]
    target_lp = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    top_lp, top_ids = lax.top_k(logprobs, num_top)
    counts = _expert_counts(out.expert_ids, logit_positions, (B, T), cfg)
    return out.logits[jnp.arange(B), logit_positions], out.cache, counts, (target_lp, top_ids, top_lp)


def _expert_counts(expert_ids, logit_positions, shape, cfg) -> jax.Array:
    """Tokens routed to each expert of each MoE layer, counting only real tokens: a row's tokens up to its
    logit position (padding rows of a decode batch carry logit position -1)."""
    B, T = shape
    valid = (jnp.arange(T)[None, :] <= logit_positions[:, None]).reshape(-1).astype(jnp.int32)
    if not expert_ids:
        return jnp.zeros((0, cfg.moe_num_experts), jnp.int32)
    ids = jnp.concatenate(expert_ids)  # [L_moe, B*T, k]
    w = jnp.broadcast_to(valid[None, :, None], ids.shape)
    return jax.vmap(lambda i, v: jnp.bincount(i.reshape(-1), v.reshape(-1), length=cfg.moe_num_experts))(ids, w)


def platform(model: ErnieForCausalLM) -> str:
    """The platform ("cpu", "gpu", "tpu") the model's weights live on."""
    return next(iter(jax.tree.leaves(model.weights())[0].devices())).platform


def min_decode_rows(model: ErnieForCausalLM) -> int:
    """2 on CPU for a model with a plain bf16 matmul (a linear, or the LM head: the tied embedding of an FP8
    release is bf16), else 1. XLA:CPU runs a one-row bf16 matmul (a matrix-vector product) through a fallback
    that converts the weight to f32 on every call (a decode step of the bench model took 280 ms for one
    sequence, 26 ms for two), so there a lone sequence decodes beside a padding row. Block-FP8 and f32
    linears do not take that fallback."""
    if platform(model) != "cpu":
        return 1
    w = model.weights()
    head = w["lm_head"] if w.get("lm_head") is not None else w["embed"]
    plain_bf16 = [a for seg in w["segments"] for name, a in seg.items()
                  if name in QUANTIZABLE and not isinstance(a, BlockFP8) and a.dtype == jnp.bfloat16]
    return 2 if plain_bf16 or head.dtype == jnp.bfloat16 else 1


def cpu_expert_groups(num_experts: int) -> int:
    """How many groups an unsharded CPU model's routed experts are split into (weights.cpu_layout): one per
    core XLA:CPU runs on, the largest divisor of num_experts that is not above the core count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(g for g in range(1, max(1, min(cores, num_experts)) + 1) if num_experts % g == 0)


def table_pages(max_model_len: int, page_size: int, k: int = 0) -> int:
    """Block-table width (pages) of a sequence: max_model_len's pages, or with k speculative tokens enough
    for what a step writes past the last token (the k drafts, the MTP block's chained drafts and, after a
    step still in flight, k + 1 more); slots past the pages a request holds go to the null page through the
    table's padding."""
    return -(-(max_model_len + (4 * k + 1 if k else 0)) // page_size)


def decode_buckets(max_num_seqs: int, min_rows: int = 1, batch_invariant: bool = False) -> list[int]:
    """Decode batch sizes: powers of two from min_rows (min_decode_rows) up to max_num_seqs, or only
    max_num_seqs when batch_invariant."""
    rows = max(max_num_seqs, min_rows)
    return [rows] if batch_invariant else buckets(rows, min_rows)


def buckets(limit: int, start: int = 1) -> list[int]:
    """Powers of two from `start` up to and including `limit`."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def prefill_shapes(chunk_lengths: list[int], token_budget: int, max_seqs: int,
                   min_batched: int = 64) -> list[tuple[int, int]]:
    """Prefill program shapes (B, T): one chunk of each length T, and for each T >= min_batched the largest
    power-of-two batch of chunks that fits the token budget (max_num_batched_tokens) and max_seqs, so a
    burst of prompts prefills in a few steps instead of one step each. Shorter chunks batch padded to
    min_batched tokens, which costs little and saves compiling a program per short length."""
    out = [(1, T) for T in chunk_lengths]
    for T in chunk_lengths:
        b = 1
        while 2 * b * T <= token_budget and 2 * b <= max_seqs:
            b *= 2
        if b > 1 and (T >= min_batched or T == chunk_lengths[-1]):
            out.append((b, T))
    return out


def compile_all(jobs: dict[Any, Callable[[], Any]], on_done: Callable[[Any, Any, float], None],
                workers: int | None = None, cancelled: threading.Event | None = None) -> None:
    """Run compile jobs on a thread pool (XLA compiles without the GIL, so start-up uses every core) and
    hand each result to on_done(key, result, seconds) as it finishes. Jobs not started when `cancelled` is
    set are skipped: the interpreter joins pool threads at exit, so a shutdown would otherwise wait for
    every queued compile. Once `cancelled` is set no pool is made at all: at interpreter exit a new pool
    refuses work ("cannot schedule new futures after interpreter shutdown")."""
    if cancelled is not None and cancelled.is_set():
        return

    def timed(job):
        if cancelled is not None and cancelled.is_set():
            return None
        t0 = time.perf_counter()
        return job(), time.perf_counter() - t0
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        futures = {pool.submit(timed, job): key for key, job in jobs.items()}
        for f in concurrent.futures.as_completed(futures):
            if (done := f.result()) is not None:
                on_done(futures[f], *done)


def step_program(cfg, plan, ex, weight_shardings, cache_shardings, replicated, batch_invariant: bool = False,
                 kind: str = "step", k: int = 0):
    """The jitted step with explicit shardings and the cache donated: what every ModelPrograms bucket
    compiles, and what `python -m ernie_jax.plan` compiles from shapes. kind: "step" (_step), "score"
    (_score_step), "spec_prefill" / "verify" (speculative decoding with k MTP drafts)."""
    static = dict(cfg=cfg, plan=plan, ex=ex, batch_invariant=batch_invariant)
    fn = {"step": functools.partial(_step, **static),
          "score": functools.partial(_score_step, **static, num_top=MAX_LOGPROBS),
          "spec_prefill": functools.partial(_spec_prefill_step, **static, k=k),
          "verify": functools.partial(_verify_step, **static, k=k)}[kind]
    rep, spec = replicated, kind in ("spec_prefill", "verify")
    return jax.jit(fn, donate_argnums=(3,),
                   in_shardings=(weight_shardings, rep, rep, cache_shardings, rep, rep, rep) + ((rep,) if spec else ()),
                   out_shardings=(rep, cache_shardings, rep, rep) + ((rep,) if spec else ()))


def lower_step(jitted, weights, cache, replicated, B: int, T: int, max_pages: int, extra: tuple = (),
               sampling: bool = False):
    """Lower a step_program for B rows of T tokens from abstract weights and cache (ShapeDtypeStructs with
    shardings). extra: shapes of further int32 inputs (the scoring prefill's targets)."""
    spec = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)  # noqa: E731
    i32 = functools.partial(spec, jnp.int32)
    args = [i32(*shape) for shape in extra]
    if sampling:  # SAMPLING_ARGS
        args.append((spec(jnp.float32, B), spec(jnp.float32, B), i32(B), spec(jnp.uint32, B), i32(B)))
    return jitted.lower(weights, i32(B, T), i32(B, T), cache, i32(B), i32(B, max_pages), *args)


def pages_in_memory(devices: list, page_bytes: int, utilization: float) -> int | None:
    """KV pages of page_bytes (per device) that fit in `utilization` of every device's memory beside what is
    resident already (the weights); None when the platform reports no memory limit (XLA:CPU)."""
    stats = [d.memory_stats() for d in devices]
    if any(s is None or "bytes_limit" not in s for s in stats):
        return None
    room = min(utilization * s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    return max(0, int(room // page_bytes))


class ModelPrograms:
    def __init__(self, model: ErnieForCausalLM, *, num_pages: int | None, page_size: int, max_pages_per_seq: int,
                 kv_cache_dtype: str, prefill_buckets: list[tuple[int, int]], decode_buckets: list[int], name: str,
                 batch_invariant: bool = False, memory_utilization: float | None = None,
                 pages_without_memory_limit: int = 0, score_buckets: tuple[int, ...] = (),
                 speculative_tokens: int = 0, expert_placement=None):
        """prefill_buckets: (B, T) shapes, with (1, T) for every chunk length T; decode_buckets: batch sizes.
        num_pages: the pool's pages (the null page included), or None to size it from device memory:
        memory_utilization (default 0.9, vLLM's) of each device's memory minus what is resident, or, where
        the platform reports no memory limit, pages_without_memory_limit (and memory_utilization must not be
        given). `pool_sizing` says which rule sized the pool.
        score_buckets: chunk lengths whose prompt-scoring prefill compiles with the other buckets (a
        server's, in the background); any other length compiles on first use.
        speculative_tokens: k > 0 for MTP speculative decoding: the pool holds the MTP block's KV too,
        prefill programs also draft k tokens, decode programs verify k drafts (T = k + 1) and draft again.
        expert_placement: the redundant-expert placement the model's weights were laid out in (EPLB), or None."""
        self.cfg, self.plan, self.name, self.execution = model.config, model.plan, name, model.execution
        self.k = speculative_tokens
        self.expert_placement = expert_placement
        self.weights = model.weights()
        if platform(model) == "cpu":
            groups = cpu_expert_groups(self.cfg.moe_num_experts) if self.plan is None else 1
            self.weights = cpu_layout(self.weights, expert_groups=groups)  # why: weights.cpu_layout
        self.page_size, self.max_pages = page_size, max_pages_per_seq
        if self.plan is not None:
            self.devices = list(self.plan.mesh.devices.flat)
            self.replicated = NamedSharding(self.plan.mesh, P())
        else:
            self.devices = [next(iter(jax.tree.leaves(self.weights)[0].devices()))]
            self.replicated = SingleDeviceSharding(self.devices[0])
        self.weights["rope_cache"] = jax.device_put(rope_cache(self.cfg, page_size * max_pages_per_seq),
                                                    self.replicated)
        dtype = pool_dtype(KV_CACHE_DTYPES[kv_cache_dtype] or model.dtype, self.execution.kv_bf16_bits)
        shardings = lambda c: c.shardings(self.plan) if self.plan is not None else \
            jax.tree.map(lambda _: self.replicated, c)  # noqa: E731
        if num_pages is not None:
            self.pool_sizing = "--num-gpu-blocks-override"
        else:
            n = 64  # pages of a probe pool (a multiple of any data-axis split of the pages)
            probe = jax.eval_shape(lambda: KVCache.create(self.cfg, n, page_size, dtype, self.k > 0))
            page_bytes = sum(np.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
                             for a, s in zip(jax.tree.leaves(probe), jax.tree.leaves(shardings(probe)))) / n
            num_pages = pages_in_memory(self.devices, int(np.ceil(page_bytes)), memory_utilization or 0.9)
            if num_pages is not None:
                self.pool_sizing = f"{memory_utilization or 0.9:.2f} of device memory"
            elif memory_utilization is not None:
                raise ValueError(f"{name}: the {self.devices[0].platform} devices report no memory limit, so "
                                 "gpu_memory_utilization cannot size the KV pool; give num_gpu_blocks_override")
            else:
                num_pages = pages_without_memory_limit
                self.pool_sizing = "max_num_seqs x max_model_len (the devices report no memory limit)"
        self.num_pages = num_pages
        self._new_cache = lambda: KVCache.create(self.cfg, num_pages, page_size, dtype, self.k > 0)
        self.cache_shardings = shardings(jax.eval_shape(self._new_cache))
        self.cache = jax.device_put(self._new_cache(), self.cache_shardings)
        self.report: list[tuple[str, int, float]] = []
        w_shardings = jax.tree.map(lambda a: a.sharding, self.weights)
        build = functools.partial(step_program, self.cfg, self.plan, self.execution, w_shardings,
                                  self.cache_shardings, self.replicated, batch_invariant)
        if self.k:
            self._jit, self._verify_jit = build(kind="spec_prefill", k=self.k), build(kind="verify", k=self.k)
        else:
            self._jit = self._verify_jit = build()
        self._score_jit = build(kind="score")
        self._score: dict[int, Any] = {}  # scoring prefill per chunk length, compiled on first use
        self._programs: dict[tuple[str, int], Any] = {}
        self.ready: dict[str, list] = {"prefill": [], "decode": []}  # compiled buckets, ascending
        extra = lambda B: ((B,),) if self.k else ()  # noqa: E731 -- next_tokens / max_accept
        lowered = {("prefill", (B, T)): self._lower(self._jit, B, T, extra(B), sampling=True)
                   for B, T in prefill_buckets}
        lowered.update({("decode", B): self._lower(self._verify_jit, B, self.k + 1, extra(B), sampling=True)
                        for B in decode_buckets})
        lowered.update({("score", T): self._lower(self._score_jit, 1, T, extra=((1, T),)) for T in score_buckets})

        def job(key):
            return lowered[key].compile()
        # The largest single-chunk prefill and the largest decode batch serve any request (padded), so those
        # compile first; the rest compile in compile_rest(), now or behind a serving engine.
        largest = {("prefill", (1, max(T for _, T in prefill_buckets)))} if prefill_buckets else set()
        largest |= {("decode", max(decode_buckets))} if decode_buckets else set()
        self.pending = len(lowered)  # buckets not compiled yet
        self._cancelled = threading.Event()
        compile_all({k: functools.partial(job, k) for k in largest}, self._publish)
        self._rest = {k: functools.partial(job, k) for k in lowered if k not in largest}

    def compile_rest(self, workers: int | None = None) -> None:
        """Compile the buckets the constructor left (all but the largest of each kind)."""
        jobs, self._rest = self._rest, {}
        if not jobs:
            return
        t0 = time.perf_counter()
        compile_all(jobs, self._publish, workers, self._cancelled)
        if self._cancelled.is_set():
            log.info("%s: background compiling stopped, %d buckets left", self.name, self.pending)
        else:
            log.info("%s: %d more buckets compiled in %.1f s", self.name, len(jobs), time.perf_counter() - t0)

    def cancel_compiles(self) -> None:
        """Skip the buckets compile_rest() has not started (a shutting-down engine never uses them)."""
        self._cancelled.set()

    def _publish(self, key: tuple[str, int], exe, seconds: float) -> None:
        kind, size = key
        if kind == "score":
            self._score[size] = exe
            self.pending -= 1
            self.report.append((f"{self.name} prefill+prompt_logprobs", size, seconds))
            return
        self._programs[key] = exe
        self.ready[kind] = sorted(self.ready[kind] + [size])  # a new list: the engine thread reads it unlocked
        self.pending -= 1
        label = size if kind == "decode" else size[1] if size[0] == 1 else f"{size[0]}x{size[1]}"
        self.report.append((f"{self.name} {kind}", label, seconds))

    def bucket(self, kind: str, n: int) -> int:
        """The smallest compiled bucket that holds n tokens (prefill: the chunk length T of a single-chunk
        program) or n sequences (decode)."""
        if kind == "prefill":
            return next(T for B, T in self.ready["prefill"] if B == 1 and T >= n)
        return next(b for b in self.ready[kind] if b >= n)

    def prefill_batches(self, T: int) -> list[int]:
        """The compiled prefill batch sizes for chunk length T, ascending (1 always among them)."""
        return [B for B, t in self.ready["prefill"] if t == T]

    def executables(self, kind: str) -> list:
        return [exe for (k, _), exe in self._programs.items() if k == kind]

    def _lower(self, jitted, B: int, T: int, extra: tuple = (), sampling: bool = False):
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                (self.weights, self.cache))
        return lower_step(jitted, *abstract, self.replicated, B, T, self.max_pages, extra, sampling)

    def place_experts(self, new) -> None:
        """Move the routed experts into a new placement's slots (sharding/eplb.Placement; EPLB), device to
        device: each new slot takes its expert from the slot that expert had first, and the routing map is
        replaced. Arrays keep their shapes and shardings, so the compiled programs serve on unchanged; a
        step already dispatched keeps the arrays it was given."""
        from ernie_jax.sharding.eplb import slot_map
        old = self.expert_placement
        E = old.replicas.shape[1]
        first = np.argmax(old.slot_expert[:, None, :] == np.arange(E)[None, :, None], axis=-1)  # [L, E]
        src = np.take_along_axis(first, new.slot_expert, axis=1).astype(np.int32)  # [L, S]
        slots, replicas = slot_map(new)

        def take(a, idx, axis):
            move = jax.jit(functools.partial(jnp.take, axis=axis), out_shardings=a.sharding)
            return move(a, self.put(idx))

        def moved(layer: dict, rows: slice, axis: int) -> dict:
            out = dict(layer)
            for name in ("experts_up_gate", "experts_down"):
                out[name] = jax.tree.map(lambda a: take(a, src[rows] if axis else src[rows.start], axis), layer[name])
            for name, new_map in (("expert_slots", slots), ("expert_replicas", replicas)):
                out[name] = jax.device_put(new_map[rows] if axis else new_map[rows.start], layer[name].sharding)
            return out
        row = 0
        for s, seg in enumerate(self.weights["segments"]):
            layers = seg if isinstance(seg, list) else None
            if "expert_slots" not in (layers[0] if layers else seg):
                continue
            L = len(layers) if layers else seg["expert_slots"].shape[0]
            if layers:  # weights.cpu_layout: one pytree per layer, experts [S, ...]
                self.weights["segments"][s] = [moved(w, slice(row + i, row + i + 1), 0) for i, w in enumerate(layers)]
            else:  # stacked [L, S, ...]
                self.weights["segments"][s] = moved(seg, slice(row, row + L), 1)
            row += L
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

    def reset_cache(self) -> None:
        """A fresh (zeroed) pool in place of one a failed program may have consumed: every program donates
        the pool, so after a device-side error the old buffers can be gone."""
        self.cache = jax.device_put(self._new_cache(), self.cache_shardings)

    def put(self, x):
        """Explicit host -> device copy onto this mesh (replicated); a pytree goes in one call."""
        return jax.device_put(x, self.replicated)

    def run(self, kind: str, ids, positions, logit_positions, block_tables, arrays: dict[str, Any], extra=None):
        """One prefill chunk or decode step, sampling the logits with `arrays` (Engine._sampling_arrays) as
        _step does; returns (logits, expert token counts, sampled), all on device, and with speculative
        decoding the drafts [B,k] too. extra [B]: the speculative programs' next_tokens / max_accept."""
        B, T = ids.shape
        fn = self._programs[kind, (B, T) if kind == "prefill" else B]
        sampling = tuple(arrays[name] for name in SAMPLING_ARGS)
        extra = () if extra is None else (extra,)
        ids, positions, logit_positions, block_tables, extra, sampling = self.put(
            (ids, positions, logit_positions, block_tables, extra, sampling))
        logits, self.cache, counts, sampled, *drafts = fn(self.weights, ids, positions, self.cache, logit_positions,
                                                          block_tables, *extra, sampling)
        return (logits, counts, sampled, *drafts)

    def run_scored(self, ids, positions, logit_positions, block_tables, targets):
        """A prefill chunk that also returns prompt logprobs: (logits, counts, (target_lp [1,T],
        top ids [1,T,MAX_LOGPROBS], top logprobs)). The program for a chunk length compiles on first use."""
        T = ids.shape[1]
        if T not in self._score:
            log.info("%s: compiling the prompt-scoring prefill for %d tokens on first use", self.name, T)
            t0 = time.perf_counter()
            self._score[T] = self._lower(self._score_jit, 1, T, extra=((1, T),)).compile()
            self.report.append((f"{self.name} prefill+prompt_logprobs", T, time.perf_counter() - t0))
        ids, positions, logit_positions, block_tables, targets = self.put(
            (ids, positions, logit_positions, block_tables, targets))
        logits, self.cache, counts, scores = self._score[T](self.weights, ids, positions, self.cache,
                                                            logit_positions, block_tables, targets)
        return logits, counts, scores

    def chain_verify(self, step):
        """The inputs of the verify step after `step` (a Dispatched verify step of the same batch, not read):
        (ids [B,k+1]: each row's token at its accepted index, then its new drafts; positions and sampling
        steps moved past the tokens it emitted), all computed on the device."""
        (tokens, accepted), _, _ = step.result
        positions, steps = step.inputs
        return _chain_verify(tokens, accepted, step.drafts, positions, steps)

    def sample(self, logits, arrays: dict[str, Any], num_logprobs: int):
        args = self.put(arrays)  # None entries stay None
        penalties = args.pop("penalties")
        return sample(logits, **args, penalties=penalties, num_logprobs=num_logprobs)


class PageTransfer:
    """Moves requests' KV pages from one instance's pool to another's in two halves, each run by the thread
    of the instance whose pool it touches: `gather` (sender: gather the pages on the source mesh, one
    device_put onto the destination mesh, wait for it) and `scatter` (receiver: write them into its pool,
    donated, not waited for). Page counts are bucketed to powers of two, so a few compiled shapes serve
    every prompt length; `seconds` totals the gathers and copies."""

    def __init__(self, src: ModelPrograms, dst: ModelPrograms):
        self.src, self.dst = src, dst
        self.buckets = buckets(src.max_pages)
        self.page_shardings = dst.cache_shardings  # a page batch is laid out like the pool it goes to
        self._gather = jax.jit(lambda cache, ids: jax.tree.map(lambda a: a[:, ids], cache),
                               in_shardings=(src.cache_shardings, src.replicated),
                               out_shardings=src.cache_shardings)
        self._scatter = jax.jit(lambda cache, pages, ids: jax.tree.map(lambda a, p: a.at[:, ids].set(p), cache, pages),
                                donate_argnums=(0,), in_shardings=(dst.cache_shardings, self.page_shardings,
                                                                   dst.replicated),
                                out_shardings=dst.cache_shardings)
        self.seconds, self.bytes, self.pages = 0.0, 0, 0  # totals of every gather
        self.last: tuple[list[int], list[int]] | None = None  # (source, destination) pages of the last move

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def gather(self, src_pages: list[int]):
        """The pages' KV as a page batch on the destination mesh; returns once the copy has landed."""
        n = self.bucket(len(src_pages))
        t0 = time.perf_counter()
        pages = self._gather(self.src.cache, self.src.put(np.asarray(src_pages + [0] * (n - len(src_pages)), np.int32)))
        moved = jax.block_until_ready(jax.device_put(pages, self.page_shardings))
        self.seconds += time.perf_counter() - t0
        self.bytes += sum(a.nbytes for a in jax.tree.leaves(pages)) * len(src_pages) // n
        self.pages += len(src_pages)
        return moved

    def scatter(self, moved, src_pages: list[int], dst_pages: list[int]) -> None:
        """Write the page batch gathered from src_pages into the destination pool at dst_pages (as many;
        the batch's padding goes to the null page)."""
        n = jax.tree.leaves(moved)[0].shape[1]
        ids = self.dst.put(np.asarray(dst_pages + [0] * (n - len(dst_pages)), np.int32))
        self.dst.cache = self._scatter(self.dst.cache, moved, ids)
        self.last = (list(src_pages), list(dst_pages))
