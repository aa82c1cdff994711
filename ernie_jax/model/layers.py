"""Pure building blocks of the ERNIE-4.5 forward pass: norm, rotary embedding, attention, SwiGLU, MoE.

Every function takes arrays (and the static config) and returns arrays, so the same code runs eagerly,
under jit, and inside shard_map. The numerics follow ERNIE45_SPEC.md section 2: fp32 norm statistics,
interleaved (GPT-J style) RoPE computed in fp32, fp32 attention softmax, an fp32 router whose correction
bias only steers selection, renormalised top-k weights and a dropless expert computation.
Glossary: B batch, T tokens, S key slots, H hidden, N query heads, K KV heads, R = N/K, D head dim,
E experts, F FFN width, k experts per token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ernie_jax.config import ErnieConfig
from ernie_jax import pallas as kernels
from ernie_jax.model import kv_cache
from ernie_jax.quant import BlockFP8, fp8_linear, fp8_ragged_dot
from ernie_jax.sharding.linear import fp8_linear_sharded

_NEG_INF = -1e30


def linear(x: jax.Array, w, plan=None, leaf: str | None = None) -> jax.Array:
    """y = x @ w with w in the Paddle [in, out] orientation; the one place matmul numerics are chosen.
    `plan`: the ShardingPlan when x and w are GSPMD-sharded, with `leaf` the weights-pytree name that says
    how w is split (block-FP8 weights then run the kernel per device, sharding/linear.py); None for
    unsharded code and inside shard_map."""
    if isinstance(w, BlockFP8):
        if w.compute == "w8a8" and w.values.ndim == 2:
            if plan is None and kernels.use_kernels():
                y = kernels.block_fp8_matmul(x.reshape(-1, x.shape[-1]), w.values, w.scales, k_major=w.k_major)
                return y.reshape(*x.shape[:-1], y.shape[-1])
            if plan is not None and leaf is not None:
                y = fp8_linear_sharded(x, w, plan, leaf)
                if y is not None:
                    return y
        return fp8_linear(x, w)
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


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


PAGED_BLOCK_SLOTS = 64  # key slots per step of paged_attention_blocks


def paged_attention_blocks(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, k_scale, v_scale,
                           tables: jax.Array, positions: jax.Array, constrain=lambda x: x,
                           one_block: bool = False) -> jax.Array:
    """`attention` over a paged KV cache, reading only the pages the batch's positions reach.

    q [B,T,N,D] at positions [B,T] (-1: padding); k_pool, v_pool [P,page,K,D] (fp8 with scales k_scale,
    v_scale [P,page,K], or None); tables [B,n]: slot j of row b is page tables[b, j // page]. Returns
    [B,T,N*D] in q's dtype. The loop walks blocks of PAGED_BLOCK_SLOTS slots with an online softmax and
    stops after the block holding the largest position, so a step costs what the sequences hold, not
    the block tables' capacity (max_model_len). Later blocks would be fully masked and change nothing,
    so a sequence's result does not depend on the others in its batch. one_block: read the whole table
    in one block, without a loop (under a mesh, where `constrain` pins each gathered block's sharding to
    the cache's KV-head layout).

    Decode (T == 1, no mesh) reads a block as it lies in the pool, [B, S, K*D], and contracts over K*D with
    each query head placed in its KV head's D columns and zeros elsewhere (block-diagonal), so each head
    scores only its own group's slots (K times the matmul work of one query row); the weighted values come
    back for every head's D columns and each query head keeps its own. Grouping the slots by head,
    [B,K,S,D], is a transposing copy of every gathered page, which cost a decode step more than the K-fold
    matmuls on XLA:CPU."""
    B, T, N, D = q.shape
    page, K = k_pool.shape[1], k_pool.shape[2]
    R = N // K
    bp = tables.shape[1] if one_block else max(1, min(tables.shape[1], PAGED_BLOCK_SLOTS // page))
    nb = -(-tables.shape[1] // bp)
    tables = jnp.pad(tables, ((0, 0), (0, nb * bp - tables.shape[1])))  # past the end: masked by position
    S = bp * page
    flat = T == 1 and not one_block
    own = jnp.arange(K)[:, None] == jnp.arange(K)  # [K (query head's group), K (columns' KV head)]
    if flat:  # [B,N,K*D]: head n = (g, r) holds q in the columns of KV head g, zeros in the others
        qg = jnp.where(own[None, :, None, :, None], q.reshape(B, K, R, 1, D), 0).reshape(B, N, K * D)
    else:
        qg = q.reshape(B, T, K, R, D)

    def gather(pool, scale, ids):  # -> [B,S,K,D] in q's dtype
        x = kv_cache.loaded(pool[ids])  # [B,bp,page,K,D]
        if scale is not None:
            x = x.astype(jnp.float32) * scale[ids][..., None]
        return constrain(x.reshape(B, S, K, D).astype(q.dtype))

    def scores(k):  # -> [B,K,R,T,S] f32
        if flat:
            return jnp.einsum("bnx,bsx->bns", qg, k.reshape(B, S, K * D),
                              preferred_element_type=jnp.float32).reshape(B, K, R, 1, S)
        return jnp.einsum("btkrd,bskd->bkrts", qg, k, preferred_element_type=jnp.float32)

    def weighted(e, v):  # e [B,K,R,T,S] -> [B,K,R,T,D] f32
        if flat:  # every KV head's values for each query head; keep the head's own group
            o = jnp.einsum("bns,bsx->bnx", e.reshape(B, N, S), v.reshape(B, S, K * D),
                           preferred_element_type=jnp.float32).reshape(B, K, R, K, D)
            return jnp.sum(jnp.where(own[None, :, None, :, None], o, 0), axis=3)[:, :, :, None]
        return jnp.einsum("bkrts,bskd->bkrtd", e, v, preferred_element_type=jnp.float32)

    def body(i, carry):
        m, denom, acc = carry  # [B,K,R,T], [B,K,R,T], [B,K,R,T,D] f32
        ids = lax.dynamic_slice_in_dim(tables, i * bp, bp, axis=1)
        k, v = gather(k_pool, k_scale, ids), gather(v_pool, v_scale, ids)
        s = scores(k) * (D ** -0.5)
        visible = (i * S + jnp.arange(S)[None, None, :] <= positions[:, :, None])[:, None, None]  # [B,1,1,T,S]
        s = jnp.where(visible, s, _NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        e = jnp.exp(s - m_new[..., None])
        return m_new, denom * alpha + jnp.sum(e, axis=-1), acc * alpha[..., None] + weighted(e.astype(v.dtype), v)

    init = (jnp.full((B, K, R, T), _NEG_INF, jnp.float32), jnp.zeros((B, K, R, T), jnp.float32),
            jnp.zeros((B, K, R, T, D), jnp.float32))
    if nb == 1:
        _, denom, acc = body(0, init)
    else:
        _, denom, acc = lax.fori_loop(0, jnp.clip(jnp.max(positions) // S + 1, 1, nb), body, init)
    o = acc / jnp.maximum(denom, 1e-30)[..., None]  # [B,K,R,T,D]
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, N * D).astype(q.dtype)


def swiglu(x: jax.Array, up_gate: jax.Array, down: jax.Array, plan=None) -> jax.Array:
    """Paddle's fused `up_gate_proj` holds [gate | up] despite its name. (Shared experts are split like the
    dense FFN, so both pass the dense leaves' names.)"""
    u = linear(x, up_gate, plan, "up_gate")
    return linear(silu_mul(*jnp.split(u, 2, axis=-1)), down, plan, "down")


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up, rounded as the reference kernels round: silu in fp32 rounded once to the activation
    dtype, then the product rounded once. (A bf16 `jax.nn.silu` would round after each of its elementwise
    ops, and XLA:CPU emulates each of those roundings, which made this the costliest elementwise op of a
    prefill.)"""
    s = jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype)
    return (s.astype(jnp.float32) * up.astype(jnp.float32)).astype(gate.dtype)


def route(x: jax.Array, router: jax.Array, bias: jax.Array, cfg: ErnieConfig) -> tuple[jax.Array, jax.Array]:
    """fp32 softmax router; the correction bias picks the experts but does not weight them.

    x [T,H] -> (weights [T,k] f32 renormalised, expert ids [T,k] int32)
    """
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    probs = jax.nn.softmax(logits, axis=-1)
    _, ids = lax.top_k(probs + bias.astype(jnp.float32), cfg.moe_k)
    w = jnp.take_along_axis(probs, ids, axis=-1)
    w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), cfg.moe_norm_min)
    return w, ids.astype(jnp.int32)


def sort_by_expert(ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Order the T*k (token, expert) assignments by expert.

    Returns (order [T*k]: assignment index at each sorted row, inverse [T*k], group_sizes [E]).
    """
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, inverse, group_sizes


def grouped_swiglu(xs: jax.Array, up_gate: jax.Array, down: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """SwiGLU experts over rows sorted by expert (ragged groups): xs [M,H], up_gate [E,H,2F], down [E,F,H]
    (or tuples of consecutive expert groups, weights.cpu_layout)."""
    up_gate, down = (jnp.concatenate(w) if isinstance(w, tuple) else w for w in (up_gate, down))
    u = _ragged_dot(xs, up_gate, group_sizes)
    return _ragged_dot(silu_mul(*jnp.split(u.astype(xs.dtype), 2, axis=-1)), down, group_sizes).astype(xs.dtype)


def _ragged_dot(x: jax.Array, w, group_sizes: jax.Array) -> jax.Array:
    if isinstance(w, BlockFP8):
        if w.compute == "w8a8" and kernels.use_kernels():
            return kernels.grouped_block_fp8_matmul(x, w.values, w.scales, group_sizes, k_major=w.k_major)
        return fp8_ragged_dot(x, w, group_sizes)
    return lax.ragged_dot(x, w.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)


# "auto" picks by backend and step size at trace time; tests set "ragged", "capacity" or "tiled" to run one.
EXPERT_IMPL = "auto"

# Rows per tile of the tiled formulation; CPU steps whose mean expert load reaches it take that formulation.
EXPERT_TILE_ROWS = 256


def expert_impl(assignments: int, num_experts: int, up_gate, batch_invariant: bool = False) -> str:
    """Which routed-expert formulation to trace for a step of `assignments` (token, expert) pairs.

    Accelerators take the grouped (ragged) matmul, whose cost follows the routed rows. XLA:CPU runs
    ragged_dot as a dense loop over every group on every row (ANCHORS P5), so CPUs take one of two forms:
    the capacity form (one batched matmul, every expert padded to the largest load) at decode sizes, and
    at prefill sizes (mean load of a tile or more) the tiled form, which pads each expert to a tile (one
    bench-512 MoE layer at 2048 tokens: 28 ms against 68 ms). Block-FP8 experts and batch-invariant steps keep the
    capacity form (a tile would dequantize its expert's weights once per tile; batch invariance is defined
    on the capacity form)."""
    if EXPERT_IMPL != "auto":
        return EXPERT_IMPL
    if jax.default_backend() != "cpu":
        return "ragged"
    tiled = (not batch_invariant and isinstance(up_gate, (jax.Array, tuple))
             and assignments >= EXPERT_TILE_ROWS * num_experts)
    return "tiled" if tiled else "capacity"


def expert_capacities(tokens: int, k: int, num_experts: int) -> list[int]:
    """The per-expert row capacities a step picks from, ascending: powers of two from the mean load (and
    from 2: XLA:CPU runs one-row matmuls through a slow f32 fallback) up to `tokens`. A token picks an
    expert at most once, so no expert gets more than `tokens` rows and the last capacity always holds every
    assignment. (Each capacity is a branch of the compiled program: finer steps would pad less but compile
    slower.)"""
    mean = max(-(-tokens * k // num_experts), 2)
    out, c = [], 1
    while c < tokens:
        if c >= mean:
            out.append(c)
        c *= 2
    return out + [tokens]


def routed_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, up_gate, down, num_experts: int,
                   first_expert: jax.Array | int = 0, batch_invariant: bool = False, impl: str = "auto") -> jax.Array:
    """The routed-expert output of the experts [first_expert, first_expert + E_local) held in up_gate/down.

    x [T,H]; weights, ids [T,k]. With every expert local this is the whole routed output; under expert
    parallelism each device adds its own experts' share (sharding/expert_parallel.py). Dropless: each
    assignment to a local expert is computed, whatever the load.
    batch_invariant: on the capacity path, always use the largest capacity, so a token's result never
    depends on how the other tokens were routed.
    impl: "auto" (expert_impl picks), or "ragged" | "capacity" | "tiled" | "sorted_tiles" chosen by the caller
    (training takes a differentiable form: the tiled loops have data-dependent trip counts, which reverse mode
    cannot run).
    """
    impl = expert_impl(ids.size, num_experts, up_gate, batch_invariant) if impl == "auto" else impl
    if impl == "sorted_tiles":
        return _sorted_tile_experts(x, weights, ids, up_gate, down, first_expert)
    if impl == "tiled":
        return _tiled_experts(x, weights, ids, up_gate, down, first_expert)
    if impl == "capacity":
        caps = expert_capacities(ids.shape[0], ids.shape[1], num_experts)
        caps = caps[-1:] if batch_invariant else caps
        run = [functools.partial(_capacity_experts, capacity=c) for c in caps]
        if len(run) == 1:
            return run[0](x, weights, ids, up_gate, down, first_expert)
        local = _num_local(up_gate)
        e, mine = _local_assignments(ids, first_expert, local)
        load = jnp.bincount(jnp.where(mine, e, local), length=local)  # local experts only
        return lax.switch(jnp.sum(jnp.asarray(caps[:-1]) < jnp.max(load)), run, x, weights, ids, up_gate, down,
                          first_expert)
    T, k = ids.shape
    local = _num_local(up_gate)
    order, inverse, sizes = sort_by_expert(ids, num_experts)
    xs = x[order // k]
    if local == num_experts:
        ys = grouped_swiglu(xs, up_gate, down, sizes)
    else:
        # The local experts' rows are contiguous in expert order: rotate them to the front, run the grouped
        # matmul on the local groups only, rotate back and zero every other expert's rows.
        start = jnp.sum(jnp.where(jnp.arange(num_experts) < first_expert, sizes, 0))
        local_sizes = lax.dynamic_slice_in_dim(sizes, first_expert, local)
        ys = jnp.roll(grouped_swiglu(jnp.roll(xs, -start, axis=0), up_gate, down, local_sizes), start, axis=0)
        row = jnp.arange(T * k)
        ys = jnp.where(((row >= start) & (row < start + jnp.sum(local_sizes)))[:, None], ys, 0)
    return _combine(ys[inverse], weights)


def _expert_groups(w) -> tuple:
    """An expert leaf as its groups of consecutive experts: a stacked [E_local, ...] leaf is one group; the
    CPU layout holds a tuple of several (weights.cpu_layout)."""
    return w if isinstance(w, tuple) else (w,)


def _num_local(w) -> int:
    return sum(g.shape[0] for g in _expert_groups(w))


def _local_assignments(ids: jax.Array, first_expert, local: int) -> tuple[jax.Array, jax.Array]:
    """ids [T,k] -> (the local expert index of each assignment [T*k], whether that expert is local)."""
    e = ids.reshape(-1) - first_expert
    return e, (e >= 0) & (e < local)


def _ranks(key: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """key [M] -> (each entry's rank among the entries of its key [M], the count of each key in [0, n) [n]).
    Keys outside [0, n) get rank 0 and are not counted."""
    hot = (key[:, None] == jnp.arange(n)).astype(jnp.int32)  # [M,n]
    return jnp.sum((jnp.cumsum(hot, axis=0) - 1) * hot, axis=-1), jnp.sum(hot, axis=0)


def _capacity_experts(x, weights, ids, up_gate, down, first_expert, *, capacity: int) -> jax.Array:
    """Routed experts as one batched matmul over the local experts, each given `capacity` row slots.

    The caller picks a capacity at least the largest local expert load, so every assignment gets a slot
    (nothing is dropped); empty slots compute on zeros. XLA:CPU runs this batched matmul straight from the
    expert weights' layout, and its cost follows the routed load rather than T*E_local.
    """
    T, k = ids.shape
    local, C = _num_local(up_gate), capacity
    e, mine = _local_assignments(ids, first_expert, local)
    rank, _ = _ranks(e, local)  # the assignment's row within its expert (0 for other devices' experts)
    slot = jnp.where(mine, e * C + rank, local * C)  # other devices' experts go to a slot past the end
    # The token in each slot (T, a zero row, for empty ones): a gather of x's rows, where scattering them
    # would make XLA:CPU scatter in f32 and hand the matmul f32 rows (and so f32 copies of the weights).
    src = jnp.full((local * C + 1,), T, jnp.int32).at[slot].set(jnp.arange(T * k, dtype=jnp.int32) // k)
    xs = jnp.take(x, src[:-1].reshape(local, C), axis=0, mode="fill", fill_value=0)  # [E_local,C,H]
    groups = list(zip(_expert_groups(up_gate), _expert_groups(down)))
    n = groups[0][0].shape[0]  # a batched matmul per group of experts
    ys = jnp.concatenate([jax.vmap(swiglu)(xs[g * n:(g + 1) * n], u, d) for g, (u, d) in enumerate(groups)])
    ys = jnp.take(ys.reshape(local * C, -1), slot, axis=0, mode="fill", fill_value=0)  # [T*k,H], 0 if not local
    return _combine(ys, weights)


def _combine(ys: jax.Array, weights: jax.Array) -> jax.Array:
    """Each token's routed output: its k assignments' rows ys [T*k,H] weighted by weights [T,k]."""
    T, k = weights.shape
    return jnp.einsum("tkh,tk->th", ys.reshape(T, k, -1), weights.astype(ys.dtype),
                      preferred_element_type=jnp.float32).astype(ys.dtype)


def _bits(x: jax.Array) -> jax.Array:
    """x viewed as unsigned integers of its width. XLA:CPU gathers, slices and updates bf16 arrays through f32
    copies of the whole operand (hoisted out of loops: a copy of every expert's weights per layer), and
    integer arrays in place."""
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _tiled_experts(x, weights, ids, up_gate, down, first_expert) -> jax.Array:
    """Routed experts over the assignments sorted by expert, EXPERT_TILE_ROWS rows at a time: one loop per
    local expert, over ceil(load / tile) tiles, so the work follows the routed load with at most one tile
    of padding per expert (the capacity form pads every expert to the largest load, then to a power of two).

    A tile that runs past its expert's rows computes the next experts' first rows with the wrong weights;
    the experts run in row order, so those rows' own expert overwrites them afterwards. Rows travel as
    integer bits (_bits says why)."""
    T, k = ids.shape
    local, BT = _num_local(up_gate), EXPERT_TILE_ROWS
    e, mine = _local_assignments(ids, first_expert, local)
    key = jnp.where(mine, e, local)  # other devices' experts sort last
    rank, sizes = _ranks(key, local + 1)
    starts = jnp.cumsum(sizes) - sizes
    row = starts[key] + rank  # [T*k]: each assignment's row in expert order (a counting sort)
    # The token of each row (T: a zero row, also for a tile running past the end).
    src = jnp.full((T * k + BT,), T, jnp.int32).at[row].set(jnp.arange(T * k, dtype=jnp.int32) // k)
    xb = _bits(x)
    xs = jnp.concatenate([xb, jnp.zeros_like(xb[:1])]).at[src].get(mode="promise_in_bounds")  # [T*k+BT,H]

    def tile(j, ys, *, i, w_up, w_down):
        r = starts[i] + j * BT
        xt = lax.bitcast_convert_type(lax.dynamic_slice_in_dim(xs, r, BT), x.dtype)
        y = swiglu(xt, w_up, w_down)
        return lax.dynamic_update_slice_in_dim(ys, _bits(y), r, 0)

    def one(w, i):  # expert i's matrix
        groups = _expert_groups(w)
        n = groups[0].shape[0]
        return lax.bitcast_convert_type(_bits(groups[i // n])[i % n], groups[0].dtype)
    ys = jnp.zeros_like(xs)
    for i in range(local):
        body = functools.partial(tile, i=i, w_up=one(up_gate, i), w_down=one(down, i))
        ys = lax.fori_loop(0, (sizes[i] + BT - 1) // BT, body, ys)
    ys = jnp.where(mine[:, None], lax.bitcast_convert_type(ys[row], x.dtype), 0)  # [T*k,H]
    return _combine(ys, weights)


SORTED_TILE_ROWS = 128  # rows per tile of the sorted-tiles form


def _sorted_tile_experts(x, weights, ids, up_gate, down, first_expert) -> jax.Array:
    """Routed experts as one batched matmul over row tiles: the assignments sorted by expert, each expert's
    rows padded to whole tiles of SORTED_TILE_ROWS, and each tile multiplied by its own expert's weights
    (gathered per tile). Static shapes whatever the routing (at most one tile of padding per expert, where the
    capacity form pads every expert to the largest load), and differentiable: the form training takes."""
    T, k = ids.shape
    local, BT = _num_local(up_gate), SORTED_TILE_ROWS
    up_gate, down = (jnp.concatenate(w) if isinstance(w, tuple) else w for w in (up_gate, down))
    e, mine = _local_assignments(ids, first_expert, local)
    key = jnp.where(mine, e, local)  # other devices' experts sort last and are not computed
    sizes = jnp.bincount(key, length=local + 1)[:local]
    padded = (sizes + BT - 1) // BT * BT
    ends = jnp.cumsum(padded)
    order = jnp.argsort(key, stable=True)  # assignment index at each sorted position
    sorted_key = key[order]
    rank = jnp.arange(T * k) - (jnp.cumsum(sizes) - sizes)[jnp.minimum(sorted_key, local - 1)]
    tiles = T * k // BT + local  # enough for any routing: sum(ceil(size / BT)) <= T*k/BT + E_local
    row = jnp.where(sorted_key < local, (ends - padded)[jnp.minimum(sorted_key, local - 1)] + rank, tiles * BT)
    src = jnp.full((tiles * BT + 1,), T, jnp.int32).at[row].set((order // k).astype(jnp.int32))[:-1]
    xs = jnp.take(x, src, axis=0, mode="fill", fill_value=0).reshape(tiles, BT, -1)
    tile_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(tiles) * BT, side="right"), local - 1)
    u = jnp.einsum("nrh,nhf->nrf", xs, up_gate[tile_expert].astype(x.dtype), preferred_element_type=jnp.float32)
    a = silu_mul(*jnp.split(u.astype(x.dtype), 2, axis=-1))
    ys = jnp.einsum("nrf,nfh->nrh", a, down[tile_expert].astype(x.dtype), preferred_element_type=jnp.float32)
    ys = ys.astype(x.dtype).reshape(tiles * BT, -1)
    at = jnp.zeros((T * k,), jnp.int32).at[order].set(row.astype(jnp.int32))  # each assignment's row
    ys = jnp.take(ys, at, axis=0, mode="fill", fill_value=0)  # other devices' experts read past the end: 0
    return _combine(ys, weights)


def moe(x: jax.Array, w: dict, cfg: ErnieConfig, batch_invariant: bool = False, expert_impl: str = "auto"
        ) -> tuple[jax.Array, jax.Array]:
    """Dropless MoE block: every (token, expert) assignment is computed, none is capped or dropped.

    x [B,T,H] -> (y [B,T,H], expert ids [B*T,k])
    """
    x2 = x.reshape(-1, x.shape[-1])
    weights, ids = route(x2, w["router"], w["router_bias"], cfg)
    y = routed_experts(x2, weights, ids, w["experts_up_gate"], w["experts_down"], cfg.moe_num_experts,
                       batch_invariant=batch_invariant, impl=expert_impl)
    return (y + shared_experts(x2, w)).reshape(x.shape), ids


def shared_experts(x: jax.Array, w: dict, plan=None) -> jax.Array | int:
    """Shared experts see every token and are added unweighted (0 when the model has none)."""
    return swiglu(x, w["shared_up_gate"], w["shared_down"], plan) if "shared_up_gate" in w else 0
