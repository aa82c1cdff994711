"""Test setup: 8 fake CPU devices (set before JAX starts) and shared fixtures."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402

# Engines compile every bucket at start-up; identical programs across tests come from this cache.
jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "ernie_jax_test_xla_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

GOLDEN = pathlib.Path(__file__).parent / "golden"
GOLDEN_MODELS = ["shared_untied", "noshared_tied", "interval2_headdim"]


@pytest.fixture(scope="session")
def golden():
    def get(name: str):
        return np.load(GOLDEN / name / "golden.npz")
    return get
