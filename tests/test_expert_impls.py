"""The grouped (ragged_dot) expert path that accelerators take, run on CPU: parity and sharded equality."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ernie_jax import load_pretrained
from ernie_jax.model import layers
from ernie_jax.sharding import ShardingPlan, make_mesh
from tests.conftest import GOLDEN


@pytest.fixture
def ragged():
    jax.clear_caches()  # the choice is made at trace time
    layers.EXPERT_IMPL = "ragged"
    yield
    layers.EXPERT_IMPL = "auto"
    jax.clear_caches()


@pytest.mark.parametrize("name", ["shared_untied", "noshared_tied"])
def test_ragged_path_matches_hf(golden, ragged, name):
    g = golden(name)
    out = load_pretrained(GOLDEN / name / "paddle", dtype=jnp.float32).forward(g["input_ids"])
    assert np.abs(np.asarray(out.logits) - g["logits"]).max() < 1e-4
    ids = np.concatenate([np.sort(np.asarray(e), axis=-1) for e in out.expert_ids], axis=0)
    np.testing.assert_array_equal(ids, g["topk_experts"])


@pytest.mark.parametrize("mesh", ["data=1,expert=8,tensor=1", "data=2,expert=2,tensor=2"])
def test_ragged_expert_parallel_matches(golden, ragged, mesh):
    g = golden("shared_untied")
    model = load_pretrained(GOLDEN / "shared_untied" / "paddle", dtype=jnp.float32)
    sharded = model.shard(ShardingPlan.create(make_mesh(mesh)))
    assert np.abs(np.asarray(sharded(g["input_ids"])) - g["logits"]).max() < 1e-4


def test_ragged_fp8_grouped_path_runs(golden, ragged):
    g = golden("shared_untied")
    model = load_pretrained(GOLDEN / "shared_untied" / "paddle", dtype=jnp.float32, quantization="fp8",
                            fp8_compute="weight_only")
    ragged_logits = np.asarray(model(g["input_ids"]))
    layers.EXPERT_IMPL = "dense"
    jax.clear_caches()
    dense_ref = np.asarray(model(g["input_ids"]))
    assert np.abs(ragged_logits - dense_ref).max() < 1e-4
