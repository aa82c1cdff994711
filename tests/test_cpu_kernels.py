"""The compiled CPU kernels (ops/cpu_kernels): built with the machine's compiler, against numpy references,
and how the execution config reports a machine where they cannot be built."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ernie_jax.ops import cpu_kernels
from ernie_jax.ops.base import Platform
from ernie_jax.ops.execution import ExecutionConfig
from ernie_jax.ops.routed_experts import ExpertOptions, routed_experts

needs_kernel = pytest.mark.skipif(cpu_kernels.unavailable("expert_matvec") is not None,
                                  reason=f"expert_matvec: {cpu_kernels.unavailable('expert_matvec')}")


def _bf16(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


@needs_kernel
@pytest.mark.parametrize("K, N, groups", [(256, 256, 1), (40, 300, 2), (7, 17, 3), (128, 1024, 1)])
def test_expert_matvec_matches_numpy(K, N, groups):
    """Every column tile and tail (N = 128 k + 16 j + r), expert groups, an expert chosen by several rows and
    ids outside the experts (another device's: zero rows)."""
    from ernie_jax.ops.cpu_kernels.expert_matvec import expert_matvec
    rng = np.random.default_rng(K + N)
    R, J, per = 5, 3, 2
    w = _bf16(rng, (per * groups, K, N))
    x = jnp.asarray(rng.standard_normal((R, K)), jnp.float32)
    ids = np.asarray(rng.integers(-1, per * groups + 1, (R, J)), np.int32)
    ids[0, :] = ids[1, :] = 0  # one expert, several rows
    got = np.asarray(jax.jit(expert_matvec)(x, jnp.asarray(ids), tuple(w[g * per:(g + 1) * per] for g in range(groups))))
    wf = np.asarray(w, np.float64)
    want = np.zeros((R, J, N))
    for r in range(R):
        for j in range(J):
            if 0 <= ids[r, j] < per * groups:
                want[r, j] = np.asarray(x[r], np.float64) @ wf[ids[r, j]]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # a row's result does not depend on the other rows
    alone = np.asarray(expert_matvec(x[2:3], jnp.asarray(ids[2:3]), (w,) if groups == 1 else
                                     tuple(w[g * per:(g + 1) * per] for g in range(groups))))
    np.testing.assert_array_equal(alone[0], got[2])


@needs_kernel
def test_expert_matvec_names_bad_weights():
    from ernie_jax.ops.cpu_kernels.expert_matvec import expert_matvec
    x, ids = jnp.zeros((2, 8)), jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match="bf16 \\[E_g, K, N\\]"):
        expert_matvec(x, ids, (jnp.zeros((2, 8, 4), jnp.float32),))
    with pytest.raises(ValueError, match="K = 6"):
        expert_matvec(x, ids, (jnp.zeros((2, 6, 4), jnp.bfloat16),))


@needs_kernel
@pytest.mark.parametrize("first, local, groups", [(0, 16, 2), (4, 8, 1)])
def test_cpu_matvec_experts_match_the_capacity_form(first, local, groups):
    """bf16 experts through the kernel against XLA:CPU's capacity form (the same roundings; only the order of
    each matmul's f32 sums may differ), for all experts and for one device's slice (expert parallelism);
    past matvec_max_tokens the call takes the xla_cpu forms."""
    rng = np.random.default_rng(first)
    T, H, F, E, k = 6, 256, 128, 16, 4
    x = _bf16(rng, (T, H))
    ug, dn = _bf16(rng, (E, H, 2 * F), 0.05)[first:first + local], _bf16(rng, (E, F, H), 0.05)[first:first + local]
    if groups > 1:
        n = local // groups
        ug, dn = (tuple(a[g * n:(g + 1) * n] for g in range(groups)) for a in (ug, dn))
    ids = jnp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]), jnp.int32)
    w = jnp.asarray(rng.random((T, k)), jnp.float32)
    run = lambda impl, opts=ExpertOptions(): np.asarray(jax.jit(  # noqa: E731
        lambda *a: routed_experts(*a, E, first, implementation=impl, opts=opts))(x, w, ids, ug, dn), np.float32)
    kernel, capacity = run("cpu_matvec"), run("capacity")
    np.testing.assert_allclose(kernel, capacity, atol=2e-2 * np.abs(capacity).max())
    np.testing.assert_array_equal(run("cpu_matvec", ExpertOptions(matvec_max_tokens=T - 1)), run("xla_cpu"))


def test_a_machine_without_a_compiler_keeps_the_xla_forms_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    monkeypatch.setenv("ERNIE_JAX_KERNEL_CACHE", str(tmp_path))
    why = cpu_kernels._library.__wrapped__("expert_matvec")
    assert isinstance(why, str) and "no C++ compiler" in why and "no-such-c++-compiler" in why
    monkeypatch.setattr(cpu_kernels, "unavailable", lambda name: why)
    cpu = ExecutionConfig.select(Platform("cpu"))
    assert cpu.routed_experts == "xla_cpu"
    assert ("routed_experts", "cpu_matvec", why) in cpu.passed_over and "no C++ compiler" in cpu.describe()
    with pytest.raises(RuntimeError, match="CPU kernel expert_matvec: no C\\+\\+ compiler"):
        dataclasses.replace(cpu, routed_experts="cpu_matvec")


def test_a_failed_build_is_reported_with_the_compilers_error(monkeypatch, tmp_path):
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++;\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", tmp_path)
    monkeypatch.setenv("ERNIE_JAX_KERNEL_CACHE", str(tmp_path / "cache"))
    if cpu_kernels.shutil.which(cpu_kernels.compiler()) is None:
        pytest.skip("no C++ compiler on this machine")
    why = cpu_kernels._library.__wrapped__("broken")
    assert isinstance(why, str) and why.startswith("building broken.cc with") and "error" in why
    assert not list((tmp_path / "cache").glob("*"))  # no half-built library left behind
