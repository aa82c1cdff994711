"""The serving engine: requests, their rules, and the instances that serve them.

An `Engine` holds the requests and the queue of waiting ones, and one or two instances
(engine/instance.py): colocated, one instance on the whole mesh does prefill and decode; disaggregated
(`prefill_model` given), a prefill instance and a decode instance on disjoint submeshes, each with its own
weights, pool and programs, stepping independently (`start()` gives each its own thread; `step()` steps
them in turn) and moving finished prompts' KV from one to the other. With `pd_policy="dynamic"` (the
default) both compile both programs and switch roles when one side's queue runs dry (engine/policy.py).
A request stops on EOS (unless ignore_eos), a stop token or string, max_tokens or max_model_len; `abort`
frees its pages (at once, or at the holding instance's next step boundary while its thread runs). Bad
requests raise `RequestError` at `add_request` and leave the engine serving.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable

import numpy as np

from ernie_jax.engine.compile_pool import compile_behind
from ernie_jax.engine.config import EngineConfig
from ernie_jax.engine.cpu_rules import min_decode_rows
from ernie_jax.engine.instance import Instance, StepOutputs
from ernie_jax.engine.kv_cache_manager import KVCacheManager
from ernie_jax.engine.output_processor import OutputProcessor
from ernie_jax.engine.page_transfer import PageTransfer
from ernie_jax.engine.pages import PagePool
from ernie_jax.engine.programs import ModelPrograms, compile_startup
from ernie_jax.engine.report import CompileReport, compile_report
from ernie_jax.engine.request import Request, RequestError, RequestMetrics, RequestStatus, validate
from ernie_jax.engine.runner import ModelRunner
from ernie_jax.engine.scheduler import Scheduler
from ernie_jax.engine.shapes import step_shapes, table_pages
from ernie_jax.engine.stats import EngineStats, snapshot
from ernie_jax.engine.speculative import SpecDecodeStats
from ernie_jax.engine.step import Handoff, Prefilled
from ernie_jax.model.ernie import ErnieForCausalLM
from ernie_jax.sampling import SamplingParams, sampler_seed
from ernie_jax.structured.guide import Guides
from ernie_jax.structured.spec import StructuredOutputError
from ernie_jax.tokenizer import IncrementalDetokenizer

__all__ = ["Engine", "Request", "RequestError", "CompileReport"]

log = logging.getLogger("ernie_jax.engine")


class Engine:
    def __init__(self, model: ErnieForCausalLM, config: EngineConfig, *, prefill_model: ErnieForCausalLM | None = None,
                 tokenizer=None, eos_token_ids: frozenset[int] = frozenset(), expert_balancer=None):
        """model: the decode-side model (placed on its mesh). config: every setting (engine/config.py; its
        scheduler.max_model_len resolved). prefill_model: the same weights on a disjoint mesh for
        disaggregated prefill, or None to prefill with `model` (colocated). expert_balancer: EPLB
        (engine/expert_balance.py): the models' experts are laid out in its placement, which it re-places
        from measured load; or None.

        KV pools: config.cache.num_gpu_blocks_override pages each, else sized from device memory
        (gpu_memory_utilization, default 0.9) or, where the devices report no memory limit (CPU),
        max_num_seqs x max_model_len tokens. batch_invariant: decode every batch at one shape and prefill
        one prompt at a time, so a request's tokens do not depend on what else runs (matmul kernels pick
        their reduction order by shape: a near-tie in greedy decoding can resolve differently alone and in
        a batch). background_compile: return once the largest bucket of each program compiled; the others
        compile behind (small batches run padded until their bucket is ready)."""
        self.config, self.cfg = config, model.config
        sched, cache = config.scheduler, config.cache
        self.policy, self.speculative = config.parallel.pd_policy, config.speculative
        k = self.speculative.num_speculative_tokens if self.speculative else 0
        if k and model.mtp is None:
            raise ValueError(f"speculative_config method {self.speculative.method!r} needs the model's MTP block "
                             "(num_nextn_predict_layers = 1 and its ernie.mtp_block.0.* weights); this model has "
                             "none")
        self.spec_stats = SpecDecodeStats(k)
        self.balancer = expert_balancer
        self.max_num_seqs, self.max_model_len, self.page_size = sched.max_num_seqs, sched.max_model_len, cache.block_size
        self.max_pages = table_pages(self.max_model_len, self.page_size)
        self.tokenizer = tokenizer
        self.guides = Guides(tokenizer, self.cfg.vocab_size) if tokenizer is not None else None
        self.lock = threading.RLock()  # the waiting queue, the requests, the schedulers' state
        self.waiting: list[Request] = []
        self.outputs = OutputProcessor(max_model_len=self.max_model_len, eos_token_ids=eos_token_ids,
                                       tokenizer=tokenizer)
        t0 = time.perf_counter()
        self.instances = self._build_instances(model, prefill_model, k)
        for inst in self.instances:
            if inst.pool.capacity < self.max_pages:
                log.warning("the %s pool holds %d tokens, less than max_model_len %d: requests that may grow "
                            "past it are rejected", inst.name, inst.pool.capacity * self.page_size, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._compiles_cancelled = threading.Event()
        if sched.background_compile:
            jobs = [i.programs.take_rest() for i in self.instances]  # paused while requests are being served
            threading.Thread(target=compile_behind, args=(jobs, lambda: bool(self.requests), self._compiles_cancelled),
                             daemon=True, name="ernie-compile").start()
        else:
            for inst in self.instances:
                inst.programs.compile_rest()
        self.startup_seconds = time.perf_counter() - t0
        self._ids = itertools.count()
        self._rng = np.random.default_rng(config.load.seed)
        self.moe_layers = [i for i in range(self.cfg.num_hidden_layers) if self.cfg.is_moe_layer(i)]
        self.role_switches: dict[tuple[str, str, str], int] = {}  # (instance, from, to) -> count
        self.pd_requests: dict[tuple[str, str], int] = {}  # finished requests by (prefilled on, decoded on)
        self.on_output: Callable[[Request], None] | None = None  # set by start(): token or finish
        self.on_finish: Callable[[Request], None] | None = None  # each finished request, for metrics
        self._threads: list[threading.Thread] = []
        self._wake = threading.Condition(self.lock)
        self._stop = False
        self._publish()

    def _build_instances(self, model, prefill_model, k: int) -> list[Instance]:
        """One instance (colocated) or two (PD): programs, pool, scheduler and runner each."""
        sched, cache = self.config.scheduler, self.config.cache
        self.max_num_batched_tokens, chunks, prefills, batches = step_shapes(
            max_num_batched_tokens=sched.max_num_batched_tokens, max_model_len=self.max_model_len,
            page_size=self.page_size, max_num_seqs=self.max_num_seqs, min_decode_rows=min_decode_rows(model),
            batch_invariant=sched.batch_invariant)
        # A server compiles the prompt-scoring prefill of each chunk length behind it too, so the first echo
        # + logprobs request does not compile on an engine thread while streams wait.
        scoring = tuple(chunks) if sched.background_compile else ()
        both = prefill_model is None or self.policy.mode == "dynamic"  # which programs each instance compiles
        placement = self.balancer.placement if self.balancer else None
        salt_dtype, instances = None, []
        for name, home, m in ([("mixed", "mixed", model)] if prefill_model is None else
                              [("prefill", "prefill", prefill_model), ("decode", "decode", model)]):
            programs = ModelPrograms(m, name, cache, prefill_buckets=prefills if both or home == "prefill" else [],
                                     decode_buckets=batches if both or home == "decode" else [],
                                     score_buckets=scoring if both or home == "prefill" else (),
                                     max_pages_per_seq=table_pages(self.max_model_len, self.page_size, k),
                                     speculative_tokens=k, expert_placement=placement,
                                     batch_invariant=sched.batch_invariant,
                                     pages_without_memory_limit=self.max_num_seqs * self.max_pages + 1,
                                     startup_kinds=("prefill", "decode") if home == "mixed" else (home,),
                                     decode_steps=sched.num_scheduler_steps)
            # The prefix cache's hash chain starts from what else decides a page's KV besides its tokens.
            salt_dtype = salt_dtype or programs.cache.k[0].dtype
            pages = PagePool(programs.num_pages, self.page_size, enable_caching=cache.enable_prefix_caching,
                             salt=f"kv {salt_dtype} page {self.page_size}".encode())
            scheduler = Scheduler(name, home, KVCacheManager(pages, max_pages=self.max_pages, lookahead=k),
                                  self.waiting, policy=self.policy, shapes=programs.shapes, outputs=self.outputs,
                                  max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                  spec_stats=self.spec_stats)
            runner = ModelRunner(programs, vocab_size=self.cfg.vocab_size, stop_ids=self.outputs.stop_ids)
            instances.append(Instance(name, home, scheduler, runner, lock=self.lock, balancer=self.balancer))
        compile_startup([i.programs for i in instances])
        if prefill_model is not None:
            prefill, decode = instances
            prefill.peer, decode.peer = decode, prefill
            prefill.runner.transfer = PageTransfer(prefill.programs, decode.programs)
        return instances

    # ---- state ----------------------------------------------------------------------------------------------
    @property
    def disaggregated(self) -> bool:
        return len(self.instances) > 1

    def instance(self, name: str) -> Instance:
        return next(i for i in self.instances if i.name == name)

    @property
    def prefilling(self) -> list[Request]:
        return [r for i in self.instances for r in i.prefilling]

    @property
    def running(self) -> list[Request]:
        return [r for i in self.instances for r in i.running]

    @property
    def pools(self) -> dict[str, PagePool]:
        """The KV page pools by instance: {"mixed": pool} or {"prefill": pool, "decode": pool}."""
        return {i.name: i.pool for i in self.instances}

    @property
    def expert_tokens(self) -> np.ndarray:
        """Tokens routed to each expert of each MoE layer, [L_moe, E], over every instance."""
        return sum(i.runner.expert_tokens for i in self.instances)

    def stats(self) -> EngineStats:
        """The last stats snapshot the engine published (engine/stats.py): whenever it recorded a step's
        requests, and when a request is queued; a reader on another thread gets it without the engine's lock."""
        return self._stats

    def _publish(self) -> None:
        with self.lock:
            self._stats = snapshot(self)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.outputs.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.outputs.eos_token_ids = frozenset(ids)

    def counter(self, name: str) -> int:
        """A scheduler counter (num_preemptions, prefix_queries, prefix_hits, prefill_tokens), all instances."""
        return sum(getattr(i.scheduler, name) for i in self.instances)

    @property
    def compile_report(self) -> CompileReport:
        return compile_report(self)

    # ---- requests -------------------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Everything add_request needs of a request, checked before anything is queued (request.validate);
        raises RequestError naming the field. Nothing a request holds can fail a step once this passed."""
        validate(prompt_ids, params, vocab_size=self.cfg.vocab_size, max_model_len=self.max_model_len,
                 kv_managers={i.name: i.scheduler.kv for i in self.instances}, has_tokenizer=self.tokenizer is not None)
        if params.structured_outputs is not None:  # compiled here, on the caller's thread (cached by constraint)
            try:
                self.guides.compile(params.structured_outputs)
            except StructuredOutputError as e:
                raise RequestError(str(e), param=e.field) from None

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, *,
                    export_kv: bool = False, prefilled: Prefilled | None = None) -> str:
        """Validate and queue a request (any thread; never waits for a step); returns its id.
        export_kv: another server decodes it; once prefilled, its prompt's KV is kept for that server's pull
        (engine/kv_connector.py). prefilled: another server prefilled it: its first token, and its prompt's KV
        pulled from there (handed over to this engine's decode instance) or None (the prompt is recomputed
        here). The first token may already finish it."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, params)
        with self.lock:
            request_id = request_id or f"req-{next(self._ids)}"
            if request_id in self.requests:
                raise RequestError(f"request id {request_id!r} is already in use")
            seed = sampler_seed(params.seed) if params.seed is not None else int(self._rng.integers(2**31))
            req = Request(request_id, prompt_ids, params, seed, RequestMetrics(time.perf_counter()), export_kv=export_kv)
            if self.tokenizer is not None:
                req.text, req.detokenizer = "", IncrementalDetokenizer(self.tokenizer)
            if params.structured_outputs is not None:
                req.guide = self.guides.new(params.structured_outputs)
            self.requests[request_id] = req
            if prefilled is None or not self._add_prefilled(req, prefilled):
                self.waiting.append(req)
            self._publish()
            self._wake.notify_all()
        if prefilled is not None and self.on_output is not None:  # its first token is out
            self.on_output(req)
        return request_id

    def cached_prefix_pages(self, prompt_ids: list[int]) -> int:
        """Leading full pages of the prompt the decode instance's prefix cache holds now (EngineClient)."""
        with self.lock:
            return self.instances[-1].scheduler.kv.cached_prompt_pages(prompt_ids)

    def _add_prefilled(self, req: Request, p: Prefilled) -> bool:
        """Apply another server's first token to req and hand it, with its pulled KV, to the decode instance;
        False when req must still be queued (its KV was not pulled: the prompt is recomputed here)."""
        done = self.outputs.append(req, p.first_token)
        if p.logprob is not None and req.params.logprobs is not None:
            req.logprobs[-1] = p.logprob  # the entry as the prefill server computed it
        req.prefilled_on, req.drafts = "remote", p.drafts
        if done:
            self._record([req])
            return True
        if p.kv is None:
            return False
        inst = self.instances[-1]  # the decode instance (the only one, colocated)
        req.status, req.holder = RequestStatus.HANDING_OVER, inst.name
        inst.scheduler.incoming.append(Handoff(req, p.kv, list(range(p.num_pages)), 0.0, p.reused))
        return True

    def abort(self, request_id: str) -> None:
        """Finish a request as aborted and free its pages: at once when no instance thread runs or it still
        waits, else at the holding instance's next step boundary."""
        with self.lock:
            req = self.requests.get(request_id)
            if req is None or req.finished:
                return
            holder = next((i for i in self.instances if i.holds(req)), None)
            if holder is not None and self._threads:
                req.abort_requested = True
                self._wake.notify_all()
                return
            if holder is not None:
                holder.scheduler.abort(req)
            else:
                self.outputs.finish(req, "abort")
            self._record([req])
            if self.on_output is not None:
                self.on_output(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(i.scheduler.has_work() for i in self.instances)

    def _record(self, touched: list[Request]) -> None:
        """The engine's part of requests that finished: forget them, count them (on_finish: metrics)."""
        with self.lock:
            for req in touched:
                if not req.finished or self.requests.pop(req.request_id, None) is None:
                    continue
                if req in self.waiting:
                    self.waiting.remove(req)
                if self.on_finish is not None:
                    self.on_finish(req)
                if req.prefilled_on is not None:
                    key = (req.prefilled_on, req.decoded_on)
                    self.pd_requests[key] = self.pd_requests.get(key, 0) + 1
            self._publish()

    def _took_step(self, inst: Instance, out: StepOutputs) -> list[Request]:
        """Book what an instance step reports; returns the requests it touched."""
        if out.role_switch is not None:
            with self.lock:
                key = (inst.name, *out.role_switch)
                self.role_switches[key] = self.role_switches.get(key, 0) + 1
        self._record(out.touched)  # publishes the stats
        if out.rebalance:
            self.rebalance_experts()
        if out.handed_over:
            self.wake()
        return out.touched

    def rebalance_experts(self) -> dict:
        """EPLB: a new expert placement from the measured load window, applied by every instance at its next
        step boundary (between steps: nothing is dropped or recomputed); returns the balancedness before and
        after. (Every eplb_config.step_interval steps too.)"""
        if self.balancer is None:
            raise RuntimeError("this engine has no redundant experts (eplb_config)")
        out = self.balancer.rebalance([i.name for i in self.instances])
        if out["rebalanced"] and not self._threads:
            for inst in self.instances:  # offline: no boundary thread to wait for
                inst.take_placement()
        return out

    def wake(self) -> None:
        with self.lock:
            self._wake.notify_all()

    # ---- stepping -------------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One step of every instance, all dispatched before any is read; returns the requests that got a
        token (or finished). Not while start()'s threads run."""
        if self._threads:
            raise RuntimeError("the engine's instances step on their own threads (start()); step() is for "
                               "single-threaded use")
        begun = [(inst, inst.begin()) for inst in self.instances]
        return [r for inst, b in begun for r in self._took_step(inst, inst.end(b))]

    def run_until_done(self, request_ids: list[str]) -> None:
        targets = [self.requests[r] for r in request_ids]
        while not all(r.finished for r in targets):
            self.step()

    def recover(self) -> list[Request]:
        """After step() raised: fail the failed step's requests on every instance (Instance.recover, which
        keeps a pool that is intact and rebuilds one that is not); returns them."""
        failed = [r for inst in self.instances for r in inst.recover()[0]]
        self._record(failed)
        return failed

    def start(self, on_output: Callable[[Request], None], on_error: Callable[[Request, BaseException], None]) -> None:
        """Step each instance on its own thread until stop(). on_output(req): req got a token or finished;
        on_error(req, exc): a step failed and req (which held pages there) is lost; the instance rebuilds
        its pool and keeps serving. Both are called on the instance's thread."""
        self.on_output, self._stop = on_output, False
        self._threads = [threading.Thread(target=self._loop, args=(inst, on_output, on_error), daemon=True,
                                          name=f"ernie-{inst.name}") for inst in self.instances]
        for t in self._threads:
            t.start()

    @property
    def alive(self) -> bool:
        """Whether start()'s instance threads are all running."""
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def shutdown(self) -> None:
        """stop() for good: also skip the background compiles not started yet, so the process exits now."""
        self._compiles_cancelled.set()
        self.stop()
        for inst in self.instances:  # the page bookkeeping's invariant, once nothing steps any more
            try:
                inst.scheduler.kv.check()
                log.info("%s: KV pool consistent, %d of %d pages free", inst.name, inst.pool.free, inst.pool.capacity)
            except AssertionError as e:
                log.error("%s: KV pool inconsistent at shutdown: %s", inst.name, e or "pages leaked")

    def stop(self) -> None:
        self._stop = True
        self.wake()
        for t in self._threads:
            t.join(timeout=10)
        self._threads = []

    def _loop(self, inst: Instance, on_output, on_error) -> None:
        while not self._stop:
            with self.lock:
                if inst.idle() and not self._stop:
                    self._wake.wait(timeout=0.05)
                    continue
            try:
                touched = self._took_step(inst, inst.step())
            except Exception as e:  # noqa: BLE001 -- fail that step's requests, keep serving
                log.exception("%s: step failed", inst.name)
                failed, kept = inst.recover()
                self._record(failed)
                log.error("%s: failed the %d requests of that step; %s", inst.name, len(failed),
                          "its KV pool is intact and keeps its prefix cache" if kept else
                          "its KV pool may be consumed: rebuilt empty, with every request that held pages")
                for req in failed:
                    on_error(req, e)
                continue
            for req in touched:
                on_output(req)
