"""Pure building blocks of the ERNIE-4.5 forward pass: norm, rotary embedding, attention, SwiGLU, MoE.

Every function takes arrays (and the static config) and returns arrays, so the same code runs eagerly,
under jit, and inside shard_map. The numerics follow docs/model.md §2: fp32 norm statistics,
interleaved (GPT-J style) RoPE computed in fp32, fp32 attention softmax, an fp32 router whose correction
bias only steers selection, renormalised top-k weights and a dropless expert computation. How each op is
computed (kernels, XLA:CPU forms) is the execution config's choice (`ex`, ops/execution.py); `plan` is how the
arrays are placed (a ShardingPlan over a mesh, or None on one device), and the sharding/ functions the ops go
through decide how an op runs on that placement, so the math here has one path.
Glossary: B batch, T tokens, S key slots, H hidden, N query heads, K KV heads, R = N/K, D head dim,
E experts, F FFN width, k experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ernie_jax.config import ErnieConfig
from ernie_jax.ops import dense
from ernie_jax.ops.execution import REFERENCE, ExecutionConfig
from ernie_jax.sharding.attention import placed_paged_attention
from ernie_jax.sharding.expert_parallel import routed_moe
from ernie_jax.sharding.fused import fused_groups, fused_parts, split_fused
from ernie_jax.sharding.linear import placed_linear

_NEG_INF = -1e30


def linear(x: jax.Array, w, ex: ExecutionConfig = REFERENCE, plan=None, leaf: str | None = None) -> jax.Array:
    """y = x @ w with w in the Paddle [in, out] orientation, run as the weights are placed (sharding/linear.py;
    `leaf`, the weights-pytree name, says how w is split)."""
    return placed_linear(x, w, ex, plan, leaf)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope_table(positions: jax.Array, head_dim: int, theta: float, compression_ratio: float = 1.0
               ) -> tuple[jax.Array, jax.Array]:
    """cos and sin of each position's rotary angles p * theta^(-2i/D), each [B,T,D/2] f32 (positions [B,T]);
    one table serves every layer's q and k (forward.rotary_table)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    ang = (positions.astype(jnp.float32) / compression_ratio)[..., None] * inv_freq
    return jnp.cos(ang), jnp.sin(ang)


def rope(x: jax.Array, table: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate each adjacent pair (x[2i], x[2i+1]) by its angle in `table` (rope_table). x [B,T,*,D]."""
    cos, sin = (a[:, :, None, :] for a in table)
    xf = x.astype(jnp.float32)
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    out = jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """Causal GQA attention by position: key s is visible to query t iff 0 <= k_pos[s] <= q_pos[t].

    q [B,T,N,D]; k, v [B,S,K,D]; q_pos [B,T]; k_pos [B,S] (-1 marks an empty slot).  Returns [B,T,N*D].
    """
    B, T, N, D = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, D)
    s = jnp.einsum("btkrd,bskd->bkrts", qg, k, preferred_element_type=jnp.float32) * (D ** -0.5)
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)  # [B,T,S]
    s = jnp.where(visible[:, None, None], s, _NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkrts,bskd->btkrd", p, v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, N * D).astype(q.dtype)


def paged_attention(q, k_pool, v_pool, k_scale, v_scale, tables, positions, ex: ExecutionConfig = REFERENCE,
                    plan=None, constrain=lambda x: x) -> jax.Array:
    """`attention` over a paged KV cache (ops/paged_attention): q [B,T,N,D] at positions [B,T] -> [B,T,N*D], run as
    the pool is placed (sharding/attention.py); `constrain` pins gathered slots to the cache's head layout."""
    return placed_paged_attention(q, k_pool, v_pool, k_scale, v_scale, tables, positions, ex, plan, constrain)


def swiglu(x: jax.Array, up_gate, down, ex: ExecutionConfig = REFERENCE, plan=None) -> jax.Array:
    """Paddle's fused `up_gate_proj` holds [gate | up] despite its name; under a plan, one [gate_i | up_i]
    group per tensor shard (sharding/fused.py). (Shared experts are split like the dense FFN, so both pass
    the dense leaves' names.)"""
    u = linear(x, up_gate, ex, plan, "up_gate")
    parts, _ = fused_parts(None, "up_gate", u.shape[-1])
    gate, up = split_fused(u, parts, fused_groups(plan, None, "up_gate", up_gate))
    return linear(dense.silu_mul(gate, up), down, ex, plan, "down")


def moe(x: jax.Array, w: dict, cfg: ErnieConfig, ex: ExecutionConfig = REFERENCE, plan=None,
        batch_invariant: bool = False, valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Dropless MoE block: every (token, expert) assignment is computed, none is capped or dropped; the shared
    experts' output is summed with the routed experts' (run as the experts are placed:
    sharding/expert_parallel.py).

    x [B,T,H] -> (y [B,T,H], expert ids [B*T,k]); valid [B*T] (or None): False on padding tokens (forward's
    real_tokens), whose routed output is 0 and which no expert computes.
    """
    shared = shared_experts(x.reshape(-1, x.shape[-1]), w, ex, plan)
    y, ids = routed_moe(x, w, cfg, plan, ex, batch_invariant, None if isinstance(shared, int) else shared, valid)
    return y.reshape(x.shape), ids


def shared_experts(x: jax.Array, w: dict, ex: ExecutionConfig = REFERENCE, plan=None) -> jax.Array | int:
    """Shared experts see every token and are added unweighted (0 when the model has none); under a plan
    they are sharded by the rules like any dense FFN."""
    return swiglu(x, w["shared_up_gate"], w["shared_down"], ex, plan) if "shared_up_gate" in w else 0
