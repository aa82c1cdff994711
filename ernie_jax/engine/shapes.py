"""Program shapes: which bucketed shapes an instance compiles, and which one a step runs.

Prefill programs have shape (B, T): B prompt chunks of up to T tokens; decode programs a batch size B.
Sizes are powers of two up to the limits (max_num_batched_tokens, max_num_seqs), so a few programs serve
every request, padded. `ShapeTable` is the set compiled so far (programs join it as they finish
compiling, smallest bucket that holds the work wins); the scheduler plans with it and the simulator uses
the same table without compiling anything. Plain Python.
"""

from __future__ import annotations


def buckets(limit: int, start: int = 1) -> list[int]:
    """Powers of two from `start` up to and including `limit`."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def decode_buckets(max_num_seqs: int, min_rows: int = 1, batch_invariant: bool = False) -> list[int]:
    """Decode batch sizes: powers of two from min_rows (runner/cpu_rules.min_decode_rows) up to
    max_num_seqs, or only max_num_seqs when batch_invariant."""
    rows = max(max_num_seqs, min_rows)
    return [rows] if batch_invariant else buckets(rows, min_rows)


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


def table_pages(max_model_len: int, page_size: int, k: int = 0) -> int:
    """Block-table width (pages) of a sequence: max_model_len's pages, or with k speculative tokens enough
    for what a step writes past the last token (the k drafts, the MTP block's chained drafts and, after a
    step still in flight, k + 1 more); slots past the pages a request holds go to the null page through the
    table's padding."""
    return -(-(max_model_len + (4 * k + 1 if k else 0)) // page_size)


def step_shapes(*, max_num_batched_tokens: int, max_model_len: int, page_size: int, max_num_seqs: int,
                min_decode_rows: int = 1, batch_invariant: bool = False):
    """The shapes an instance compiles: (the per-step token budget, at most a sequence's length; the prefill
    chunk lengths; prefill (B, T) shapes; decode batch sizes). batch_invariant: one decode shape and one
    chunk per prefill."""
    budget = min(max_num_batched_tokens, table_pages(max_model_len, page_size) * page_size)
    chunks = buckets(budget, 16)
    prefills = prefill_shapes(chunks, max_num_batched_tokens, 1 if batch_invariant else max_num_seqs)
    return budget, chunks, prefills, decode_buckets(max_num_seqs, min_decode_rows, batch_invariant)


class ShapeTable:
    """The compiled shapes of one instance: prefill (B, T) pairs, decode batch sizes and multi-step decode
    (B, steps) pairs, ascending."""

    def __init__(self, prefill: list[tuple[int, int]] = (), decode: list[int] = (), multi: list[tuple[int, int]] = ()):
        self.ready: dict[str, list] = {"prefill": sorted(prefill), "decode": sorted(decode), "multi": sorted(multi)}

    def add(self, kind: str, size) -> None:
        """A program of this shape is ready (a new list: planning threads read it unlocked)."""
        self.ready[kind] = sorted(self.ready[kind] + [size])

    def bucket(self, kind: str, n: int) -> int:
        """The smallest ready bucket that holds n tokens (prefill: the chunk length T of a single-chunk
        program) or n sequences (decode)."""
        if kind == "prefill":
            return next(T for B, T in self.ready["prefill"] if B == 1 and T >= n)
        return next(b for b in self.ready[kind] if b >= n)

    def decode_steps(self, B: int) -> int:
        """The most decode steps a ready program for batch B runs (1 without a multi-step program)."""
        return max((n for b, n in self.ready["multi"] if b == B), default=1)

    def prefill_batches(self, T: int) -> list[int]:
        """The ready prefill batch sizes for chunk length T, ascending (1 always among them)."""
        return [B for B, t in self.ready["prefill"] if t == T]

    def batched_prefill_lengths(self, at_least: int) -> list[int]:
        """Chunk lengths >= at_least that have a batched (B > 1) prefill program."""
        return [t for b, t in self.ready["prefill"] if b > 1 and t >= at_least]
