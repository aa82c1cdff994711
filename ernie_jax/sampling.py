"""Sampling parameters (vLLM's names and defaults) and the on-device token sampler.

The sampler is one jitted function over a batch of rows, each with its own temperature, top-p, top-k,
min-p, penalties and seed; a row's random stream depends only on (seed, step), so the same seed gives the
same tokens whatever else is in the batch. temperature = 0 is greedy. Penalties follow vLLM: presence and
frequency penalties count the generated tokens; the repetition penalty applies to prompt and generated
tokens (divide positive logits, multiply negative ones). Logprobs are those of the model's distribution
(before temperature and filtering), with the top-n alternatives.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math

import jax
import jax.numpy as jnp
from jax import lax

from ernie_jax.structured.spec import StructuredOutputError, StructuredOutputsParams

MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """A request parameter out of its range; the message names the parameter, `field` is its name."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# Bounds that keep every value meaningful once it is an f32 / int32 / uint32 device array: a temperature or
# repetition penalty whose f32 form overflows would turn masked (-inf) logits into NaN; top-k is an int32.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_TOP_K = 2**31 - 1
# Seeds: any 64-bit integer, signed or unsigned, as vLLM takes them; the sampler's stream takes 32 bits
# (sampler_seed).
MIN_SEED, MAX_SEED = -2**63, 2**64 - 1
GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (vLLM's rule), since logits / t overflow f32


def sample_seed(seed: int | None, j: int) -> int | None:
    """The seed of sample j of a request seeded `seed` (n > 1): seed + j, wrapping within 64 bits, so the
    samples differ and each is reproducible (a router that sends the samples apart uses the same rule)."""
    return None if seed is None else seed + j - (2**64 if seed + j > MAX_SEED else 0)


def sampler_seed(seed: int) -> int:
    """The sampler's 32-bit seed for a request seed in [MIN_SEED, MAX_SEED]: the seed itself when it already
    is one (so those streams never change), otherwise a hash of its 64-bit form."""
    if 0 <= seed < 2**32:
        return seed
    digest = hashlib.blake2b((seed % 2**64).to_bytes(8, "little"), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each token's logprob
    prompt_logprobs: int | None = None  # the same for each prompt token (the first has none)
    logit_bias: dict[int, float] | None = None  # token id -> value added to its logit (OpenAI's logit_bias)
    # what the text must match: a JSON schema, a regex, a choice or a grammar (ernie_jax.structured)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Every field in its range (the engine checks again what it is given: fields may change after
        construction); normalises stop, stop_token_ids and logit_bias."""
        def bad(name, why):
            raise SamplingParamsError(name, f"SamplingParams.{name}={getattr(self, name)!r}: {why}")
        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be a number in [0, {MAX_TEMPERATURE:g}] (0 means greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            bad("top_k", f"must be an integer in [-1, {MAX_TOP_K}] (0 or -1 disables it)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", "must be an integer in [0, max_tokens]")
        if self.seed is not None and (not _is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            bad("seed", f"must be an integer in [{MIN_SEED}, {MAX_SEED}] (64 bits)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (AttributeError, TypeError, ValueError):
                bad("logit_bias", "must map token ids to numbers")
            if any(not _is_number(v) or not -100 <= v <= 100 for v in self.logit_bias.values()):
                bad("logit_bias", "values must be numbers in [-100, 100]")
            self.logit_bias = {k: float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop or [], (list, tuple)) or not all(isinstance(s, str) for s in self.stop or []):
            bad("stop", "must be a string or a list of strings")
        self.stop = [s for s in (self.stop or []) if s]
        if not all(_is_int(t) for t in self.stop_token_ids or []):
            bad("stop_token_ids", "must be a list of integers")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams")
            try:
                self.structured_outputs.check()
            except StructuredOutputError as e:
                raise SamplingParamsError("structured_outputs", str(e)) from None

    def for_sample(self, j: int) -> SamplingParams:
        """The parameters of sample j of the n this asks for: one sample each, seeded by sample_seed."""
        return dataclasses.replace(self, n=1, seed=sample_seed(self.seed, j))

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


def _row_key(seed, step):
    return jax.random.fold_in(jax.random.key(seed), step)


@functools.partial(jax.jit, static_argnames=("num_logprobs", "token_logprobs"))
@jax.named_scope("sampling")
def sample(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array, seeds: jax.Array,
           steps: jax.Array, min_p: jax.Array | None = None, penalties: tuple | None = None,
           allowed: jax.Array | None = None, num_logprobs: int = 0, token_logprobs: bool = True):
    """logits [B,V] f32; temperature, top_p, min_p [B] f32; top_k [B] int32; seeds [B] uint32; steps [B] int32.
    penalties: None or (presence [B], frequency [B], repetition [B], output_counts [B,V], prompt_mask [B,V],
    logit_bias [B,V]) -- the bias carries -inf on stop tokens while a row is below its min_tokens.
    allowed: None or [B, ceil(V/32)] int32, the tokens each row may take (bit t%32 of word t//32; structured
    output): the others are never sampled. Logprobs stay the model's, before the mask (as vLLM's).

    token_logprobs=False (a caller whose rows ask for no logprobs): the token logprobs are zeros, and the
    vocabulary-wide log-softmax is not computed.

    Returns (token ids [B] int32, token logprobs [B] f32, top ids [B,n], top logprobs [B,n]).
    """
    logprobs_all = jax.nn.log_softmax(logits, axis=-1) if token_logprobs or num_logprobs else None
    if penalties is not None:
        presence, frequency, repetition, counts, prompt_mask, bias = penalties
        seen = (counts > 0) | prompt_mask
        rep = repetition[:, None]
        logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0) + bias
    if allowed is not None:
        logits = jnp.where(unpack_bitmask(allowed, logits.shape[-1]), logits, -jnp.inf)
    greedy = _argmax(logits)
    # An all-greedy batch skips the full-vocabulary sort (lax.cond runs one branch).
    tokens = lax.cond(jnp.any(temperature > 0), lambda: _sample_rows(
        logits, greedy, temperature, top_p, top_k, min_p, seeds, steps), lambda: greedy)
    lps = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0] if logprobs_all is not None else \
        jnp.zeros(tokens.shape, jnp.float32)
    top_lp, top_ids = lax.top_k(logprobs_all, num_logprobs) if num_logprobs else (
        jnp.zeros((logits.shape[0], 0)), jnp.zeros((logits.shape[0], 0), jnp.int32))
    return tokens, lps, top_ids.astype(jnp.int32), top_lp


def unpack_bitmask(words: jax.Array, V: int) -> jax.Array:
    """[B, W] int32 words -> [B, V] bool: bit t % 32 of word t // 32 says whether token t is allowed."""
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :V].astype(bool)


def _argmax(logits: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first maximum, or the first NaN), as a max and a min: XLA:CPU's
    variadic argmax reduction is about three times slower than the two (benchmarks/RESULTS.md, "CPU
    measurements behind design choices")."""
    V = logits.shape[-1]
    top = (logits == jnp.max(logits, axis=-1, keepdims=True)) | jnp.isnan(logits)
    return jnp.min(jnp.where(top, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def _sample_rows(logits, greedy, temperature, top_p, top_k, min_p, seeds, steps):
    V = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    sorted_logits, sorted_ids = lax.top_k(logits / t, V)
    rank = jnp.arange(V)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]  # the top token is always kept
    if min_p is not None:
        keep &= probs >= min_p[:, None] * probs[:, :1]
    keys = jax.vmap(_row_key)(seeds, steps)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, sorted_logits, -jnp.inf))
    sampled = jnp.take_along_axis(sorted_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """logits [N,V] / temperature with the tokens that top-k and top-p cut set to -inf, in vocabulary order:
    the distribution `_sample_rows` draws from (without min-p). temperature [N] > 0."""
    V = logits.shape[-1]
    sorted_logits, sorted_ids = lax.top_k(logits / temperature[:, None], V)
    rank = jnp.arange(V)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
    kept = jnp.zeros(logits.shape, bool).at[jnp.arange(logits.shape[0])[:, None], sorted_ids].set(keep)
    return jnp.where(kept, logits / temperature[:, None], -jnp.inf)


@jax.named_scope("speculative_verify")
def speculative_verify(logits: jax.Array, drafts: jax.Array, temperature: jax.Array, top_p: jax.Array,
                       top_k: jax.Array, seeds: jax.Array, steps: jax.Array, max_accept: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
    """Verify k draft tokens per row against the target's logits at k+1 positions.

    logits [B,k+1,V]: the target after the last accepted token and after each draft; drafts [B,k];
    steps [B]: the index of the first token this step emits (its sampling stream: (seed, steps + j));
    max_accept [B]: how many drafts a row may accept (0: it takes one token, as without speculation).
    A greedy row accepts a draft iff it is the target's argmax, so its tokens are exactly greedy decoding's.
    A sampled row treats the draft as a point-mass proposal: draft d at position j is accepted with
    probability p_j(d), where p_j is the target's filtered distribution (temperature, top-k, top-p); at the
    first rejection the token is drawn from p_j without d (renormalised), and after k acceptances a bonus
    token from p_k. Each emitted token is then distributed exactly as p (speculative sampling's rule with
    q = one-hot(d)). Returns (tokens [B,k+1]: the emitted ones first, accepted [B]): a row emits
    tokens[:accepted + 1]."""
    B, T, V = logits.shape
    k = T - 1
    greedy = _argmax(logits.reshape(B * T, V)).reshape(B, T)
    sampled_rows = temperature > 0
    j = jnp.arange(T)[None, :]

    def sample_all():
        t = jnp.where(sampled_rows, temperature, 1.0)
        flat = filtered_logits(logits.reshape(B * T, V), jnp.repeat(t, T), jnp.repeat(top_p, T), jnp.repeat(top_k, T))
        flat = flat.reshape(B, T, V)
        keys = jax.vmap(jax.vmap(_row_key, (None, 0)), (0, 0))(seeds, steps[:, None] + j)  # [B,T]
        plain = jax.vmap(jax.vmap(jax.random.categorical))(keys, flat)
        probs = jax.nn.softmax(flat[:, :k], axis=-1)
        p_draft = jnp.take_along_axis(probs, drafts[..., None], axis=-1)[..., 0]  # [B,k]
        accept_keys = jax.vmap(jax.vmap(lambda key: jax.random.fold_in(key, 1)))(keys[:, :k])
        u = jax.vmap(jax.vmap(jax.random.uniform))(accept_keys)
        without = jnp.where(jax.nn.one_hot(drafts, V, dtype=bool), -jnp.inf, flat[:, :k])
        resample_keys = jax.vmap(jax.vmap(lambda key: jax.random.fold_in(key, 2)))(keys[:, :k])
        resampled = jax.vmap(jax.vmap(jax.random.categorical))(resample_keys, without)
        return plain.astype(jnp.int32), u < p_draft, resampled.astype(jnp.int32)

    plain, accepts, resampled = lax.cond(jnp.any(sampled_rows), sample_all, lambda: (
        greedy, jnp.zeros((B, k), bool), greedy[:, :k]))
    accepts = jnp.where(sampled_rows[:, None], accepts, drafts == greedy[:, :k])
    accepted = jnp.minimum(jnp.sum(jnp.cumprod(accepts, axis=1), axis=1), max_accept).astype(jnp.int32)
    # the token at the first position not accepted: a rejected draft's resample, else a plain draw (after
    # every draft was accepted, or where max_accept stopped a row)
    rejected = jnp.concatenate([~accepts, jnp.zeros((B, 1), bool)], axis=1)
    resampled = jnp.concatenate([resampled, plain[:, k:]], axis=1)
    own = jnp.where(sampled_rows[:, None], jnp.where(rejected, resampled, plain), greedy)
    padded_drafts = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j < accepted[:, None], padded_drafts, own)
    return tokens.astype(jnp.int32), accepted
