"""The ERNIE-4.5 forward pass as pure functions over the weights pytree (see weights.py).

`forward` runs embedding -> decoder segments -> final norm -> LM head; each segment (a run of dense or of
MoE layers) goes through ops/layer_loop.run_layers, whatever the layout of its weights.
`mtp_forward` runs the multi-token-prediction block (docs/model.md §5).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ernie_jax.config import ErnieConfig
from ernie_jax.model import kv_cache as kvc
from ernie_jax.model.layers import attention, linear, moe, paged_attention, rms_norm, rope, rope_table, swiglu
from ernie_jax.ops.dense_matmul import dense_matmul
from ernie_jax.ops.execution import REFERENCE, ExecutionConfig
from ernie_jax.ops.layer_loop import run_layers
from ernie_jax.sharding.fused import fused_groups, fused_parts, split_fused
from ernie_jax.sharding.rules import HIDDEN, KV_HEADS, Q_HEADS, ShardingPlan, constrain


class ForwardOutput(NamedTuple):
    logits: jax.Array  # [B,T,V] f32, or [B,V] when logit_positions is given
    hidden: jax.Array  # [B,T,H] final-normed hidden states (what FastDeploy feeds the MTP block)
    cache: kvc.KVCache | None
    expert_ids: tuple[jax.Array, ...]  # per MoE segment [L, B*T, k]


def rope_cache(cfg: ErnieConfig, max_len: int) -> jax.Array:
    """[max_len, 2, D/2] f32: the cos and sin of every position's rotary angles. The engine's programs carry
    it beside the weights (weights["rope_cache"]) and look positions up in it: evaluated in the step, XLA
    fuses the cos/sin into each layer's q and k rotations and recomputes them per head per layer."""
    cos, sin = rope_table(jnp.arange(max_len, dtype=jnp.int32)[None], cfg.head_dim, cfg.rope_theta,
                          cfg.compression_ratio)
    return jnp.stack([cos[0], sin[0]], axis=1)


def rotary_table(cfg: ErnieConfig, positions: jax.Array, cache: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B,T,D/2] at positions [B,T], from `cache` (rope_cache) when given."""
    if cache is None:
        return rope_table(positions, cfg.head_dim, cfg.rope_theta, cfg.compression_ratio)
    cs = jnp.take(cache, positions, axis=0, mode="clip")  # padding positions (-1) read row 0, masked later
    return cs[:, :, 0], cs[:, :, 1]


def attention_block(x, w, cfg: ErnieConfig, positions, seg_cache=None, layer=None, block_tables=None, plan=None,
                    rotary=None, ex: ExecutionConfig = REFERENCE):
    """x [B,T,H] -> ([B,T,H], the segment's cache with this layer's new slots written, or None).
    rotary: rotary_table(cfg, positions), when the caller shares one table between layers."""
    B, T, _ = x.shape
    rotary = rotary_table(cfg, positions) if rotary is None else rotary
    qkv = linear(x, w["qkv"], ex, plan, "qkv")
    # [Q|K|V], laid out per tensor shard under a plan (sharding/fused.py)
    parts, _ = fused_parts(cfg, "qkv", qkv.shape[-1])
    q, k, v = split_fused(qkv, parts, fused_groups(plan, cfg, "qkv", w["qkv"]))
    q = rope(q.reshape(B, T, cfg.num_attention_heads, cfg.head_dim), rotary)
    k = rope(k.reshape(B, T, cfg.num_key_value_heads, cfg.head_dim), rotary)
    v = v.reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
    q, k, v = constrain(q, plan, Q_HEADS), constrain(k, plan, KV_HEADS), constrain(v, plan, KV_HEADS)
    if seg_cache is None:
        out = attention(q, k, v, positions, positions)
    else:
        seg_cache = kvc.write(seg_cache, layer, k, v, positions, block_tables, (w.get("k_scale"), w.get("v_scale")))
        pool, tables = kvc.layer_pages(seg_cache, layer, block_tables)  # read in place, not sliced out
        scale = pool if "k_scale" in seg_cache else (lambda n: None)
        out = paged_attention(q, pool("k"), pool("v"), scale("k_scale"), scale("v_scale"), tables, positions, ex,
                              plan, constrain=lambda x: constrain(x, plan, KV_HEADS))
    return linear(out, w["o"], ex, plan, "o"), seg_cache


def decoder_layer(h, w, kind: str, cfg: ErnieConfig, positions, seg_cache=None, layer=None, block_tables=None,
                  plan=None, batch_invariant: bool = False, rotary=None, ex: ExecutionConfig = REFERENCE, real=None):
    """Pre-norm residual block. Returns (h, seg_cache, expert ids or None). real: forward's real_tokens."""
    with jax.named_scope("attention"):
        a, seg_cache = attention_block(rms_norm(h, w["input_norm"], cfg.rms_norm_eps), w, cfg, positions,
                                       seg_cache, layer, block_tables, plan, rotary, ex)
    h = h + a
    x = rms_norm(h, w["post_norm"], cfg.rms_norm_eps)
    if kind == "dense":
        with jax.named_scope("mlp"):
            y, ids = swiglu(x, w["up_gate"], w["down"], ex, plan), None
    else:
        with jax.named_scope("moe"):
            y, ids = moe(x, w, cfg, ex, plan, batch_invariant, None if real is None else real.reshape(-1))
    return constrain(h + y, plan, HIDDEN), seg_cache, ids


def _segment_layer(carry, w, layer, positions, rotary, block_tables, *, kind, cfg, plan, batch_invariant, ex,
                   real=None):
    """decoder_layer as ops/layer_loop.run_layers steps it: ((h, segment cache), w, layer index) ->
    ((h, segment cache), expert ids or None)."""
    h, seg_cache = carry
    h, seg_cache, ids = decoder_layer(h, w, kind, cfg, positions, seg_cache, layer, block_tables, plan,
                                      batch_invariant, rotary, ex, real)
    return (h, seg_cache), ids


def lm_head(weights, h: jax.Array, ex: ExecutionConfig = REFERENCE, plan: ShardingPlan | None = None) -> jax.Array:
    """f32 logits; a tied head multiplies by the embedding [V, H] transposed. Under a mesh the reference einsum,
    which GSPMD partitions."""
    mm = ex.matmuls if plan is None else REFERENCE.matmuls
    if "lm_head" in weights and weights["lm_head"] is not None:
        return dense_matmul(h, weights["lm_head"], implementation=mm.dense, max_rows=mm.matvec_max_rows)
    return dense_matmul(h, weights["embed"], transposed=True, implementation=mm.dense, max_rows=mm.matvec_max_rows)


def forward(weights: dict[str, Any], cfg: ErnieConfig, input_ids: jax.Array, positions: jax.Array | None = None,
            cache: kvc.KVCache | None = None, logit_positions: jax.Array | None = None,
            plan: ShardingPlan | None = None, block_tables: jax.Array | None = None,
            batch_invariant: bool = False, ex: ExecutionConfig = REFERENCE, real_tokens: jax.Array | None = None
            ) -> ForwardOutput:
    """input_ids [B,T] int; positions [B,T] (default 0..T-1); with `cache`, K/V are written at `positions`
    through `block_tables` [B,n] (default: row b owns page b, a contiguous cache), and attention reads every
    filled slot, which is how incremental decoding works.
    `logit_positions` [B]: compute logits only at these token indices (e.g. the last prompt token).
    `plan`: run sharded on plan.mesh (weights and cache placed by the same plan); None runs unsharded.
    `batch_invariant`: a row's result must not depend on the other rows (ops/routed_experts/capacity.py).
    `ex`: which implementation each op runs (ops/execution.py; default: the XLA references).
    `real_tokens` [B,T] bool: which tokens are real (None: all). A padding token's routed experts are skipped,
    which changes only its own hidden state and KV slots: no real token reads them.
    A segment's weights are either stacked [L, ...] (one lax.scan) or a list of per-layer pytrees
    (weights.cpu_layout; the layers are unrolled)."""
    B, T = input_ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if cache is not None and block_tables is None:
        block_tables = kvc.identity_block_tables(B)
    h = constrain(weights["embed"][input_ids], plan, HIDDEN)
    rotary = rotary_table(cfg, positions, weights.get("rope_cache"))
    new_segments, expert_ids = [], []
    for s, seg in enumerate(cfg.layer_segments()):
        seg_cache = None if cache is None else cache.segment(s)
        layer = functools.partial(_segment_layer, kind=seg.kind, cfg=cfg, plan=plan, batch_invariant=batch_invariant,
                                  ex=ex, real=real_tokens)
        (h, seg_cache), ids = run_layers(layer, (h, seg_cache), weights["segments"][s], seg.count, positions, rotary,
                                         block_tables)
        new_segments.append(seg_cache)
        if ids is not None:
            expert_ids.append(ids)
    hidden = rms_norm(h, weights["final_norm"], cfg.rms_norm_eps)
    head_in = hidden if logit_positions is None else hidden[jnp.arange(B), logit_positions]
    logits = lm_head(weights, head_in, ex, plan)
    if cache is not None:  # segments past the decoder's (the MTP block's) pass through
        new_segments += [cache.segment(s) for s in range(len(new_segments), cache.num_segments)]
    new_cache = None if cache is None else kvc.KVCache.from_segments(new_segments)
    return ForwardOutput(logits, hidden, new_cache, tuple(expert_ids))


@jax.named_scope("mtp")
def _mtp_states(weights, cfg: ErnieConfig, next_ids, hidden, positions, seg_cache=None, block_tables=None,
                plan: ShardingPlan | None = None, ex: ExecutionConfig = REFERENCE):
    """The MTP block up to the shared final norm (spec section 5.1): final_norm(DecoderLayer(proj([norm(e) ;
    norm(h)]))) [B,T,H], and its segment of a paged cache with these positions' KV written (or None)."""
    m = weights["mtp"]
    e = weights["embed"][next_ids].astype(hidden.dtype)
    z = jnp.concatenate([rms_norm(e, m["emb_norm"], cfg.rms_norm_eps),
                         rms_norm(hidden, m["hidden_norm"], cfg.rms_norm_eps)], axis=-1)
    u = linear(z, m["proj"], ex)
    u, seg_cache, _ = decoder_layer(u, m["layer"], "dense", cfg, positions, seg_cache,
                                    None if seg_cache is None else jnp.int32(0), block_tables, plan=plan, ex=ex)
    return rms_norm(u, weights["final_norm"], cfg.rms_norm_eps), seg_cache


def mtp_forward(weights: dict[str, Any], cfg: ErnieConfig, next_ids: jax.Array, hidden: jax.Array,
                positions: jax.Array, ex: ExecutionConfig = REFERENCE, plan: ShardingPlan | None = None
                ) -> jax.Array:
    """MTP logits for token t+2 from (x_{t+1}, h_t).

    next_ids [B,T] are the tokens x_{t+1}; hidden [B,T,H] the main model's final-normed states h_t;
    positions [B,T] the positions t. The block attends causally over these T inputs (no cache).
    `plan`: the plan the weights were placed by (None: unsharded).
    """
    states, _ = _mtp_states(weights, cfg, next_ids, hidden, positions, plan=plan, ex=ex)
    return lm_head(weights, states, ex, plan)


def mtp_draft(weights: dict[str, Any], cfg: ErnieConfig, next_ids: jax.Array, hidden: jax.Array,
              positions: jax.Array, cache: kvc.KVCache, block_tables: jax.Array, at: jax.Array, steps: int,
              plan: ShardingPlan | None = None, ex: ExecutionConfig = REFERENCE
              ) -> tuple[jax.Array, kvc.KVCache]:
    """Draft tokens from the MTP block over the paged cache's last segment (KVCache.create(mtp=True)).

    The block reads (x_{t+1}, h_t) for the T inputs [B,T] at positions [B,T], writing their MTP KV; at
    index at[b] (the last accepted position) its argmax drafts the token after x_{t+1}. steps > 1 chains
    the one layer on its own output (its normed state as h, the draft as x), one position further each
    time, as vLLM runs DeepSeek's MTP for k > 1. Returns (drafts [B,steps] int32, cache)."""
    B = next_ids.shape[0]
    s = cache.num_segments - 1
    rows = jnp.arange(B)
    states, seg = _mtp_states(weights, cfg, next_ids, hidden, positions, cache.segment(s), block_tables, plan, ex)
    state, position = states[rows, at][:, None], positions[rows, at][:, None]
    drafts = []
    for i in range(steps):
        if i:
            state, seg = _mtp_states(weights, cfg, drafts[-1][:, None], state, position, seg, block_tables, plan, ex)
        drafts.append(jnp.argmax(lm_head(weights, state[:, 0], ex, plan), axis=-1).astype(jnp.int32))
        position = position + 1
    segments = [cache.segment(i) for i in range(s)] + [seg]
    return jnp.stack(drafts, axis=1), kvc.KVCache.from_segments(segments)


@functools.partial(jax.jit, static_argnames=("cfg", "plan", "ex"))
def forward_jit(weights, cfg, input_ids, positions=None, logit_positions=None, plan=None, ex=REFERENCE
                ) -> ForwardOutput:
    return forward(weights, cfg, input_ids, positions, None, logit_positions, plan, ex=ex)


@functools.partial(jax.jit, static_argnames=("cfg", "plan", "ex"), donate_argnames=("cache",))
def forward_cached_jit(weights, cfg, input_ids, positions, cache, logit_positions=None, plan=None,
                       block_tables=None, ex=REFERENCE) -> ForwardOutput:
    out = forward(weights, cfg, input_ids, positions, cache, logit_positions, plan, block_tables, ex=ex)
    if plan is not None:  # the cache leaves as it came in, sharded by KV heads
        out = out._replace(cache=jax.tree.map(lax.with_sharding_constraint, out.cache, out.cache.shardings(plan)))
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "ex", "plan"))
def mtp_forward_jit(weights, cfg, next_ids, hidden, positions, ex=REFERENCE, plan=None):
    return mtp_forward(weights, cfg, next_ids, hidden, positions, ex, plan)
