"""Token masks for constrained requests, over llguidance.

`Guides` belongs to one tokenizer and the model's vocabulary width: it builds llguidance's view of the
tokenizer once (each token's bytes; special tokens by id; the end-of-turn ids as EOS), compiles a
constraint's grammar into a matcher (cached by constraint, so 20 requests with one schema compile it
once; each request gets a copy), and times the compiles. A `Guide` is one request's matcher: `fill`
writes the packed bitmask of the tokens it may take next (bit t%32 of word t//32; the model's rows past
the tokenizer's pieces are never allowed), `accept` advances it by the sampled token. `bitmask` packs a
batch's rows, all ones for rows without a constraint.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from ernie_jax.structured.spec import StructuredOutputError, StructuredOutputsParams

CACHE_SIZE = 256  # compiled constraints kept
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # seconds


class _TokenizerView:
    """What llguidance.TokenizerWrapper reads: every token's bytes, the special ids, EOS, and encode."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        special = set(tokenizer.special_ids.values())
        sp = tokenizer.sp
        self.tokens, self.special_token_ids = [], []
        for i in range(vocab_size):
            if i >= tokenizer.vocab_size:  # an embedding row with no piece: never generated under a grammar
                self.tokens.append(b"<|unused|>")
                self.special_token_ids.append(i)
            elif i in special or sp.is_control(i) or sp.is_unknown(i):
                self.tokens.append(sp.id_to_piece(i).encode())
                self.special_token_ids.append(i)
            else:
                self.tokens.append(tokenizer.token_bytes(i))
        eos = tokenizer.eos_token_ids
        self.eos_token_id, self.bos_token_id = (eos[-1] if eos else None), None

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tokenizer.encode(text)


class Guide:
    """One request's matcher: the tokens it may take next, advanced token by token."""

    def __init__(self, matcher: llguidance.LLMatcher, kind: str):
        self.matcher, self.kind = matcher, kind

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed-token bitmask into row (int32 words, C-contiguous)."""
        fill_next_token_bitmask(self.matcher, row[None] if row.ndim == 1 else row)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar cannot take it (the matcher is then in error)."""
        return bool(self.matcher.consume_token(int(token)))

    @property
    def finished(self) -> bool:
        """The grammar is complete and can take nothing more (not even more of a repeated part)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class Guides:
    """Grammar compilation and matchers for one tokenizer and vocabulary width (see the module docstring)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lltokenizer = None
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self.compile_counts = [0] * (len(COMPILE_BUCKETS) + 1)  # grammars compiled, by COMPILE_BUCKETS bucket
        self.compile_seconds = 0.0

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltokenizer is None:
                view = _TokenizerView(self.tokenizer, self.vocab_size)
                self._lltokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), n_vocab=self.vocab_size,
                                                           eos_token=self.tokenizer.eos_token_ids)
            return self._lltokenizer

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The constraint's matcher in its start state (cached); raises StructuredOutputError naming the field
        and what llguidance found wrong (a regex that does not compile, an unsupported schema feature)."""
        key = spec.cache_key()
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        t0 = time.perf_counter()
        try:
            matcher = self._compile(spec)
        except StructuredOutputError:
            raise
        except Exception as e:  # noqa: BLE001 -- whatever llguidance raises on a request's grammar is the request's fault
            raise StructuredOutputError(spec.field, f"{spec.field}: the {spec.kind} constraint does not compile: "
                                        f"{e}") from None
        with self._lock:
            seconds = time.perf_counter() - t0
            self.compile_counts[bisect.bisect_left(COMPILE_BUCKETS, seconds)] += 1
            self.compile_seconds += seconds
            self._compiled[key] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def _compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        grammar, tokenizer = spec.grammar_text(), self.lltokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        error = messages[0] if is_error else None
        matcher = None if is_error else llguidance.LLMatcher(tokenizer, grammar)
        if matcher is not None and matcher.is_error():
            error = matcher.get_error()
        if error is not None:
            raise StructuredOutputError(spec.field, f"{spec.field}: the {spec.kind} constraint does not compile: "
                                        f"{error.strip()}")
        return matcher

    def new(self, spec: StructuredOutputsParams) -> Guide:
        """A fresh matcher for one request (a copy of the compiled one)."""
        return Guide(self.compile(spec).deep_copy(), spec.kind)



def bitmask(guides: list[Guide | None], rows: int, vocab_size: int) -> np.ndarray | None:
    """[rows, ceil(vocab_size / 32)] int32: each guided row's allowed tokens, every other row (and padding) all
    ones; None when no row is guided (the sampler then takes no mask)."""
    if all(g is None for g in guides):
        return None
    mask = np.full((rows, -(-vocab_size // 32)), -1, np.int32)
    for i, g in enumerate(guides):
        if g is not None:
            g.fill(mask[i:i + 1])
    return mask
