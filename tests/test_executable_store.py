"""The compiled-program store (engine/executable_store.py): a warm engine loads its programs without lowering
them and answers the same; damaged entries are compiled again; JAX-cache copies are never stored."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from ernie_jax import LLM, SamplingParams
from ernie_jax.engine import executable_store
from ernie_jax.engine.executable_store import ExecutableStore, describe
from tests.test_engine import golden_model

FEW_BUCKETS = dict(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16)  # 3 programs to compile


@pytest.fixture
def store_dir(tmp_path):
    """JAX's persistent cache and the store in an empty folder of this test's own: every program compiles
    here (none comes from the suite's shared cache), so each one is stored."""
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    compilation_cache.reset_cache()
    yield tmp_path / executable_store.SUBDIR
    jax.config.update("jax_compilation_cache_dir", before)
    compilation_cache.reset_cache()


def test_a_second_engine_loads_every_program_from_the_store_and_answers_the_same(store_dir):
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11, 12, 13, 14, 15]}]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = LLM(golden_model(), **FEW_BUCKETS, background_compile=False)
    programs = first.engine.instances[0].programs
    assert programs.loaded == [] and len(list(store_dir.glob("*.exe"))) == len(programs._programs)
    expected = [o.outputs[0].token_ids for o in first.generate(prompts, sp)]

    second = LLM(golden_model(), **FEW_BUCKETS, background_compile=False)
    again = second.engine.instances[0].programs
    assert sorted(again.loaded) == sorted(programs._programs)  # nothing lowered or compiled
    assert [o.outputs[0].token_ids for o in second.generate(prompts, sp)] == expected


def test_a_damaged_entry_is_logged_and_compiled_again(store_dir, caplog):
    f = jax.jit(lambda x: jnp.sin(x) * 3)
    x = jnp.arange(8, dtype=jnp.float32)
    store = ExecutableStore(str(store_dir), jax.devices()[:1])
    key = store.key("sin", describe(x))
    store.compile(key, f.lower(x))
    np.testing.assert_array_equal(store.load(key)(x), f(x))
    path = store_dir / f"{key}.exe"
    path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, "ernie_jax.engine"):
        assert store.load(key) is None
    assert str(path) in caplog.text and "could not be loaded" in caplog.text


def test_a_program_from_jaxs_cache_is_not_stored(store_dir):
    # XLA:CPU re-serializes an executable loaded from a cache without some of its kernels
    f = jax.jit(lambda x: jnp.cos(x) + 41.5)  # a program of this test only
    x = jnp.arange(5, dtype=jnp.float32)
    store = ExecutableStore(str(store_dir), jax.devices()[:1])
    store.compile("a", f.lower(x))  # compiled here: stored
    jax.clear_caches()  # the same program again comes from JAX's persistent cache
    np.testing.assert_array_equal(store.compile("b", f.lower(x))(x), f(x))
    assert (store_dir / "a.exe").exists() and not (store_dir / "b.exe").exists()


def test_keys_follow_shapes_shardings_and_the_source(monkeypatch):
    devs = jax.devices()
    spec = lambda dtype, d: jax.ShapeDtypeStruct((4, 8), dtype, sharding=jax.sharding.SingleDeviceSharding(d))  # noqa: E731
    a, on_another_device = spec(jnp.float32, devs[0]), spec(jnp.float32, devs[1])
    other_dtype = spec(jnp.bfloat16, devs[0])
    key = lambda s, bucket=("decode", 4, 1): ExecutableStore.key(describe(s), bucket)  # noqa: E731
    keys = {key(a), key(on_another_device), key(other_dtype), key(a, ("decode", 8, 1))}
    assert len(keys) == 4 and key(a) == key(a)
    monkeypatch.setattr(executable_store, "source_hash", lambda: "edited")
    assert key(a) not in keys


def test_the_source_hash_covers_what_programs_are_traced_from_and_not_the_server():
    names = {str(p).split("ernie_jax/", 1)[1] for p in executable_store.traced_sources()}
    assert {"engine/step_functions.py", "model/forward.py", "ops/routed_experts/capacity.py", "quant/block_fp8.py",
            "sampling.py", "sharding/fused.py", "ops/cpu_kernels/matvec.cc"} <= names
    assert not names & {"serve/api.py", "router/routing.py", "engine/scheduler.py", "llm.py"}


def test_no_store_when_jaxs_cache_is_off(store_dir):
    assert ExecutableStore.configured(jax.devices()[:1]) is not None
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        assert ExecutableStore.configured(jax.devices()[:1]) is None
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
