"""The model runner of one instance: turns a `StepPlan` into device calls and their outputs into a
`StepResult`. It decides nothing: which requests run, in which rows, whether a decode step chains onto the
one in flight and how many decode steps its program runs are the plan's (engine/scheduler.py).

`dispatch(plan)` builds the inputs (token ids, positions, block tables, sampling arrays), dispatches the
prefill program then the decode program without waiting, and returns what `read()` waits for. A decode
step the plan chains stays in flight: the next plan's decode step takes its sampled tokens (and, with
speculative decoding, its accepted counts and drafts) as inputs on the device, and it is read with that
next step, so the host's bookkeeping overlaps the device. `read_in_flight()` reads it at once when the
scheduler needs its tokens on the host first.

Hand-over (PD): `copy_out` gathers a request's pages and copies them onto the receiving mesh (waiting for
the copy: the sender's thread waits, nobody else's), `copy_in` scatters them into this pool (dispatched,
not waited for).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np

from ernie_jax.engine.page_transfer import PageTransfer
from ernie_jax.engine.programs import ModelPrograms
from ernie_jax.engine.sampling_inputs import plain_sampling, sampling_arrays
from ernie_jax.engine.step import Handoff, RowOutput, StepPlan, StepResult
from ernie_jax.structured.guide import bitmask


class Dispatched(NamedTuple):
    """A program step in flight: its sampled tokens (and logprobs) and expert counts are still on the device."""
    kind: str  # "prefill", "decode" or "verify" (a speculative decode step)
    reqs: list  # the request of each row that gets a token (None: a prefill row mid-prompt)
    t0: float  # dispatch time
    counts: Any  # tokens per expert per MoE layer
    sampled: Any = None  # prefill/decode: sample()'s (tokens, logprobs, top ids, top logprobs); None: chunks mid-prompt
    drafts: Any = None  # speculative decoding: the MTP block's next drafts [B,k]
    verified: Any = None  # verify: (tokens [B,k+1], accepted [B])
    fallback: Any = None  # verify: the host sampler's result for the rows not speculating (None: all speculate)
    speculating: list[bool] | None = None  # verify: which rows accept drafts
    inputs: Any = None  # verify: its (positions [B,k+1], sampling steps [B]) on the device
    batch: int = 0  # decode / verify: the program's B
    steps: int = 1  # decode: the decode steps its program ran (multi-step: sampled leaves are [B, steps, ...])
    home: Any = None  # what read() takes to the host, on its way here already (ModelPrograms.send)

    def outputs(self) -> tuple:
        """What read() takes to the host."""
        if self.kind == "verify":
            return self.counts, self.verified, self.fallback, self.drafts
        return self.counts, self.sampled, self.drafts


class ModelRunner:
    def __init__(self, programs: ModelPrograms, *, vocab_size: int, stop_ids):
        """stop_ids(req): the tokens min_tokens suppresses (the output processor's)."""
        self.programs, self.k = programs, programs.k
        self.vocab_size, self.stop_ids = vocab_size, stop_ids
        self.transfer: PageTransfer | None = None  # to the peer, when this instance hands over
        self.exporter = self.importer = None  # KV to and from other servers (kv_connector.py), when set
        self.busy_seconds = {"prefill": 0.0, "decode": 0.0}  # per program: dispatch to result
        self.steps = {"prefill": 0, "decode": 0}  # steps completed
        self.mask_seconds, self.masked_steps = 0.0, 0  # structured output: host time spent on token masks
        self.expert_tokens = np.zeros(programs.expert_shape, np.int64)
        self._ahead: Dispatched | None = None  # a chained decode step, read with the next step
        self.in_step: list = []  # the requests handed to programs or read since the step began (a failure's)

    @property
    def in_flight(self) -> tuple[list, int] | None:
        """The chained decode step in flight: (its batch, its program's B), or None."""
        return None if self._ahead is None else (self._ahead.reqs, self._ahead.batch)

    # ---- hand-over ----------------------------------------------------------------------------------------
    def copy_out(self, src_pages: list[int]) -> tuple:
        """(the pages' KV landed on the peer's mesh, None: the copy's time is the time this call took)."""
        return self.transfer.gather(src_pages), None

    def copy_in(self, h: Handoff, pages: list[int], sender: "ModelRunner | None") -> None:
        """Scatter a handed-over request's KV into its pages here: from the peer instance (sender), or pulled
        from another server (sender None)."""
        if sender is None:
            self.importer.scatter(h.kv, pages[:len(h.src_pages)])
        else:
            sender.transfer.scatter(h.kv, h.src_pages, pages[:len(h.src_pages)])

    def export(self, req, pages: list[int]) -> None:
        """Keep a prefilled prompt's KV for another server's decode (KVExporter.export)."""
        if self.exporter is None:
            raise RuntimeError(f"{req.request_id} asks for its KV to be exported, but this server has no KV "
                               "exporter (--pd-role prefill)")
        self.exporter.export(req, pages)

    # ---- dispatch -------------------------------------------------------------------------------------------
    def _inputs(self, reqs, B: int) -> tuple[dict, int]:
        return sampling_arrays(reqs, B, vocab_size=self.vocab_size, stop_ids=self.stop_ids)

    def _table(self, pages: list[int]) -> np.ndarray:
        return np.asarray(pages + [0] * (self.programs.max_pages - len(pages)), np.int32)

    def dispatch(self, plan: StepPlan) -> tuple[list[Dispatched], list]:
        """Dispatch the plan's prefill and decode programs; returns (steps to read, scored chunks)."""
        pending, scored = [], []
        sent = lambda step: step._replace(home=self.programs.send(step.outputs()))  # noqa: E731
        if plan.prefill:
            pending.append(sent(self._dispatch_prefill(plan, scored)))
        ahead, self._ahead = self._ahead, None
        assert (ahead is not None) == plan.after_in_flight, "a plan must say whether it follows the step in flight"
        if plan.decode:
            step = sent(self._dispatch_verify(plan, ahead) if self.k else self._dispatch_decode(plan, ahead))
            if plan.chain:
                self._ahead = step  # read by the next step, while the device runs the one after it
            else:
                pending.append(step)
        if ahead is not None:
            pending.insert(0, ahead)
        return pending, scored

    def _dispatch_prefill(self, plan: StepPlan, scored: list) -> Dispatched:
        (B, T), chunks = plan.prefill_shape, plan.prefill
        self.in_step += [c.req for c in chunks]
        ids, positions = np.zeros((B, T), np.int32), np.tile(np.arange(T, dtype=np.int32), (B, 1))
        tables = np.zeros((B, self.programs.max_pages), np.int32)  # padding rows write the null page 0
        last = np.full(B, -1, np.int32)  # -1: a padding row, no real token
        for i, c in enumerate(chunks):
            ids[i, :len(c.tokens)] = c.tokens
            positions[i] += c.start
            tables[i] = self._table(c.req.pages)
            last[i] = len(c.tokens) - 1
        t0 = time.perf_counter()
        first = chunks[0]
        arrays, nlp = self._inputs([c.req for c in chunks], B)
        drafts = None
        if first.req.scores_prompt:  # a scored chunk runs alone
            req, start, n = first.req, first.start, len(first.tokens)
            targets = req.prompt_ids[start + 1:start + 1 + n]  # the token after each position
            padded = np.asarray([targets + [0] * (T - len(targets))], np.int32)
            logits, c, scores = self.programs.run_scored(ids, positions, last, tables, padded)
            scored.append((req, start, targets, scores))
            sampled = None
        elif self.k:  # the MTP block drafts after each chunk; it needs the token after the chunk
            following = np.full(B, -1, np.int32)  # -1: the chunk ends its prompt (the sampled token follows)
            for i, ch in enumerate(chunks):
                if not ch.completes:
                    following[i] = ch.req.prefill_ids[ch.start + len(ch.tokens)]
            logits, c, sampled, drafts = self.programs.run("prefill", ids, positions, last, tables, arrays, following)
        else:
            logits, c, sampled = self.programs.run("prefill", ids, positions, last, tables, arrays)
        done = [ch.req if ch.completes else None for ch in chunks]  # rows whose prompt is complete get a token
        if not any(done):  # chunks mid-prompt: only their expert counts
            return Dispatched("prefill", [], t0, c)
        self._mask(arrays, done, B)
        result = sampled if sampled is not None and plain_sampling(arrays, nlp) else \
            self.programs.sample(logits, arrays, nlp)
        return Dispatched("prefill", done, t0, c, result, drafts if sampled is not None else None)

    def _dispatch_decode(self, plan: StepPlan, ahead: Dispatched | None) -> Dispatched:
        reqs, B = plan.decode, plan.decode_batch
        self.in_step += reqs
        pad = B - len(reqs)
        lag = 0 if ahead is None else 1  # tokens in flight per request, not yet in output_ids
        if ahead is None:
            ids = np.asarray([[r.output_ids[-1]] for r in reqs] + [[0]] * pad, np.int32)
        else:  # the step in flight's sampled tokens, still on the device
            ids = self.programs.chain_decode(ahead.sampled[0], B)
        positions = np.asarray([[r.num_tokens - 1 + lag] for r in reqs] + [[0]] * pad, np.int32)
        tables = np.stack([self._table(r.pages) for r in reqs] + [self._table([])] * pad)
        last = np.asarray([0] * len(reqs) + [-1] * pad, np.int32)  # -1: a padding row, no real token
        arrays, nlp = self._inputs(reqs, B)
        arrays["steps"][:len(reqs)] += lag
        t0 = time.perf_counter()
        logits, c, sampled = self.programs.run("decode", ids, positions, last, tables, arrays, None, plan.decode_steps)
        if plan.decode_steps > 1:  # its rows sample on the device alone (Scheduler._decode_steps)
            return Dispatched("decode", reqs, t0, c, sampled, batch=B, steps=plan.decode_steps)
        self._mask(arrays, reqs, B)
        result = sampled if plain_sampling(arrays, nlp) else self.programs.sample(logits, arrays, nlp)
        return Dispatched("decode", reqs, t0, c, result, batch=B)

    def _dispatch_verify(self, plan: StepPlan, ahead: Dispatched | None) -> Dispatched:
        """A speculative decode step: each running request's last token and its k drafts (engine/speculative.py).
        After a step still in flight (`ahead`, the same batch), its inputs are computed on the device from
        that step's tokens, accepted counts and drafts (programs.chain_verify)."""
        reqs, k, B = plan.decode, self.k, plan.decode_batch
        self.in_step += reqs
        pad = B - len(reqs)
        arrays, nlp = self._inputs(reqs, B)
        if ahead is None:
            ids = np.zeros((B, k + 1), np.int32)
            positions = np.zeros((B, k + 1), np.int32)
            for i, r in enumerate(reqs):
                ids[i] = [r.output_ids[-1]] + (r.drafts or [0] * k)  # no drafts (a scored prefill): rejected
                positions[i] = r.num_tokens - 1 + np.arange(k + 1)
        else:
            ids, positions, arrays["steps"] = self.programs.chain_verify(*ahead.verified, ahead.drafts, *ahead.inputs)
        positions, arrays["steps"] = self.programs.put((positions, arrays["steps"]))
        tables = np.stack([self._table(r.pages) for r in reqs] + [self._table([])] * pad)
        last = np.asarray([k] * len(reqs) + [-1] * pad, np.int32)  # -1: a padding row, no real token
        speculating = [r.speculates for r in reqs]
        max_accept = np.asarray([k if s else 0 for s in speculating] + [0] * pad, np.int32)
        t0 = time.perf_counter()
        logits, c, verified, drafts = self.programs.run("decode", ids, positions, last, tables, arrays, max_accept)
        # rows that take one plain token (not speculating) draw it, with its logprobs, from the host's sampler
        self._mask(arrays, reqs, B)
        fallback = None if all(speculating) else self.programs.sample(logits, arrays, nlp)
        return Dispatched("verify", reqs, t0, c, drafts=drafts, verified=verified, fallback=fallback,
                          speculating=speculating, inputs=(positions, arrays["steps"]), batch=B)

    def _mask(self, arrays: dict, reqs: list, B: int) -> None:
        """arrays["allowed"]: the guided rows' token masks (reqs: each sampling row's request, None for a row
        that takes no token), or None. Called after the step's program is dispatched, so they are computed
        while the device runs the forward pass."""
        t0 = time.perf_counter()
        arrays["allowed"] = bitmask([None if r is None else r.guide for r in reqs], B, self.vocab_size)
        if arrays["allowed"] is not None:
            self.mask_seconds += time.perf_counter() - t0
            self.masked_steps += 1

    # ---- results --------------------------------------------------------------------------------------------
    def read_in_flight(self) -> StepResult:
        """Wait for the chained decode step in flight and return its tokens."""
        ahead, self._ahead = self._ahead, None
        return self.read([ahead] if ahead is not None else [])

    def drop_in_flight(self) -> None:
        self._ahead = None

    def read(self, pending: list[Dispatched], scored: list = ()) -> StepResult:
        """Wait for dispatched steps and return their tokens, in dispatch order."""
        fetch = self.programs.fetch
        out = StepResult([], [(req, start, targets, fetch(self.programs.send(scores)))
                              for req, start, targets, scores in scored])
        self.in_step += [r for r, *_ in scored] + [r for step in pending for r in step.reqs if r is not None]
        for step in pending:  # every program is in flight before any is read
            if step.kind == "verify":
                out.rows += self._read_verified(step, out)
                continue
            counts, sampled, drafts = fetch(step.home)
            self._count(counts, out)
            self.busy_seconds[step.kind] += time.perf_counter() - step.t0
            self.steps[step.kind] += step.steps
            if sampled is None:  # a prefill chunk mid-prompt
                continue
            tokens, lps, top_ids, top_lps = sampled
            for i, req in enumerate(step.reqs):
                if step.steps > 1:  # a multi-step program's tokens (its rows ask no logprobs: Request.speculates)
                    out.rows.append(RowOutput(req, step.kind, tokens[i].tolist()))
                elif req is not None:  # None: a prefill row mid-prompt
                    out.rows.append(RowOutput(req, step.kind, [int(tokens[i])], (lps[i], top_ids[i], top_lps[i]),
                                              None if drafts is None else drafts[i].tolist()))
        return out

    def _count(self, counts: np.ndarray, out: StepResult) -> None:
        self.expert_tokens += counts
        out.expert_counts.append(counts)

    def _read_verified(self, step: Dispatched, out: StepResult) -> list[RowOutput]:
        """A speculative decode step's tokens: each row's accepted drafts and the token after them (or, for a
        row not speculating, the host sampler's token with its logprobs), and its next drafts."""
        speculating = step.speculating
        counts, (tokens, accepted), fallback, drafts = self.programs.fetch(step.home)
        self._count(counts, out)
        self.busy_seconds["decode"] += time.perf_counter() - step.t0
        self.steps["decode"] += 1
        rows = []
        for i, req in enumerate(step.reqs):
            if not speculating[i]:
                tok, lps, top_ids, top_lps = (a[i] for a in fallback)
                rows.append(RowOutput(req, "decode", [int(tok)], (lps, top_ids, top_lps), drafts[i].tolist()))
            else:
                n = int(accepted[i])
                rows.append(RowOutput(req, "decode", [int(t) for t in tokens[i, :n + 1]], None, drafts[i].tolist(), n))
        return rows
