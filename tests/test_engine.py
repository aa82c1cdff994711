"""The engine: PD disaggregation and colocated modes, paged pools, continuous batching, sampling, aborts."""

import asyncio
import concurrent.futures
import functools
import os
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ernie_jax import LLM, RequestError, SamplingParams, SamplingParamsError, load_pretrained
from ernie_jax.assets import EMBEDDED_MODEL_DIR
from ernie_jax.engine.async_engine import AsyncEngine
from ernie_jax.engine.policy import PDPolicy
from ernie_jax.engine.compile_pool import compile_all, compile_behind
from ernie_jax.engine.cpu_rules import cpu_expert_groups, min_decode_rows
from tests.conftest import GOLDEN

SMALL = dict(max_model_len=64, max_num_seqs=4)


def all_free(engine) -> bool:
    """Every page of every pool free (and consistent), no request left."""
    for pool in engine.pools.values():
        pool.check()
    return all(p.free == p.capacity for p in engine.pools.values()) and not engine.has_unfinished()


def programs(engine, name: str = "mixed"):
    return engine.instance(name).programs


@functools.lru_cache(maxsize=None)
def golden_model(name="shared_untied"):
    return load_pretrained(GOLDEN / name / "paddle", dtype=jnp.float32)


@functools.lru_cache(maxsize=None)
def llm(mode: str, kv: str = "auto") -> LLM:
    kw = {"pd": dict(mesh=8, prefill_devices=4), "colocated8": dict(mesh=8, disaggregate=False),
          "single": {}}[mode]
    return LLM(golden_model(), kv_cache_dtype=kv, **SMALL, **kw)


def test_cancelled_compiles_are_skipped_so_shutdown_does_not_wait_for_them():
    # one worker runs the jobs in order: the first cancels, the queued ones never start
    cancelled, ran, done = threading.Event(), [], []

    def job(i):
        ran.append(i)
        if i == 0:
            cancelled.set()
        return f"exe{i}"
    compile_all({i: functools.partial(job, i) for i in range(4)}, lambda key, exe, s: done.append((key, exe)),
                workers=1, cancelled=cancelled)
    assert ran == [0] and done == [(0, "exe0")]


def test_cancelled_compile_all_makes_no_thread_pool(monkeypatch):
    # After a shutdown the background thread moves on to the next instance's buckets while the interpreter
    # exits, when a new pool raises; a cancelled compile_all must not make one.
    def refuse(*args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")
    monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", refuse)
    cancelled = threading.Event()
    cancelled.set()
    compile_all({0: lambda: "exe0"}, lambda *a: pytest.fail("a cancelled job ran"), workers=1, cancelled=cancelled)


def test_compile_behind_takes_instances_in_turn_yields_to_requests_and_survives_a_failure(caplog):
    order, published, busy = [], [], [True]

    class Lowered:  # what lower() returns: compile() runs on the low-priority worker thread
        def __init__(self, name):
            self.name = name

        def compile(self):
            if self.name == "p2":
                raise RuntimeError("an XLA error")
            busy[0] = False
            return f"exe-{self.name}"

    def job(name):
        order.append(name)
        return Lowered(name)
    queues = [[(functools.partial(job, n), functools.partial(lambda n, exe, s: published.append(exe), n))
               for n in names] for names in (["p1", "p2", "p3"], ["d1"])]
    t0 = time.perf_counter()
    assert compile_behind(queues, lambda: busy[0], threading.Event(), max_pause=0.3) == 3
    assert time.perf_counter() - t0 >= 0.3  # the first job waited for the busy engine, at most max_pause
    assert order == ["p1", "d1", "p2", "p3"] and published == ["exe-p1", "exe-d1", "exe-p3"]
    assert "a background compile failed" in caplog.text
    cancelled = threading.Event()
    cancelled.set()
    assert compile_behind(queues, lambda: False, cancelled) == 0


def test_background_compile_serves_with_the_programs_it_has_and_finishes():
    """A PD engine compiling behind: each instance starts with its own role's largest program, requests run
    while the rest compile (no role switch onto a role without programs), outputs match the engine that
    compiled everything first."""
    # one chunk length and one batch size: 2 programs before the engine returns, 4 behind it (the reference
    # engine compiles the same programs first, so most come from the compilation cache)
    small = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, mesh=2, prefill_devices=1)
    ref = LLM(golden_model(), **small)
    bg = LLM(golden_model(), **small, background_compile=True)
    assert sum(i.programs.pending for i in bg.engine.instances) >= 3  # (one may have finished already)
    prompts = [[1, 5, 9, 200, 31], [1, 7, 7, 7], [1, 42]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in bg.generate(prompt_token_ids=prompts, sampling_params=params)]
    deadline = time.monotonic() + 300
    while any(i.programs.pending for i in bg.engine.instances) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(i.programs.pending for i in bg.engine.instances)
    want = [o.outputs[0].token_ids for o in ref.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == want
    assert [o.outputs[0].token_ids for o in bg.generate(prompt_token_ids=prompts, sampling_params=params)] == want
    assert all_free(bg.engine)
    bg.engine.shutdown()


@pytest.mark.parametrize("mode", ["single", "colocated8", "pd"])
def test_greedy_matches_hf_in_every_mode(golden, mode):
    g = golden("shared_untied")
    engine_llm = llm(mode)
    with jax.transfer_guard("disallow"):  # no implicit host<->device or cross-mesh copy hides anywhere
        outs = engine_llm.generate(prompt_token_ids=g["greedy_prompt"].tolist(),
                                   sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == g["greedy_tokens"].tolist()
    assert all_free(engine_llm.engine)


@pytest.mark.parametrize("mode", ["single", "pd"])
def test_greedy_matches_hf_with_tiled_prefill_experts(golden, mode, monkeypatch):
    """With tiles of 2 rows, prefill steps take the tiled expert form (several tiles per expert, tiles running
    past their expert's rows, the experts split over the prefill submesh in pd mode): still HF's tokens."""
    import dataclasses

    from ernie_jax.ops import routed_experts
    traced, tiled = [], routed_experts.tiled_experts
    monkeypatch.setattr(routed_experts, "tiled_experts", lambda *a, **k: traced.append(1) or tiled(*a, **k))
    g = golden("shared_untied")
    kw = dict(mesh=8, prefill_devices=4) if mode == "pd" else {}
    model = golden_model()
    model.execution = dataclasses.replace(model.execution, expert_tile_rows=2)  # a new jit key: traced afresh
    engine_llm = LLM(model, **SMALL, **kw)
    assert traced  # at start-up, by the prefill buckets
    outs = engine_llm.generate(prompt_token_ids=g["greedy_prompt"].tolist(),
                               sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == g["greedy_tokens"].tolist()


def test_fp8_kv_cache_same_in_pd_and_colocated(golden):
    g = golden("shared_untied")
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = llm("pd", "fp8").generate(prompt_token_ids=g["greedy_prompt"].tolist(), sampling_params=sp)
    b = llm("single", "fp8").generate(prompt_token_ids=g["greedy_prompt"].tolist(), sampling_params=sp)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    # fp8 tolerance against HF: the first greedy token of each prompt (before any divergence compounds)
    assert [o.outputs[0].token_ids[0] for o in a] == g["greedy_tokens"][:, 0].tolist()


def test_pd_programs_run_on_their_submeshes_and_pages_move_bit_identically():
    engine = llm("pd").engine
    prefiller, decoder = programs(engine, "prefill"), programs(engine, "decode")
    devices = jax.devices()
    assert set(prefiller.devices) == set(devices[:4]) and set(decoder.devices) == set(devices[4:])
    for compiled in prefiller.executables("prefill") + prefiller.executables("decode"):
        assert {d for s in jax.tree.leaves(compiled.input_shardings) for d in s.device_set} == set(devices[:4])
    for compiled in decoder.executables("decode") + decoder.executables("prefill"):
        assert {d for s in jax.tree.leaves(compiled.input_shardings) for d in s.device_set} == set(devices[4:])
    rid = engine.add_request(list(range(5, 40)), SamplingParams(temperature=0, max_tokens=4))
    req = engine.requests[rid]
    for inst in engine.instances:  # static: every finished prompt moves
        inst.policy = PDPolicy("static")
    try:
        while req not in engine.instance("decode").running:  # prefilled, then moved to the decode instance
            engine.step()
    finally:
        for inst in engine.instances:
            inst.policy = engine.policy
    src, dst = engine.instance("prefill").transfer.last
    for s in range(len(decoder.cache.k)):
        for name in ("k", "v"):  # the prompt's 35 positions (the decode pool has since written position 35)
            a = jax.device_get(getattr(prefiller.cache, name)[s][:, np.asarray(src)])
            b = jax.device_get(getattr(decoder.cache, name)[s][:, np.asarray(dst)])
            flat = lambda x: x.reshape(x.shape[0], -1, *x.shape[3:])[:, :35]  # noqa: E731  [L, positions, K, D]
            np.testing.assert_array_equal(flat(a), flat(b))
    engine.run_until_done([rid]) if rid in engine.requests else None
    assert all_free(engine)


def test_sharded_programs_never_copy_the_kv_pool():
    """A copy of the page pool in a step costs more than the step's math: under a mesh whose pages split over
    data, the XLA attention's loop over page blocks once made XLA copy the pool around the loop, and a
    4-device CPU decode step went from 18 ms to 700 ms."""
    engine = LLM(EMBEDDED_MODEL_DIR, mesh=8, prefill_devices=4, max_model_len=256, max_num_seqs=4).engine  # 4 blocks
    for inst in engine.instances:
        pool = inst.programs.cache.k[0]  # [L, P, page, K, D]: a copy of it has P (or a device's P) pages of `page`
        pages = {f"{p},{pool.shape[2]}," for p in (pool.shape[1], pool.sharding.shard_shape(pool.shape)[1])}
        for exe in inst.programs.executables("prefill") + inst.programs.executables("decode"):
            for shape in re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", exe.as_text()):
                assert not any(p in shape + "," for p in pages), shape


def test_cpu_decode_reads_bf16_weights_as_stored():
    """XLA:CPU converts a bf16 weight to f32 on every call when a matmul has one row: a decode step of the
    bench model took 280 ms for one sequence against 26 ms for two. So a model with a bf16 matmul (a linear or
    the head) decodes at least 2 rows on CPU and no decode program holds an f32 array of a weight's shape. Likewise XLA:CPU
    gathers and scatters a bf16 page pool through f32 copies of the whole pool, so the pool holds the
    values' uint16 bits and no program holds a float array of its shape."""
    tiny = LLM("tiny", dtype="bfloat16", **SMALL)
    engine = programs(tiny.engine)
    assert sorted(engine.ready["decode"]) == [2, 4]
    leaves = jax.tree.leaves(engine.weights["segments"])
    groups = cpu_expert_groups(8)  # one per core
    assert 8 % groups == 0 and groups <= (os.cpu_count() or 1)
    assert any(a.shape == (8 // groups, 128, 128) for a in leaves)  # experts_up_gate [E, H, 2F] in groups
    weight_shapes = {",".join(map(str, a.shape)) for a in leaves if a.dtype == jnp.bfloat16 and a.ndim >= 2}
    for exe in engine.executables("decode"):
        f32 = set(re.findall(r"= f32\[([\d,]*)\]", exe.as_text()))
        assert not f32 & weight_shapes, f32 & weight_shapes
    pool = engine.cache.k[0]
    assert pool.dtype == jnp.uint16
    flat = (pool.shape[0] * pool.shape[1], *pool.shape[2:])  # the layer's view of the pool
    pool_shapes = {",".join(map(str, shape)) for shape in (pool.shape, flat)}
    for exe in engine.executables("decode") + engine.executables("prefill"):
        floats = set(re.findall(r"= (?:f32|bf16)\[([\d,]*)\]", exe.as_text()))
        assert not floats & pool_shapes, floats & pool_shapes
    shapes, run = [], engine.run
    engine.run = lambda kind, ids, *a: shapes.append((kind, ids.shape)) or run(kind, ids, *a)
    try:
        out = tiny.generate(prompt_token_ids=[[5, 6, 7]],
                            sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finally:
        del engine.run
    decode = {shape for kind, shape in shapes if kind == "decode"}
    assert len(out[0].outputs[0].token_ids) == 4 and decode == {(2, 1)}  # beside a padding row
    # block-FP8 linears, but the tied head is a bf16 matmul too (a lone request: 25.3 ms -> 17.5 ms per token)
    assert min_decode_rows(load_pretrained(EMBEDDED_MODEL_DIR)) == 2


def test_cpu_fp8_form_reads_bf16_values_as_stored():
    """With the XLA:CPU block-FP8 form (what CPUs with bf16 dot products take), the FP8 values are held as bf16,
    the routed experts in groups (one per core), and no decode program converts a weight's values to f32 (which
    would read and write every weight at every step). Its numbers against the reference form: test_ops."""
    from ernie_jax import ErnieForCausalLM
    from ernie_jax.checkpoint import read_pretrained
    from ernie_jax.ops import ExecutionConfig, Platform
    from ernie_jax.quant import BlockFP8
    cfg, weights = read_pretrained(EMBEDDED_MODEL_DIR, jnp.bfloat16)
    ex = ExecutionConfig.select(Platform("cpu"), block_fp8_matmul="xla_cpu")
    llm = LLM(ErnieForCausalLM.from_host(cfg, weights, jnp.bfloat16, None, ex), max_model_len=32, max_num_seqs=2)
    engine = programs(llm.engine)
    fp8 = [w for w in jax.tree.leaves(engine.weights["segments"], is_leaf=lambda a: isinstance(a, BlockFP8))
           if isinstance(w, BlockFP8)]
    assert fp8 and {w.values.dtype for w in fp8} == {jnp.dtype(jnp.bfloat16)}
    groups = cpu_expert_groups(cfg.moe_num_experts)
    assert isinstance(engine.weights["segments"][1][0]["experts_up_gate"], tuple if groups > 1 else BlockFP8)
    value_shapes = {",".join(map(str, w.values.shape)) for w in fp8}
    for exe in engine.executables("decode"):
        f32 = set(re.findall(r"= f32\[([\d,]*)\]", exe.as_text()))
        assert not f32 & value_shapes, f32 & value_shapes
    out = llm.generate(prompt_token_ids=[[1, 300, 42]],
                       sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


MIXED_PROMPTS = [[5, 9, 11, 13], [7, 3], [21, 22, 23, 24, 25, 26], [4], [8, 8]]  # SMALL's 4 seats: the 5th waits


def mixed_params(*max_tokens: int) -> list[SamplingParams]:
    """MIXED_PROMPTS' sampling, with these max_tokens: greedy, seeded, greedy, seeded top-p with logprobs, greedy."""
    a, b, c, d, e = max_tokens
    return [SamplingParams(temperature=0, max_tokens=a, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=3, max_tokens=b, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=c, ignore_eos=True),
            SamplingParams(temperature=0.5, top_p=0.9, seed=1, max_tokens=d, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0, max_tokens=e, ignore_eos=True)]


@pytest.mark.parametrize("mode", ["single", "pd"])
def test_decode_steps_chain_on_device_without_changing_tokens(mode):
    """While the batch is unchanged, a decode step takes the previous step's sampled tokens on the device
    before the host reads them. Greedy and seeded sampling, a request that stops early and one that joins
    late give the tokens of reading every step first, and every page ends free."""
    engine_llm = llm(mode)
    engine = engine_llm.engine
    prompts, params = MIXED_PROMPTS, mixed_params(10, 12, 3, 9, 6)
    chained = []  # per decode dispatch: whether it took the step in flight's tokens on the device
    for inst in engine.instances:
        inst.runner.dispatch = lambda plan, d=inst.runner.dispatch: (
            plan.decode and chained.append(plan.after_in_flight)) or d(plan)
    try:
        with jax.transfer_guard("disallow"):
            ahead = engine_llm.generate(prompt_token_ids=prompts, sampling_params=params)
        for inst in engine.instances:
            inst.scheduler.overlap = False  # read every step before the next
        stepwise = engine_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    finally:
        for inst in engine.instances:
            del inst.runner.dispatch
            inst.scheduler.overlap = True
    assert sum(chained) >= 5  # most decode steps ran ahead of the host
    assert [o.outputs[0].token_ids for o in ahead] == [o.outputs[0].token_ids for o in stepwise]
    assert [len(o.outputs[0].token_ids) for o in ahead] == [10, 12, 3, 9, 6]
    assert ahead[3].outputs[0].logprobs == stepwise[3].outputs[0].logprobs
    assert all_free(engine)


@pytest.mark.parametrize("mode", ["single", "pd"])
def test_multi_step_decode_gives_the_tokens_of_single_steps(mode):
    """num_scheduler_steps=4: while nothing waits and every row samples on the device alone, one program runs 4
    decode steps. Greedy and seeded sampling, lengths that are not multiples of 4, a stop token in the middle
    of a multi-step (the tokens after it dropped), a request with logprobs (its batch takes single steps) and
    one that waits for a seat give the tokens of single steps, and every page ends free."""
    reference = llm(mode)
    kw = {"pd": dict(mesh=8, prefill_devices=4), "single": {}}[mode]
    multi = LLM(golden_model(), **SMALL, **kw, num_scheduler_steps=4)
    prompts, params = MIXED_PROMPTS, mixed_params(10, 41, 14, 9, 6)
    want = [o.outputs[0].token_ids for o in reference.generate(prompt_token_ids=prompts, sampling_params=params)]
    stop = want[2][6]  # request 2 stops at its 7th token, inside a multi-step
    params[2] = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop_token_ids=[stop])
    want[2] = want[2][:want[2].index(stop) + 1]
    steps = []  # per decode dispatch: the decode steps its program runs
    for inst in multi.engine.instances:
        inst.runner.dispatch = lambda plan, d=inst.runner.dispatch: (
            plan.decode and steps.append(plan.decode_steps)) or d(plan)
    with jax.transfer_guard("disallow"):
        got = multi.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in got] == want
    assert steps.count(4) >= 3 and 1 in steps
    assert all_free(multi.engine)


def test_multi_step_decode_under_preemption_matches_single_steps():
    """Four requests with a seat each outgrow a small pool (preemptions by recompute) while they decode 4 steps a
    program; seeded sampling, stop tokens, logprobs and min_tokens among them: every request gets the tokens
    and finish reason of single steps, and every page ends free."""
    prompts = [[5, 9, 11, 13, 2, 8], [7, 3, 30, 31, 32, 33, 34, 35, 36, 37, 38], [21, 22, 23], [4, 40, 41, 42, 43]]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=44, ignore_eos=True, stop_token_ids=[7, 11]),
              SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.7, seed=5, max_tokens=42, min_tokens=9)]
    outs, preempted = {}, {}
    for steps in (1, 4):
        engine_llm = LLM(golden_model(), max_model_len=64, max_num_seqs=4, num_gpu_blocks_override=16, block_size=8,
                         num_scheduler_steps=steps)
        runner = engine_llm.engine.instances[0].runner
        runner.dispatch = lambda plan, d=runner.dispatch: (plan.decode and ran.append(plan.decode_steps)) or d(plan)
        ran = []  # per decode dispatch: its program's decode steps
        got = engine_llm.generate(prompt_token_ids=prompts, sampling_params=params)
        outs[steps] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got]
        preempted[steps] = sum(i.scheduler.num_preemptions for i in engine_llm.engine.instances)
        assert (4 in ran) == (steps == 4)
        assert all_free(engine_llm.engine)
    assert preempted[1] > 0 and preempted[4] > 0
    assert outs[4] == outs[1]


def test_sampling_without_logprobs_draws_the_same_tokens():
    """sample(token_logprobs=False), what a multi-step program runs: the same tokens, greedy and seeded, with
    zero logprobs and no vocabulary-wide log-softmax."""
    from ernie_jax.sampling import sample
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 300)).astype(np.float32))
    args = (jnp.asarray([0.0, 0.7, 1.0, 0.0], jnp.float32), jnp.asarray([1.0, 0.9, 1.0, 1.0], jnp.float32),
            jnp.asarray([0, 0, 5, 0], jnp.int32), jnp.asarray([1, 2, 3, 4], jnp.uint32), jnp.asarray([0, 3, 7, 1], jnp.int32))
    with_lps, without = sample(logits, *args), sample(logits, *args, token_logprobs=False)
    np.testing.assert_array_equal(with_lps[0], without[0])
    assert not np.asarray(without[1]).any() and np.asarray(with_lps[1]).all()
    assert "log_softmax" not in jax.jit(lambda x: sample(x, *args, token_logprobs=False)).lower(logits).as_text()


def test_pd_prefills_a_burst_of_prompts_in_batches():
    engine_llm = llm("pd")
    engine = engine_llm.engine
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(1, 30, 6)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prefiller = programs(engine, "prefill")
    shapes, run = [], prefiller.run
    prefiller.run = lambda kind, ids, *a: kind == "prefill" and shapes.append(ids.shape) or run(kind, ids, *a)
    try:
        outs = engine_llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    finally:
        del prefiller.run
    assert any(B > 1 for B, _ in shapes)  # several prompts shared one prefill program on the prefill submesh
    alone = llm("single").generate(prompt_token_ids=prompts, sampling_params=sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert all_free(engine)


def test_64_concurrent_requests_more_than_the_cache_holds():
    model = golden_model()
    # 10 pages of 16 slots: at most 2-3 requests fit at once, the rest wait for pages.
    busy = LLM(model, max_model_len=64, max_num_seqs=4, num_gpu_blocks_override=11)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(1, 40, 64)]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(1, 20, 64)]
    colocated = programs(busy.engine)
    shapes, run = [], colocated.run
    colocated.run = lambda kind, ids, *a: kind == "prefill" and shapes.append(ids.shape) or run(kind, ids, *a)
    together = busy.generate(prompt_token_ids=prompts, sampling_params=params)
    assert any(B > 1 for B, _ in shapes)  # admitted prompts were prefilled together (a batched program)
    alone_llm = llm("single")
    for p, sp, out in zip(prompts, params, together):
        alone = alone_llm.generate(prompt_token_ids=[p], sampling_params=sp)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == sp.max_tokens
    assert all_free(busy.engine) and not busy.engine.requests


def test_bad_requests_keep_the_engine_serving():
    engine_llm = llm("single")
    with pytest.raises(RequestError, match="empty"):
        engine_llm.generate(prompt_token_ids=[[]])
    with pytest.raises(RequestError, match="max_model_len is 64"):
        engine_llm.generate(prompt_token_ids=[list(range(3, 80))])
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=1.2)
    engine = engine_llm.engine
    ok = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request([5, 6, 7], SamplingParams(), request_id=ok)
    req = engine.requests[ok]
    engine.run_until_done([ok])
    assert len(req.output_ids) == 3 and req.finish_reason == "length"


def test_every_request_value_is_checked_before_it_reaches_a_step():
    """Out-of-range values are refused naming the field, by SamplingParams and again by the engine (a field
    changed after construction); 64-bit seeds work and keep 32-bit seeds' streams; a temperature too small
    for f32 logits samples greedily."""
    from ernie_jax.sampling import MAX_SEED, MIN_SEED, sampler_seed
    for field, value in [("seed", 2**80), ("seed", -2**63 - 1), ("temperature", float("nan")),
                         ("temperature", float("inf")), ("top_k", 2**31), ("repetition_penalty", 1e39),
                         ("logit_bias", {5: float("nan")}), ("stop", [5]), ("stop_token_ids", ["a"]),
                         ("max_tokens", True), ("n", 1.0)]:
        with pytest.raises(SamplingParamsError, match=f"^SamplingParams.{field}="):
            SamplingParams(**{field: value})
    engine_llm = llm("single")
    sp = SamplingParams(temperature=1.0, max_tokens=3)
    sp.seed = 2**80  # after construction: the engine checks again
    with pytest.raises(RequestError, match="seed") as e:
        engine_llm.engine.add_request([5, 6, 7], sp)
    assert e.value.param == "seed"
    with pytest.raises(RequestError, match="min_tokens") as e:
        engine_llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=None, min_tokens=10**6))
    assert e.value.param == "min_tokens"
    assert sampler_seed(7) == 7 and sampler_seed(-1) == sampler_seed(MAX_SEED) and 0 <= sampler_seed(MIN_SEED) < 2**32
    assert SamplingParams(seed=MAX_SEED, n=2).for_sample(1).seed == 0  # wraps within 64 bits

    def run(**kw):
        return engine_llm.generate(prompt_token_ids=[[7, 8, 9]], sampling_params=SamplingParams(
            max_tokens=6, ignore_eos=True, **kw))[0].outputs[0].token_ids
    big = run(temperature=1.0, seed=2**63 + 5)
    assert big == run(temperature=1.0, seed=2**63 + 5) and big != run(temperature=1.0, seed=5)
    assert run(temperature=1e-30) == run(temperature=0)
    assert all_free(engine_llm.engine)


def test_abort_frees_pages_at_once():
    engine = llm("single").engine
    rid = engine.add_request(list(range(3, 30)), SamplingParams(temperature=0, max_tokens=30))
    req = engine.requests[rid]
    engine.step()
    engine.step()
    assert engine.pools["mixed"].free < engine.pools["mixed"].capacity
    engine.abort(rid)
    assert req.finish_reason == "abort" and all_free(engine)
    assert not engine.has_unfinished()


def test_sampling_controls_logprobs_and_penalties():
    engine_llm = llm("single")
    prompt = [[7, 8, 9, 10]]
    out = engine_llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5 and all(len(lp["top"]) == 3 for lp in out.logprobs)
    assert all(lp["top"][0][0] == lp["token"] and abs(lp["top"][0][1] - lp["logprob"]) < 1e-5 for lp in out.logprobs)
    greedy = out.token_ids
    penalised = engine_llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, repetition_penalty=10.0, frequency_penalty=2.0))
    assert len(set(penalised[0].outputs[0].token_ids)) == 5  # no token repeats under heavy penalties
    assert greedy != penalised[0].outputs[0].token_ids or len(set(greedy)) == 5
    seeded = [engine_llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=1.0, top_p=0.9, min_p=0.05, max_tokens=6, seed=11, ignore_eos=True))[0].outputs[0].token_ids
        for _ in range(2)]
    assert seeded[0] == seeded[1]
    two = engine_llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=1.0, max_tokens=6, seed=3, n=2, ignore_eos=True))[0]
    assert len(two.outputs) == 2 and two.outputs[0].token_ids != two.outputs[1].token_ids
    # min_tokens: a stop token cannot end the output early
    stop_at = greedy[0]
    out = engine_llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=5, min_tokens=3, stop_token_ids=[stop_at]))[0].outputs[0]
    assert len(out.token_ids) >= 3 and stop_at not in out.token_ids[:3]


def test_async_engine_streams_and_aborts():
    engine = llm("single").engine
    runner = AsyncEngine(engine)

    async def main():
        stream = runner.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        seen = [out async for out in stream]
        assert [len(o.outputs[0].token_ids) for o in seen] == list(range(1, 7)) and seen[-1].finished
        long = runner.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        first = await long.__anext__()
        await long.aclose()  # the consumer leaves: the request is aborted and its pages freed
        for _ in range(100):
            if all_free(engine):
                break
            await asyncio.sleep(0.05)
        return first
    try:
        first = asyncio.run(main())
        assert len(first.outputs[0].token_ids) >= 1
        assert all_free(engine)
    finally:
        runner.shutdown()


@pytest.mark.parametrize("mode", ["single", "pd"])
def test_async_engine_takes_requests_during_a_step_and_survives_a_device_error(mode):
    """add_request returns while an instance thread is inside a (slowed) step; a step whose program fails
    after consuming the donated pool fails the requests that held pages there, the pool is rebuilt, and
    later requests get the tokens they would have got anyway."""
    from ernie_jax.engine.async_engine import EngineError

    engine = llm(mode).engine
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = llm("single").generate(prompt_token_ids=[[9, 8, 7]], sampling_params=sp)[0].outputs[0].token_ids
    runner = AsyncEngine(engine)
    in_step, state = threading.Event(), {"slow": True, "fail": False}

    def patch(programs):
        run = programs.run

        def patched(kind, *args):
            if state["slow"] and kind == "decode":
                state["slow"] = False
                in_step.set()
                time.sleep(1.0)
            out = run(kind, *args)
            if state["fail"] and kind == "decode":  # as a device-side failure leaves it: the donated pool is gone
                state["fail"] = False
                jax.tree.map(lambda a: a.delete(), programs.cache)
                raise RuntimeError("injected device failure")
            return out
        programs.run = patched

    async def main():
        first = runner.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        task = asyncio.ensure_future(_collect(first))
        while not in_step.is_set():
            await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        second = runner.add_request([9, 8, 7], sp)  # while the engine thread sleeps inside a decode step
        took = time.perf_counter() - t0
        assert (await task)[-1].finished and (await _collect(second))[-1].outputs[0].token_ids == expected
        state["fail"] = True
        with pytest.raises(EngineError, match="injected device failure"):
            await _collect(runner.add_request([4, 5, 6], sp))
        after = await _collect(runner.add_request([9, 8, 7], sp))
        return took, after[-1].outputs[0].token_ids
    for inst in engine.instances:
        patch(inst.programs)
    try:
        took, after = asyncio.run(main())
    finally:
        for inst in engine.instances:
            del inst.programs.run
        runner.shutdown()
    assert took < 0.2  # the step it overlapped sleeps 1 s
    assert after == expected
    assert all_free(engine) and not engine.requests


async def _collect(stream) -> list:
    return [out async for out in stream]


def test_a_step_that_fails_on_the_host_fails_only_its_requests_and_keeps_the_prefix_cache(caplog):
    """A prefill step whose program refuses its inputs before running leaves the pool intact: only that step's
    request fails; a stream decoding beside it ends with its own tokens, and a prompt cached before the
    failure still hits the prefix cache after it."""
    from ernie_jax.engine.async_engine import EngineError

    engine = llm("single").engine
    shared = list(range(3, 43))  # 40 tokens: two full pages of 16 to cache
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = llm("single").generate(prompt_token_ids=[[4, 5, 6]], sampling_params=sp)[0].outputs[0].token_ids
    programs_ = programs(engine)
    state = {"fail": False}
    run = programs_.run

    def patched(kind, *args):
        if state["fail"] and kind == "prefill":
            state["fail"] = False
            raise ValueError("injected: a prefill input the program refuses")
        return run(kind, *args)
    programs_.run = patched
    runner = AsyncEngine(engine)

    async def main():
        short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        await _collect(runner.add_request(shared + [50], short))  # its full pages go into the prefix cache
        streaming = runner.add_request([4, 5, 6], sp)
        first = await streaming.__anext__()  # decoding now
        state["fail"] = True
        with pytest.raises(EngineError, match="injected"):
            await _collect(runner.add_request([9, 8, 7, 6], short))
        rest = await _collect(streaming)
        again = await _collect(runner.add_request(shared + [60], short))
        return [first] + rest, again[-1]
    try:
        outs, again = asyncio.run(main())
    finally:
        del programs_.run
        runner.shutdown()
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == expected
    assert again.num_cached_tokens == 32  # both full pages of the shared prefix, cached before the failure
    assert "failed the 1 requests of that step; its KV pool is intact" in caplog.text
    assert all_free(engine) and not engine.requests


def test_step_profile_times_the_host_parts_and_leaves_the_engine_as_it_was():
    """`bench step-profile`'s measurement: its timers wrap the instance's methods from outside and are
    removed after; every part is timed, the decode program alone too, and every page is free again."""
    from ernie_jax.bench.step_profile import PARTS, profile
    engine_llm = llm("single")
    inst = engine_llm.engine.instances[0]
    before = (vars(inst.scheduler).copy(), vars(inst.runner).copy(), vars(inst.programs).copy())
    r = profile(engine_llm, streams=2, steps=3, prompt_len=8)
    assert r["streams"] == 2 and r["wall"] > 0 and r["device"] > 0 and r["tok_s"] > 0
    assert all(r[k] >= 0 for k in PARTS) and r["launch"] > 0 and r["read"] > 0
    assert set(vars(inst.scheduler)) == set(before[0]) and set(vars(inst.runner)) == set(before[1])
    assert set(vars(inst.programs)) == set(before[2])  # no wrapper left behind
    assert all_free(engine_llm.engine)
