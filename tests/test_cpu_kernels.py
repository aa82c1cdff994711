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

# Only a machine without a compiler skips: a kernel that fails to build where one exists fails these tests.
needs_kernel = pytest.mark.skipif(cpu_kernels.shutil.which(cpu_kernels.compiler()) is None,
                                  reason=f"no C++ compiler ({cpu_kernels.compiler()})")


def _bf16(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


@needs_kernel
@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("K, N, groups", [(256, 256, 1), (40, 300, 2), (7, 17, 3), (128, 1024, 1)])
def test_expert_matvec_matches_numpy(K, N, groups, x_dtype):
    """Every column tile and tail (N = 128 k + 16 j + r), an odd K, expert groups, an expert chosen by several
    rows and ids outside the experts (another device's: zero rows); rows of bf16 values (which CPUs with bf16
    dot products multiply with those) and of other f32 values."""
    from ernie_jax.ops.cpu_kernels.matvec import expert_matvec
    rng = np.random.default_rng(K + N)
    R, J, per = 5, 3, 2
    w = _bf16(rng, (per * groups, K, N))
    x = jnp.asarray(rng.standard_normal((R, K)), x_dtype).astype(jnp.float32)
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
    from ernie_jax.ops.cpu_kernels.matvec import expert_matvec
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
    why = cpu_kernels._library.__wrapped__("matvec")
    assert isinstance(why, str) and "no C++ compiler" in why and "no-such-c++-compiler" in why
    monkeypatch.setattr(cpu_kernels, "unavailable", lambda name: why)
    cpu = ExecutionConfig.select(Platform("cpu"))
    assert cpu.routed_experts == "xla_cpu"
    assert ("routed_experts", "cpu_matvec", why) in cpu.passed_over and "no C++ compiler" in cpu.describe()
    with pytest.raises(RuntimeError, match="CPU kernel matvec: no C\\+\\+ compiler"):
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


def _pools(rng, P, page, K, D):
    from ernie_jax.ops.paged_attention.storage import stored, BF16_BITS
    return tuple(stored(jnp.asarray(rng.standard_normal((P, page, K, D)), jnp.bfloat16), BF16_BITS) for _ in "kv")


@needs_kernel
@pytest.mark.parametrize("D, block_slots, N", [(64, 8, 4), (128, 64, 8), (32, 20, 2), (24, 64, 4)])
def test_paged_decode_attention_matches_the_xla_forms(D, block_slots, N):
    """Rows in several blocks of the online softmax, one at a block boundary, a padding row (position -1: zeros),
    GQA (one to four query heads a KV head), pages scattered over the pool, a block that is not a multiple of
    16 slots; a head dim the kernel does not take (24) runs the xla_cpu form."""
    from ernie_jax.ops.paged_attention import paged_attention
    rng = np.random.default_rng(D)
    B, K, page, P, n = 5, 2, 4, 40, 8
    k_pool, v_pool = _pools(rng, P, page, K, D)
    q = jnp.asarray(rng.standard_normal((B, 1, N, D)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(P)[:B * n].reshape(B, n), jnp.int32)
    positions = jnp.asarray([[0], [7], [8], [31], [-1]], jnp.int32)
    run = lambda impl: np.asarray(jax.jit(lambda *a: paged_attention(  # noqa: E731
        *a, implementation=impl, block_slots=block_slots))(q, k_pool, v_pool, None, None, tables, positions), np.float32)
    kernel, form, reference = run("cpu_decode"), run("xla_cpu"), run("xla")
    np.testing.assert_allclose(kernel, reference, atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(kernel, form, atol=1e-2, rtol=1e-2)
    if D == 24:
        np.testing.assert_array_equal(kernel, form)
    assert not kernel[4].any()  # the padding row
    # a row's result does not depend on the others
    alone = np.asarray(jax.jit(lambda *a: paged_attention(*a, implementation="cpu_decode", block_slots=block_slots))(
        q[3:4], k_pool, v_pool, None, None, tables[3:4], positions[3:4]), np.float32)
    np.testing.assert_array_equal(alone, kernel[3:4])


@pytest.fixture
def parallel_work():
    """Sets cpu_kernels.set_parallel_work for a test (an engine built earlier in this process may have set
    it) and restores it after."""
    before = cpu_kernels._parallel_work
    yield cpu_kernels.set_parallel_work
    cpu_kernels.set_parallel_work(before)


@needs_kernel
def test_paged_decode_attention_split_over_threads_matches_each_row_alone(parallel_work):
    """A call shared with XLA's pool threads gives each row what that row computes alone, bit for bit."""
    from ernie_jax.ops.paged_attention import paged_attention
    parallel_work(0)
    rng = np.random.default_rng(3)
    B, K, N, D, page, n = 12, 2, 8, 128, 16, 16
    P = B * n + 1
    k_pool, v_pool = _pools(rng, P, page, K, D)
    q = jnp.asarray(rng.standard_normal((B, 1, N, D)), jnp.bfloat16)
    tables = jnp.asarray(1 + rng.permutation(B * n).reshape(B, n), jnp.int32)
    positions = jnp.asarray(rng.integers(200, n * page, (B, 1)), jnp.int32)
    call = jax.jit(lambda *a: paged_attention(*a, implementation="cpu_decode", block_slots=64))
    together = np.asarray(call(q, k_pool, v_pool, None, None, tables, positions), np.float32)
    reference = np.asarray(jax.jit(lambda *a: paged_attention(*a, implementation="xla", block_slots=64))(
        q, k_pool, v_pool, None, None, tables, positions), np.float32)
    np.testing.assert_allclose(together, reference, atol=1e-2, rtol=1e-2)
    for b in range(B):
        alone = np.asarray(call(q[b:b + 1], k_pool, v_pool, None, None, tables[b:b + 1], positions[b:b + 1]))
        np.testing.assert_array_equal(alone[0], together[b])


@needs_kernel
def test_paged_decode_attention_names_a_page_outside_the_pool():
    from ernie_jax.ops.cpu_kernels.attention import paged_decode_attention
    rng = np.random.default_rng(0)
    k_pool, v_pool = _pools(rng, 4, 4, 1, 16)
    q = jnp.zeros((1, 1, 1, 16), jnp.float32)
    with pytest.raises(Exception, match="row 0's block table names page 9, outside the pool of 4"):
        jax.block_until_ready(paged_decode_attention(q, k_pool, v_pool, jnp.asarray([[1, 9]], jnp.int32),
                                                     jnp.asarray([[5]], jnp.int32), 64))


@needs_kernel
@pytest.mark.parametrize("R, K, N", [(1, 256, 8192), (3, 40, 37), (2, 17, 9), (4, 16, 33), (2, 8, 20)])
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w.T"])
def test_dense_matmul_kernel_matches_numpy(R, K, N, transposed):
    """x @ w and x @ w.T (a tied LM head) through the kernel: every row tile and K tail; more rows than
    max_rows take the einsum."""
    from ernie_jax.ops.dense_matmul import dense_matmul
    rng = np.random.default_rng(R * K + N)
    x = _bf16(rng, (R, K))
    w = _bf16(rng, (N, K) if transposed else (K, N))
    got = np.asarray(jax.jit(lambda x, w: dense_matmul(x, w, transposed, implementation="cpu_matvec"))(x, w))
    wf = np.asarray(w, np.float64)
    want = np.asarray(x, np.float64) @ (wf.T if transposed else wf)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    alone = np.asarray(dense_matmul(x[:1], w, transposed, implementation="cpu_matvec"))
    np.testing.assert_array_equal(alone[0], got[0])  # a row's result does not depend on the others
    many = dense_matmul(jnp.tile(x, (3, 1)), w, transposed, implementation="cpu_matvec", max_rows=2)
    np.testing.assert_array_equal(np.asarray(many), np.asarray(dense_matmul(jnp.tile(x, (3, 1)), w, transposed)))


@needs_kernel
def test_results_do_not_depend_on_the_kernels_threads(parallel_work):
    """set_parallel_work moves work between threads and nothing else: the same calls shared with XLA's pool
    threads and run on the calling thread alone give the same bits (the setting applies at run time, to
    programs already compiled)."""
    from ernie_jax.ops.cpu_kernels.matvec import expert_matvec, matvec_t
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 8, (4, 2)), jnp.int32)
    w, head = _bf16(rng, (8, 256, 1024)), _bf16(rng, (4096, 256))
    calls = jax.jit(lambda x: (expert_matvec(x, ids, (w,)), matvec_t(x, head)))
    parallel_work(0)
    shared = [np.asarray(y) for y in calls(x)]
    parallel_work(1 << 40)
    alone = [np.asarray(y) for y in calls(x)]
    for a, b in zip(shared, alone):
        np.testing.assert_array_equal(a, b)


def test_small_models_kernel_calls_stay_on_one_thread_where_their_weights_are_cached(monkeypatch):
    """engine/cpu_rules.kernel_parallel_work: below CACHED_PARALLEL_WORK a call runs alone where the weights fit
    in the last-level cache and decode runs a step a program; where they do not, decode runs several steps a
    program, or no cache size is reported, every call shares its work."""
    from ernie_jax.engine import cpu_rules
    weights = {"a": jnp.zeros((1 << 20,), jnp.bfloat16), "b": [jnp.zeros((1 << 20,), jnp.float32)]}  # 6 MiB
    monkeypatch.setattr(cpu_rules, "last_level_cache_bytes", lambda: 32 << 20)
    assert cpu_rules.kernel_parallel_work(weights) == cpu_rules.CACHED_PARALLEL_WORK
    assert cpu_rules.kernel_parallel_work(weights, decode_steps=8) == 0  # the host waits out a multi-step
    monkeypatch.setattr(cpu_rules, "last_level_cache_bytes", lambda: 4 << 20)
    assert cpu_rules.kernel_parallel_work(weights) == 0
    monkeypatch.setattr(cpu_rules, "last_level_cache_bytes", lambda: 0)
    assert cpu_rules.kernel_parallel_work(weights) == 0
