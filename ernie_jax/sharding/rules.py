"""Logical axis names for every weight and activation, and the one table that maps them to mesh axes.

`LEAF_AXES` names the axes of each weights-pytree leaf (weights.py); `ShardingPlan(mesh, rules)` turns a
leaf's logical axes into a PartitionSpec. A logical axis maps to a tuple of mesh axes; a dimension that
the mapped axes do not divide evenly is replicated instead (e.g. 2 KV heads on a tensor axis of 8), except
"experts", whose split is required and checked. A rules table that would use one mesh axis twice in a
spec is rejected.

Presets:
- "tp_ep" (default): attention heads and vocabulary over "tensor"; experts over "expert" x "tensor";
  batch over "data". On 8 devices (data=1, expert=1, tensor=8): TP8 attention + EP8 experts.
- "tp": attention heads and vocabulary over "expert" x "tensor" (one TP group of all model-parallel
  devices); experts over the same devices.
- "dp_attn_ep": attention, dense FFN and vocabulary replicated, batch over "data"; experts over all
  three axes (tokens are gathered into the MoE block and scattered back).
Dense FFNs (and shared experts) are split over "tensor" by width: `up_gate` by its fused [gate|up] output
columns, `down` by its input rows. A model whose attention or dense FFNs cannot split into whole heads and
scale blocks per device has that block replicated instead (fused.fit_plan, `ShardingPlan.without`). Weights placed by a plan with `fused_layout` (the default) hold their
fused [Q|K|V] and [gate|up] columns in one group per tensor shard (fused.py), so attention and the SwiGLU
activation need no collective; "dp_attn_ep" replicates the dense FFNs instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ernie_jax.quant import BlockFP8, IntWeight, is_quantized
from ernie_jax.sharding.mesh import mesh_sizes


class ShardingError(ValueError):
    """A model, mesh and rules table that do not fit together; the message says which dimension."""


# Logical axes of each leaf without its leading stacked-layer axis (which is never sharded).
LEAF_AXES: dict[str, tuple] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("norm",), "input_norm": ("norm",), "post_norm": ("norm",),
    "emb_norm": ("norm",), "hidden_norm": ("norm",),
    "qkv": ("embed", "qkv"),
    "o": ("heads", "embed"),
    "up_gate": ("embed", "mlp"), "down": ("mlp", "embed"),
    "shared_up_gate": ("embed", "mlp"), "shared_down": ("mlp", "embed"),
    "router": ("embed", None), "router_bias": (None,),
    "experts_up_gate": ("experts", "embed", None), "experts_down": ("experts", None, "embed"),
    "expert_slots": (None, None), "expert_replicas": (None,),  # EPLB's routing map (sharding/eplb.py)
    "k_scale": ("kv_heads",), "v_scale": ("kv_heads",),
    "proj": ("embed", None),
}
# Activations.
HIDDEN = ("batch", None, "embed")  # [B,T,H]
Q_HEADS = ("batch", None, "q_heads", None)  # [B,T,N,D]
KV_HEADS = ("batch", None, "kv_heads", None)  # [B,T,K,D] and cache slots [B,S,K,D]

_MODEL = ("expert", "tensor")
PRESETS: dict[str, dict[str, tuple]] = {
    "tp_ep": {"batch": ("data",), "vocab": ("tensor",), "qkv": ("tensor",), "heads": ("tensor",),
              "q_heads": ("tensor",), "kv_heads": ("tensor",), "mlp": ("tensor",), "experts": _MODEL},
    "tp": {"batch": ("data",), "vocab": _MODEL, "qkv": _MODEL, "heads": _MODEL, "q_heads": _MODEL,
           "kv_heads": _MODEL, "mlp": _MODEL, "experts": _MODEL},
    "dp_attn_ep": {"batch": ("data",), "experts": ("data", "expert", "tensor")},
}


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """A mesh plus a rules table (logical axis -> mesh axes). Hashable: it is a static jit argument."""

    mesh: Mesh
    rules: tuple[tuple[str, tuple[str, ...]], ...]
    # Weights placed by this plan hold fused columns in one group per tensor shard (fused.py). Training keeps
    # the checkpoint layout (False): its parameters and optimizer state are saved as they are.
    fused_layout: bool = True

    @classmethod
    def create(cls, mesh: Mesh, rules: str | dict[str, tuple] = "tp_ep", fused_layout: bool = True
               ) -> "ShardingPlan":
        if isinstance(rules, str):
            if rules not in PRESETS:
                raise ShardingError(f"unknown sharding preset {rules!r}; known: {sorted(PRESETS)}")
            rules = PRESETS[rules]
        table = {k: (v,) if isinstance(v, str) else tuple(v or ()) for k, v in rules.items()}
        for logical, axes in table.items():
            unknown = set(axes) - set(mesh.axis_names)
            if unknown:
                raise ShardingError(f"rule {logical!r} -> {axes} names axes not in the mesh {mesh.axis_names}")
        for leaf, logical in list(LEAF_AXES.items()) + [("hidden", HIDDEN), ("q", Q_HEADS), ("kv", KV_HEADS)]:
            used = [a for name in logical if name for a in table.get(name, ())]
            if len(used) != len(set(used)):
                raise ShardingError(f"sharding rules map two axes of {leaf!r} {logical} onto the same mesh axis "
                                    f"({used}); each mesh axis can split a tensor only once")
        return cls(mesh, tuple(sorted(table.items())), fused_layout)

    def without(self, logical: Sequence[str]) -> "ShardingPlan":
        """This plan with the `logical` axes replicated (mapped to no mesh axis)."""
        return dataclasses.replace(self, rules=tuple((k, () if k in logical else v) for k, v in self.rules))

    @property
    def table(self) -> dict[str, tuple[str, ...]]:
        return dict(self.rules)

    def axes_of(self, logical: str) -> tuple[str, ...]:
        return self.table.get(logical, ())

    def size_of(self, axes: tuple[str, ...]) -> int:
        sizes = mesh_sizes(self.mesh)
        return int(np.prod([sizes[a] for a in axes])) if axes else 1

    def spec(self, logical: tuple, shape: tuple[int, ...], name: str = "") -> P:
        """PartitionSpec for `shape`; leading dims beyond `logical` (stacked layers) are unsharded."""
        lead = len(shape) - len(logical)
        parts: list[Any] = [None] * lead
        for dim, axis in zip(shape[lead:], logical):
            axes = self.axes_of(axis) if axis else ()
            if axes and dim % self.size_of(axes):
                if axis == "experts":
                    raise ShardingError(f"{name or 'experts'}: {dim} experts cannot be split evenly over mesh axes "
                                        f"{axes} of size {self.size_of(axes)}; choose an expert x tensor size that "
                                        "divides moe_num_experts")
                axes = ()  # replicate a dimension the mesh does not divide
            parts.append(axes if len(axes) > 1 else (axes[0] if axes else None))
        return P(*parts)

    def expert_devices(self) -> list:
        """The devices of one expert-parallel group in the order the experts' slots are split over them (the
        "experts" axes, first major; the other axes at index 0)."""
        names = list(self.mesh.axis_names)
        axes = [names.index(a) for a in self.axes_of("experts")]
        rest = [i for i in range(len(names)) if i not in axes]
        devices = np.transpose(self.mesh.devices, rest + axes)
        return list(devices[(0,) * len(rest)].reshape(-1))

    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def activation(self, logical: tuple, shape: tuple[int, ...]) -> NamedSharding:
        return self.named(self.spec(logical, shape))

    def param_spec(self, name: str, x: Any) -> Any:
        """The spec of weights leaf `name`: a PartitionSpec, or for a quantized leaf the same type holding specs.
        A BlockFP8's scales follow the values' logical axes (swapped for K-major values, stored [out, in]).
        An IntWeight's values and scales split their `in` axis only where both split evenly (each shard then
        holds whole scale groups and the rows they scale); otherwise that axis is replicated."""
        logical = LEAF_AXES[name]
        if isinstance(x, IntWeight):
            values = self.spec(logical, tuple(x.values.shape), name)
            scales = self.spec(logical, tuple(x.scales.shape), name)
            if x.scales.shape[-2] > 1 and values[-2] != scales[-2]:
                values, scales = (P(*s[:-2], None, s[-1]) for s in (values, scales))
            elif x.scales.shape[-2] == 1:
                scales = P(*scales[:-2], None, scales[-1])
            return dataclasses.replace(x, values=values, scales=scales)
        if not isinstance(x, BlockFP8):
            return self.spec(logical, tuple(x.shape), name)
        kn = self.spec(logical, x.shape, name)
        values = P(*kn[:-2], kn[-1], kn[-2]) if x.k_major else kn
        return dataclasses.replace(x, values=values, scales=self.spec(logical, tuple(x.scales.shape), name))

    def weight_specs(self, weights: Any) -> Any:
        """PartitionSpec pytree for a weights pytree (arrays or ShapeDtypeStructs)."""
        return jax.tree_util.tree_map_with_path(lambda path, x: self.param_spec(_leaf_name(path), x), weights,
                                                is_leaf=is_quantized)

    def shardings(self, weights: Any) -> Any:
        return jax.tree.map(self.named, self.weight_specs(weights), is_leaf=lambda x: isinstance(x, P))


def _leaf_name(path) -> str:
    """The weights-pytree leaf name of a tree path (skipping list indices and quantized leaves' fields)."""
    for entry in reversed(path):
        if isinstance(entry, jax.tree_util.DictKey) and str(entry.key) in LEAF_AXES:
            return str(entry.key)
    raise ShardingError(f"no logical axes known for weight {jax.tree_util.keystr(path)}")



def constrain(x: jax.Array, plan: ShardingPlan | None, logical: tuple) -> jax.Array:
    """x pinned to the plan's layout for its logical axes (`logical`, e.g. HIDDEN); on one device (plan None)
    x as it is."""
    return x if plan is None else jax.lax.with_sharding_constraint(x, plan.activation(logical, x.shape))
