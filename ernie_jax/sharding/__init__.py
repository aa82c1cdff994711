"""Meshes, the logical-axis rules table, weight placement and expert parallelism."""

from ernie_jax.sharding.mesh import AXES, MeshError, make_mesh, parse_mesh_spec
from ernie_jax.sharding.placement import abstract_device_bytes, device_bytes, shard_weights
from ernie_jax.sharding.rules import PRESETS, ShardingError, ShardingPlan

__all__ = ["AXES", "MeshError", "PRESETS", "ShardingError", "ShardingPlan", "abstract_device_bytes",
           "device_bytes", "make_mesh", "parse_mesh_spec", "shard_weights"]
