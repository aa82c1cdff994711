"""Test setup: 8 fake CPU devices (set before JAX starts) and shared fixtures."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

GOLDEN = pathlib.Path(__file__).parent / "golden"
GOLDEN_MODELS = ["shared_untied", "noshared_tied", "interval2_headdim"]


@pytest.fixture(scope="session")
def golden():
    def get(name: str):
        return np.load(GOLDEN / name / "golden.npz")
    return get
