"""The same sharded program under jax.distributed: 2 processes x 4 CPU devices on 127.0.0.1."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from ernie_jax import ErnieForCausalLM
from ernie_jax.config import ErnieConfig
from ernie_jax.model.weights import init_weights
from tests.conftest import TEST_XLA_FLAGS
from tests.serving import free_port
from tests.test_sharding import BASE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



@pytest.mark.parametrize("mesh", ["data=2,expert=2,tensor=2", "data=1,expert=4,tensor=2"])
def test_two_processes_match_single_process(tmp_path, mesh):
    port, out = free_port(), str(tmp_path / "logits.npy")
    env = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "multihost_worker.py"), str(i), str(port),
                               out, mesh], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    cfg = ErnieConfig(**BASE, moe_num_shared_experts=1)
    model = ErnieForCausalLM(cfg, init_weights(cfg, 7, jnp.float32), dtype=jnp.float32)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 9)).astype(np.int32)
    assert np.abs(np.load(out) - np.asarray(model(ids))).max() < 1e-5
