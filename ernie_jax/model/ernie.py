"""`ErnieForCausalLM`: the Flax NNX module that holds ERNIE-4.5 weights and runs the forward pass.

The module is a thin stateful shell: its `nnx.Param`s mirror the weights pytree of weights.py one to one,
and every method calls the pure, jitted functions of forward.py on `self.weights()`. Serving code takes
`weights()` once and jits its own programs over the plain pytree (no per-call NNX graph traversal).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ernie_jax import ops
from ernie_jax.config import ErnieConfig
from ernie_jax.model import forward as fwd
from ernie_jax.model.kv_cache import KV_CACHE_DTYPES, KVCache
from ernie_jax.model.weights import init_weights
from ernie_jax.ops.execution import ExecutionConfig
from ernie_jax.ops.selfcheck import execution_for


def _to_nnx(tree):
    if isinstance(tree, dict):
        return nnx.Dict({k: _to_nnx(v) for k, v in tree.items()})
    if isinstance(tree, (list, tuple)):
        return nnx.List([_to_nnx(v) for v in tree])
    return nnx.Param(tree)


def _to_pure(tree):
    """nnx.to_pure_dict turns lists into int-keyed dicts; give them back their list form."""
    if isinstance(tree, dict):
        if tree and all(isinstance(k, int) for k in tree):
            return [_to_pure(tree[i]) for i in range(len(tree))]
        return {k: _to_pure(v) for k, v in tree.items()}
    return tree


class ErnieForCausalLM(nnx.Module):
    """ERNIE-4.5 MoE causal LM (300B-A47B, 21B-A3B or any config), optionally with its MTP block.

    >>> model = ErnieForCausalLM(ErnieConfig.preset("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)
    >>> logits = model(jnp.array([[1, 5, 9]]))          # [1, 3, V] f32
    """

    def __init__(self, config: ErnieConfig, weights: dict[str, Any] | None = None, *, dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None, execution: ExecutionConfig | None = None):
        """execution: which implementation each op runs (ops/execution.py); default: chosen for the default
        device (kernels self-checked there). Part of every compiled program's cache key."""
        if weights is None:
            seed = int(jax.random.key_data(rngs.params()).ravel()[-1]) if rngs is not None else 0
            weights = init_weights(config, seed, dtype)
        self.config = config
        self.plan = None  # a ShardingPlan once placed on a mesh (see shard())
        self.execution = execution or execution_for(jax.devices()[0])
        self.embed = nnx.Param(weights["embed"])
        self.segments = _to_nnx(weights["segments"])
        self.final_norm = nnx.Param(weights["final_norm"])
        self.lm_head = nnx.Param(weights["lm_head"]) if "lm_head" in weights else None
        self.mtp = _to_nnx(weights["mtp"]) if "mtp" in weights else None

    def weights(self) -> dict[str, Any]:
        """The plain weights pytree (same structure as weights.weight_shapes) as the programs read it: on a
        mesh, fused columns are in the plan's layout (sharding/fused.py)."""
        return _to_pure(nnx.to_pure_dict(nnx.state(self, nnx.Param)))

    def checkpoint_weights(self) -> dict[str, Any]:
        """The weights pytree in the checkpoint's layout (fused columns as [Q|K|V] and [gate|up], each routed
        expert once, in its own slot)."""
        if self.plan is None:
            return self.weights()
        from ernie_jax.sharding.eplb import checkpoint_leaves
        from ernie_jax.sharding.fused import relayout_fused
        return checkpoint_leaves(relayout_fused(self.weights(), self.plan, self.config, to_groups=False))

    @property
    def dtype(self):
        return self.embed[...].dtype

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Full forward: input_ids [B,T] -> logits [B,T,V] (f32)."""
        return self.forward(input_ids, positions).logits

    def forward(self, input_ids, positions=None, cache: KVCache | None = None, logit_positions=None,
                block_tables=None) -> fwd.ForwardOutput:
        """Forward with optional KV cache (incremental decoding). The cache argument is donated.
        block_tables [B,n]: the pages of each row in a paged cache (default: row b owns page b)."""
        input_ids = jnp.asarray(input_ids, jnp.int32)
        if cache is None:
            return fwd.forward_jit(self.weights(), self.config, input_ids, positions, logit_positions, self.plan,
                                   self.execution)
        if positions is None:
            raise ValueError("forward with a cache needs explicit positions [B,T]")
        return fwd.forward_cached_jit(self.weights(), self.config, input_ids, jnp.asarray(positions, jnp.int32),
                                      cache, logit_positions, self.plan, block_tables, self.execution)

    def init_cache(self, batch: int, max_len: int, kv_cache_dtype: str = "auto") -> KVCache:
        """kv_cache_dtype: "auto" (the model dtype), "bfloat16", "float32" or "fp8" (see kv_cache.py).
        On a sharded model the cache is sharded by the same plan (KV heads over the tensor axis)."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: expected one of {sorted(KV_CACHE_DTYPES)}")
        cache = KVCache.create(self.config, batch, max_len, KV_CACHE_DTYPES[kv_cache_dtype] or self.dtype)
        return cache if self.plan is None else jax.device_put(cache, cache.shardings(self.plan))

    def device_bytes(self) -> dict[str, int]:
        """Parameter bytes resident on each device."""
        from ernie_jax.sharding.placement import device_bytes
        return device_bytes(self.weights())

    def shard(self, plan) -> "ErnieForCausalLM":
        """This model with every weight placed on plan.mesh by plan's rules (a new module; self unchanged)."""
        return ErnieForCausalLM.from_host(self.config, self.checkpoint_weights(), self.dtype, plan, self.execution)

    @classmethod
    def from_host(cls, config: ErnieConfig, weights: dict[str, Any], dtype, plan=None,
                  execution: ExecutionConfig | None = None, kernels: str = "auto", expert_placement=None
                  ) -> "ErnieForCausalLM":
        """A model whose weights (host arrays or device arrays, in the checkpoint's layout: a placed model's
        `checkpoint_weights()`, not its `weights()`) go onto the default device (plan None) or onto plan.mesh
        by plan's rules, each tensor straight onto its shards (sharding.placement).
        execution: the ops' implementations (default: chosen for the target devices with `kernels`,
        "auto" | "pallas" | "xla"). When FP8 kernels are in use, block-FP8 matrices are stored K-major, as
        their MMAs read them.
        expert_placement: redundant experts (sharding/eplb.Placement over the MoE layers): the routed experts
        go into its physical slots, with the routing map beside them; needs expert parallelism."""
        device = jax.devices()[0] if plan is None else plan.mesh.devices.flat[0]
        if expert_placement is not None:
            from ernie_jax.sharding.eplb import expert_leaves
            ep = 1 if plan is None else plan.size_of(plan.axes_of("experts"))
            if ep != expert_placement.num_devices:
                raise ValueError(f"redundant experts are placed over {expert_placement.num_devices} expert-parallel "
                                 f"devices, but the mesh splits experts {ep} ways" +
                                 ("" if ep > 1 else ": EPLB needs expert parallelism (--mesh with the experts "
                                                    "split over several devices)"))
            moe = [i for i, seg in enumerate(config.layer_segments()) if seg.kind == "moe"]
            weights = expert_leaves(weights, expert_placement, moe)
        execution = execution or execution_for(device, kernels)
        if execution.kernel_layout:
            weights = ops.kernel_layout(weights)
        if plan is None or plan.mesh.size == 1:  # one device is the unsharded path, with its layouts and forms
            weights = jax.tree.map(lambda a: jax.device_put(a, device), weights)
            return cls(config, weights, dtype=dtype, execution=execution)
        from ernie_jax.sharding.fused import fit_plan
        from ernie_jax.sharding.placement import shard_weights
        plan = fit_plan(plan, config, weights)  # blocks whose heads or FP8 blocks do not split: replicated
        model = cls(config, shard_weights(weights, plan, config), dtype=dtype, execution=execution)
        model.plan = plan
        return model

    def mtp_logits(self, input_ids: jax.Array) -> jax.Array:
        """MTP logits [B,T-1,V]: row t predicts token t+2 from token t+1 and the main model's state at t."""
        if self.mtp is None:
            raise ValueError("this model has no MTP block (num_nextn_predict_layers = 0 or weights not loaded)")
        input_ids = jnp.asarray(input_ids, jnp.int32)
        out = self.forward(input_ids)
        B, T = input_ids.shape
        positions = jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32), (B, T - 1))
        return fwd.mtp_forward_jit(self.weights(), self.config, input_ids[:, 1:], out.hidden[:, :-1], positions,
                                   self.execution, self.plan)
