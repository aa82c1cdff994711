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


def rewrite_safetensors(folder, edit):
    """Rewrite folder/model.safetensors after `edit(tensors, header_dtypes)` changed the dicts in place."""
    from ernie_jax.checkpoint.safetensors_io import SafetensorsCheckpoint, read_tensor, save_file
    file = folder / "model.safetensors"
    ckpt = SafetensorsCheckpoint(str(file))
    tensors = {k: np.array(read_tensor(ckpt.info(k), bitcast=False)) for k in ckpt.keys()}
    names = {k: ckpt.info(k).dtype for k in ckpt.keys()}
    edit(tensors, names)
    save_file(tensors, str(file), dtype_names={k: v for k, v in names.items() if k in tensors})
