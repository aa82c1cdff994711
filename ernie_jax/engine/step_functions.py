"""The step functions every instance compiles, as pure functions of (weights, inputs, KV pool): a prefill
chunk or decode step that also samples (`_step`), several decode steps in one program (`_multi_step`), its
speculative-decoding variants (the MTP block drafting after a prefill chunk, and a verify step that scores k
drafts and drafts again), and a prefill that scores the prompt (prompt logprobs). `step_program` jits one
with explicit shardings and the pool donated, so the pool is updated in place and never leaves its devices;
`lower_step` lowers it from abstract shapes (what `python -m ernie_jax.plan` compiles without weights). Each
also counts the tokens routed to each expert of each MoE layer (load metrics and EPLB).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ernie_jax.model.forward import forward, mtp_draft
from ernie_jax.sampling import MAX_LOGPROBS, sample, speculative_verify
from ernie_jax.sharding.rules import constrain


def _step(weights, input_ids, positions, cache, logit_positions, block_tables, sampling, *, cfg, plan, ex,
          batch_invariant, token_logprobs: bool = True):
    """-> (logits [B,V] at logit_positions, cache, expert token counts [L_moe,E], sampled).

    sampling: (temperature, top_p, top_k, seeds, steps), each [B]; `sampled` is sampling.sample's result for
    them without min-p, penalties or logprob alternatives: most batches need nothing more (plain_sampling),
    and sampling inside the step saves launching a second program per step. Other batches sample the
    returned logits."""
    out = _gathered(forward(weights, cfg, input_ids, positions, cache, logit_positions, plan, block_tables,
                            batch_invariant, ex, _real_tokens(logit_positions, input_ids.shape)), plan)
    counts = _expert_counts(out.expert_ids, logit_positions, input_ids.shape, cfg)
    return out.logits, out.cache, counts, sample(out.logits, *sampling, token_logprobs=token_logprobs)


def _multi_step(weights, input_ids, positions, cache, logit_positions, block_tables, sampling, *, cfg, plan, ex,
                batch_invariant, n):
    """n decode steps in one program (multi-step decode): each step is `_step` on the token the one before it
    sampled, one position on, its sampling step one on; the host reads the n tokens at the end. Every row
    samples plainly (`Request.speculates`: none asks for logprobs, so they are not computed), so what _step
    samples is what each row takes, and the tokens are those of n single steps. The rows hold the pages of
    the n positions already (Scheduler._decode_steps). -> (the last step's logits, cache, the steps' summed
    expert counts, sampled with each leaf [B, n, ...])."""
    temperature, top_p, top_k, seeds, steps = sampling

    def one(carry, _):
        ids, pos, cache, steps, _ = carry
        logits, cache, counts, sampled = _step(weights, ids, pos, cache, logit_positions, block_tables,
                                               (temperature, top_p, top_k, seeds, steps), cfg=cfg, plan=plan,
                                               ex=ex, batch_invariant=batch_invariant, token_logprobs=False)
        return (sampled[0][:, None], pos + 1, cache, steps + 1, logits), (counts, sampled)

    no_logits = jnp.zeros((input_ids.shape[0], cfg.vocab_size), jnp.float32)
    (*_, cache, _, logits), (counts, sampled) = lax.scan(one, (input_ids, positions, cache, steps, no_logits),
                                                          length=n)
    return logits, cache, counts.sum(axis=0), jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), sampled)


def _gathered(out, plan):
    """The forward's output with its logits whole on every device (they leave the step replicated anyway), so
    the sampler runs on each device as on one: partitioned over a vocabulary split, its sort, cumulative sum
    and draws took a dozen collectives a step, and at XLA:CPU's lowest optimisation level a sampled step on
    four devices took 0.75 s against 10 ms greedy."""
    if plan is None:
        return out
    lead = (None,) * (out.logits.ndim - 1)
    # pinned as the LM head computes them first: a lone replicated constraint propagates back into the head,
    # which then gathers its vocabulary-split weight instead of the logits
    split = constrain(out.logits, plan, lead + ("vocab",))
    return out._replace(logits=constrain(split, plan, lead + (None,)))


def _spec_prefill_step(weights, input_ids, positions, cache, logit_positions, block_tables, next_tokens, sampling,
                       *, cfg, plan, ex, batch_invariant, k):
    """_step that also runs the MTP block over the chunk (writing its KV) and drafts k tokens after each
    row's last real token. next_tokens [B]: the prompt token after the chunk, or -1 when the chunk ends the
    prompt (then it is the token sampled here). -> _step's outputs and drafts [B,k]."""
    out = _gathered(forward(weights, cfg, input_ids, positions, cache, logit_positions, plan, block_tables,
                            batch_invariant, ex, _real_tokens(logit_positions, input_ids.shape)), plan)
    counts = _expert_counts(out.expert_ids, logit_positions, input_ids.shape, cfg)
    sampled = sample(out.logits, *sampling)
    B = input_ids.shape[0]
    last = jnp.maximum(logit_positions, 0)
    following = jnp.where(next_tokens >= 0, next_tokens, sampled[0])
    next_ids = jnp.concatenate([input_ids[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    next_ids = next_ids.at[jnp.arange(B), last].set(following)  # x_{t+1} for every position t of the chunk
    drafts, cache = mtp_draft(weights, cfg, next_ids, out.hidden, positions, out.cache, block_tables, last, k, plan, ex)
    return out.logits, cache, counts, sampled, drafts


@functools.partial(jax.jit, static_argnums=1)
def _chain_decode(tokens, batch: int):
    return tokens.reshape(batch, 1)


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
    out = _gathered(forward(weights, cfg, input_ids, positions, cache, None, plan, block_tables, batch_invariant, ex),
                    plan)
    counts = _expert_counts(out.expert_ids, logit_positions, input_ids.shape, cfg)
    tokens, accepted = speculative_verify(out.logits, input_ids[:, 1:], *sampling, max_accept)
    drafts, cache = mtp_draft(weights, cfg, tokens, out.hidden, positions, out.cache, block_tables, accepted, k, plan,
                              ex)
    return out.logits[:, 0], cache, counts, (tokens, accepted), drafts


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


def _real_tokens(logit_positions, shape) -> jax.Array:
    """[B,T] bool: a row's tokens up to its logit position, its last real token (the rest of a prefill chunk is
    padding, and padding rows of a batch carry logit position -1)."""
    return jnp.arange(shape[1])[None, :] <= logit_positions[:, None]


def _expert_counts(expert_ids, logit_positions, shape, cfg) -> jax.Array:
    """Tokens routed to each expert of each MoE layer, counting only real tokens (_real_tokens)."""
    valid = _real_tokens(logit_positions, shape).reshape(-1).astype(jnp.int32)
    if not expert_ids:
        return jnp.zeros((0, cfg.moe_num_experts), jnp.int32)
    ids = jnp.concatenate(expert_ids)  # [L_moe, B*T, k]
    w = jnp.broadcast_to(valid[None, :, None], ids.shape)
    return jax.vmap(lambda i, v: jnp.bincount(i.reshape(-1), v.reshape(-1), length=cfg.moe_num_experts))(ids, w)


def step_program(cfg, plan, ex, weight_shardings, cache_shardings, replicated, batch_invariant: bool = False,
                 kind: str = "step", k: int = 0):
    """The jitted step with explicit shardings and the cache donated: what every ModelPrograms bucket
    compiles, and what `python -m ernie_jax.plan` compiles from shapes. kind: "step" (_step), "multi" (k
    decode steps, _multi_step), "score" (_score_step), "spec_prefill" / "verify" (speculative decoding with
    k MTP drafts)."""
    static = dict(cfg=cfg, plan=plan, ex=ex, batch_invariant=batch_invariant)
    fn = {"step": functools.partial(_step, **static),
          "multi": functools.partial(_multi_step, **static, n=k),
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

