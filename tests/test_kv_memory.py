"""KV memory: pages on demand, preemption with recompute, automatic prefix caching, and what the server reports."""

import asyncio
import functools
import json

import httpx
import numpy as np
import pytest

from ernie_jax import LLM, RequestError, SamplingParams
from ernie_jax.assets import EMBEDDED_MODEL_DIR
from ernie_jax.engine.pages import PagePool, page_hashes
from tests.test_engine import golden_model

MODES = {"single": {}, "pd": dict(mesh=8, prefill_devices=4)}


@functools.lru_cache(maxsize=None)
def small_pool(mode: str = "single", kv: str = "auto") -> LLM:
    """21 pages of 16 tokens (336 tokens): three requests of ~100 tokens fit at once; max_model_len 512 is
    more than the pool holds, so a request that may reach it is rejected."""
    return LLM(golden_model(), max_model_len=512, max_num_seqs=8, num_gpu_blocks_override=22, max_num_batched_tokens=128,
               kv_cache_dtype=kv, **MODES[mode])


def no_leak(engine) -> None:
    for pool in engine.pools.values():
        pool.check()
        assert pool.free == pool.capacity
    assert not engine.has_unfinished() and not engine.requests


def set_caching(engine, on: bool) -> None:
    for pool in engine.pools.values():
        pool.enable_caching = on
        if on:
            pool.reset_cache()


def drive(engine, prompts, params) -> list:
    """Add every request, step to the end; checks each request's tokens only ever grow (nothing is taken
    back or sent twice, preempted or not). Returns the requests."""
    reqs = [engine.requests[engine.add_request(p, sp)] for p, sp in zip(prompts, params)]
    seen = {id(r): [] for r in reqs}
    while engine.has_unfinished():
        engine.step()
        for r in reqs:
            before = seen[id(r)]
            assert r.output_ids[:len(before)] == before
            seen[id(r)] = list(r.output_ids)
    return reqs


def long_requests(n: int = 8, prefix: list[int] | None = None):
    rng = np.random.default_rng(7)
    prompts = [(prefix or []) + rng.integers(3, 256, int(k)).tolist() for k in rng.integers(18, 30, n)]
    params = [SamplingParams(temperature=0, max_tokens=76, ignore_eos=True) for _ in range(n - 1)]
    params.append(SamplingParams(temperature=0.9, seed=5, max_tokens=76, ignore_eos=True))  # seeded sampling too
    return prompts, params


def test_page_pool_caches_reference_counts_and_evicts_lru():
    pool = PagePool(6, 4, enable_caching=True, salt=b"s")
    tokens = list(range(12))
    hashes = page_hashes(tokens, 4, b"s", [])
    assert len(hashes) == 3 and page_hashes(tokens, 4, b"s", hashes[:1]) == hashes
    assert page_hashes(tokens, 4, b"other", []) != hashes  # the salt (KV dtype, page size) is in the chain
    a = pool.allocate(3)
    for p, h in zip(a, hashes):
        pool.register(p, h)
    assert pool.lookup(hashes) == a and pool.lookup([hashes[0], b"x", hashes[2]]) == a[:1]
    pool.acquire(a[:2])  # a second request shares the first two pages
    pool.release(a)
    assert pool.free == 3 and pool.cached_free == 1  # page a[2] is free but still cached
    pool.release(a[:2])
    assert pool.free == 5 and pool.cached_free == 3
    pool.allocate(2)  # never-cached pages go first
    assert pool.cached == 3
    pool.allocate(1)  # then the least recently used cached page: the tail of the sequence
    assert pool.lookup(hashes) == a[:2] and pool.evictions == 1
    pool.check()
    with pytest.raises(ValueError, match="invalid pages"):
        pool.release([a[2], a[2]])


def test_preemption_recomputes_and_every_request_keeps_its_solo_tokens():
    """6 concurrent requests of ~100 tokens, a pool that holds 3: the latest admitted are preempted when the
    pool runs out, resumed by recomputing prompt + tokens so far, and all 6 end with their solo-run tokens."""
    llm = small_pool()
    engine = llm.engine
    prompts, params = long_requests(6)  # twice what the pool holds (8 before: the suite's time)
    set_caching(engine, False)
    solo = [drive(engine, [p], [sp])[0].output_ids for p, sp in zip(prompts, params)]
    set_caching(engine, True)
    before = engine.counter("num_preemptions")
    together = drive(engine, prompts, params)
    assert engine.counter("num_preemptions") > before
    assert any(r.num_preemptions for r in together)
    assert [r.output_ids for r in together] == solo
    assert all(len(r.output_ids) == 76 and r.finish_reason == "length" for r in together)
    no_leak(engine)


@pytest.mark.parametrize("mode,kv", [("single", "auto"), ("pd", "auto"), ("single", "fp8"), ("pd", "fp8")])
def test_greedy_unchanged_by_prefix_caching_and_preemption(mode, kv):
    """Requests sharing a 2-page prefix, concurrently under a pool too small for all of them (prefix cache
    on, preemptions), give the tokens of solo runs with the cache off."""
    engine = small_pool(mode, kv).engine
    prefix = np.random.default_rng(3).integers(3, 256, 32).tolist()
    prompts, params = long_requests(6, prefix)
    params = [SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)] * len(prompts)
    set_caching(engine, False)
    solo = [drive(engine, [p], [sp])[0].output_ids for p, sp in zip(prompts, params)]
    set_caching(engine, True)
    hits, preemptions = engine.counter("prefix_hits"), engine.counter("num_preemptions")
    together = drive(engine, prompts, params)
    assert [r.output_ids for r in together] == solo
    assert engine.counter("prefix_hits") - hits >= 32 * (len(prompts) - 1)
    assert engine.counter("num_preemptions") > preemptions
    no_leak(engine)


def test_shared_prefix_prefills_only_the_suffix_and_n_prefills_once():
    """A 160-token shared prefix (ten full pages, on the shared small-pool engine): the second prompt prefills
    only its 32-token suffix, with the tokens of an uncached run."""
    llm = small_pool()
    engine = llm.engine
    s = engine.instances[0].scheduler
    rng = np.random.default_rng(11)
    system = rng.integers(3, 256, 160).tolist()
    first, second = (system + rng.integers(3, 256, 32).tolist() for _ in range(2))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    computed = s.prefill_tokens
    llm.generate(prompt_token_ids=[first], sampling_params=sp)
    assert s.prefill_tokens - computed == 192
    computed = s.prefill_tokens
    cached = llm.generate(prompt_token_ids=[second], sampling_params=sp)[0]
    assert s.prefill_tokens - computed == 32 and cached.num_cached_tokens == 160  # only the suffix
    s.pool.enable_caching = False
    uncached = llm.generate(prompt_token_ids=[second], sampling_params=sp)[0]
    assert cached.outputs[0].token_ids == uncached.outputs[0].token_ids
    s.pool.enable_caching = True

    # n=4 of a new prompt: one prefill; each other sample recomputes only the prompt's last page (its first
    # token's logits), waiting for the first sample's pages rather than computing them alongside.
    prompt = rng.integers(3, 256, 192).tolist()
    computed = s.prefill_tokens
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        n=4, temperature=0.8, seed=1, max_tokens=6, ignore_eos=True))[0]
    assert s.prefill_tokens - computed == 192 + 3 * 16
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds 1..4: the samples differ
    no_leak(engine)


def test_server_rejects_a_request_longer_than_the_pool_and_reports_the_cache():
    """Through the OpenAI routes (in process): a request that may outgrow the whole KV pool gets a 400 that
    says so, the engine keeps serving, a repeated prompt reports its cached tokens, and the metrics count
    prefix hits and preemptions."""
    from ernie_jax.engine.async_engine import AsyncEngine
    from ernie_jax.serve.api import Server, create_app
    from ernie_jax.serve.metrics import ServerMetrics
    from ernie_jax.tokenizer import Tokenizer

    llm = small_pool()
    engine = llm.engine
    with pytest.raises(RequestError, match="more than the whole KV pool holds"):
        engine.add_request([5] * 20, SamplingParams(max_tokens=None))  # may grow to max_model_len 512
    metrics = ServerMetrics(engine.stats, "tiny")
    runner = AsyncEngine(engine, on_finish=metrics.on_finish)
    server = Server(runner, Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR), "tiny", {}, metrics)
    app = create_app(server)
    prompt = list(range(3, 43))  # 40 tokens: two full pages to cache

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"prompt": [5] * 300, "max_tokens": 100})
            assert r.status_code == 400 and "KV pool" in r.json()["error"]["message"], r.text
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
            a = (await c.post("/v1/completions", json=body)).json()
            b = (await c.post("/v1/completions", json=body)).json()
            assert a["choices"][0]["text"] == b["choices"][0]["text"]
            assert a["usage"]["prompt_tokens_details"]["cached_tokens"] in (0, 32)  # 32 if run after other tests
            assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 32

            async def stream(i):  # 8 concurrent streams the pool holds 3 of: preemptions mid-stream
                body = {"prompt": list(range(3 + i, 27 + i)), "max_tokens": 70, "temperature": 0, "stream": True,
                        "logprobs": 0, "ignore_eos": True}
                tokens = []
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            tokens += json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]
                full = (await c.post("/v1/completions", json={**body, "stream": False})).json()
                return tokens, full["choices"][0]["logprobs"]["tokens"]
            preempted = engine.counter("num_preemptions")
            for streamed, collected in await asyncio.gather(*(stream(i) for i in range(8))):
                assert streamed == collected and len(streamed) == 70  # each token exactly once
            assert engine.counter("num_preemptions") > preempted
            return (await c.get("/metrics")).text
    try:
        text = asyncio.run(run())
    finally:
        runner.shutdown()
    values = {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                       if line.startswith("ernie_jax:"))}
    assert values['ernie_jax:prefix_cache_hits_total{model_name="tiny"}'] >= 32
    assert values['ernie_jax:prefix_cache_queries_total{model_name="tiny"}'] >= 80
    assert 'ernie_jax:num_preemptions_total{model_name="tiny"}' in values
    assert values['ernie_jax:kv_cache_cached_free_perc{model_name="tiny",pool="mixed"}'] > 0
    assert values['ernie_jax:kv_cache_usage_perc{model_name="tiny",pool="mixed"}'] == 0  # nothing held
    no_leak(engine)


def test_pool_is_sized_from_device_memory_where_devices_report_it():
    from ernie_jax.engine.pool_sizing import pages_in_memory

    class Device:
        process_index = 0

        def __init__(self, stats):
            self.memory_stats = lambda: stats
    gpus = [Device({"bytes_limit": 100_000, "bytes_in_use": 40_000}), Device({"bytes_limit": 100_000,
                                                                             "bytes_in_use": 50_000})]
    assert pages_in_memory(gpus, 1_000, 0.9) == 40  # the fullest device decides: 0.9 x 100k - 50k
    assert pages_in_memory(gpus, 1_000, 0.4) == 0
    assert pages_in_memory([Device(None)], 1_000, 0.9) is None  # XLA:CPU reports no limit
    assert pages_in_memory(gpus, 1_000, 0.9, reserve=20_000) == 20  # less the programs' temporaries
    with pytest.raises(ValueError, match="report no memory limit"):
        LLM(golden_model(), max_model_len=64, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        LLM(golden_model(), max_model_len=64, gpu_memory_utilization=1.5)


def test_pool_leaves_room_for_the_heaviest_programs_temporaries(monkeypatch):
    """Sized from device memory, the pool leaves room for what the instance's heaviest programs (the prefill
    bucket with the most tokens, the largest decode batch) allocate while they run: XLA's temporaries, from a
    compile against a probe pool. On an H200 a 21B-A3B pool that took 0.9 of the memory beside the weights
    left its first prefill 25.8 GiB short."""
    from ernie_jax.engine import pool_sizing
    from ernie_jax.engine.config import CacheConfig
    from ernie_jax.engine.programs import ModelPrograms, compile_startup
    seen = {}
    real = pool_sizing.pages_in_memory

    def pages_in_memory(devices, page_bytes, utilization, reserve=0):
        seen.update(page_bytes=page_bytes, reserve=reserve)
        return real(devices, page_bytes, utilization, reserve)
    monkeypatch.setattr(pool_sizing, "memory_stats", lambda devices: [{"bytes_limit": 2**26, "bytes_in_use": 0}])
    monkeypatch.setattr(pool_sizing, "pages_in_memory", pages_in_memory)
    programs = ModelPrograms(golden_model(), "mixed", CacheConfig(), max_pages_per_seq=4,
                             prefill_buckets=[(1, 16), (4, 16)], decode_buckets=[1, 2])
    compile_startup([programs])
    temps = {key: exe.memory_analysis().temp_size_in_bytes for key, exe in programs._programs.items()}  # startup
    temps[("prefill", 4, 16)] = programs._lower(("prefill", 4, 16)).compile().memory_analysis().temp_size_in_bytes
    assert seen["reserve"] == max(temps[("prefill", 4, 16)], temps[("decode", 2, 1)]) > temps[("prefill", 1, 16)]
    assert programs.num_pages == int((0.9 * 2**26 - seen["reserve"]) // seen["page_bytes"])
    assert "temporaries" in programs.pool_sizing
