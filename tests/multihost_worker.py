"""One process of the 2-process x 4-CPU-device test (test_multihost.py): the sharded forward of a tiny
model on a global 8-device mesh under jax.distributed; process 0 saves the gathered logits."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402


def main(process_id: int, port: int, out: str, mesh_spec: str) -> None:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    # Start the backend before importing the tests package, whose conftest asks for 8 devices per process.
    assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4, (
        jax.process_count(), jax.devices(), jax.local_devices())
    from ernie_jax import ErnieForCausalLM
    from ernie_jax.config import ErnieConfig
    from ernie_jax.model.weights import init_weights
    from ernie_jax.sharding import ShardingPlan, make_mesh, shard_weights
    from tests.test_sharding import BASE
    cfg = ErnieConfig(**BASE, moe_num_shared_experts=1)
    plan = ShardingPlan.create(make_mesh(mesh_spec), "tp_ep")
    host = jax.tree.map(np.asarray, init_weights(cfg, 7, jnp.float32))  # same seed, same weights everywhere
    model = ErnieForCausalLM(cfg, shard_weights(host, plan, cfg), dtype=jnp.float32)
    model.plan = plan
    ids_host = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 9)).astype(np.int32)
    ids = jax.make_array_from_callback(ids_host.shape, plan.activation(("batch", None), ids_host.shape),
                                       lambda idx: ids_host[idx])
    logits = multihost_utils.process_allgather(model(ids), tiled=True)
    if process_id == 0:
        np.save(out, np.asarray(logits))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
