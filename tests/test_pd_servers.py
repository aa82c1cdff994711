"""Prefill and decode on different server processes behind the router (`--pd-role prefill|decode`,
`python -m ernie_jax.router`), 4 fake CPU devices each, on loopback: the prompt's KV moves between the
processes through jax.experimental.transfer (engine/kv_connector.py)."""

import json
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from ernie_jax.assets import EMBEDDED_MODEL_NAME
from tests.serving import (AUTH, KEY, ROOT, free_port, launch, metric, metrics, prompt_burst, running_servers,
                           taken_whole, wait_healthy, wait_idle)

# Every program compiled before "ready": a background compile beside the tests (lowering holds the GIL) can
# delay a server's answers and heartbeats by seconds on 2 busy cores.
COMMON = ["--mesh", "4", "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
          "--batch-invariant", "--no-background-compile"]
PROMPTS = ["The sea is", "说说曹操。", "Tell me about the mountains and the rivers of"]
EXPIRY = 8  # seconds the prefill server keeps an unpulled prompt's KV (the router's pulls come within ms)


@pytest.fixture(scope="module")
def cluster():
    """A router started with no servers, and a prefill and a decode server that register with it."""
    router = launch("ernie_jax.router", ["--api-key", KEY, "--heartbeat", "3"])
    join = ["--router", router["url"]]
    try:
        with running_servers([COMMON + join + ["--pd-role", "prefill", "--kv-expiry-seconds", str(EXPIRY)],
                              COMMON + join + ["--pd-role", "decode"]]) as (p, d):
            deadline = time.time() + 60
            while metric(metrics(router["url"]), "ernie_jax_router:up") < 2:
                assert time.time() < deadline, "the servers did not register with the router"
                time.sleep(0.5)
            yield {"prefill": p, "decode": d, "router": router}
    finally:
        router["proc"].kill()
        router["proc"].wait()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def test_greedy_through_the_router_equals_one_server(cluster):
    routed, direct = _client(cluster["router"]["url"]), _client(cluster["decode"]["url"])
    kw = dict(model=EMBEDDED_MODEL_NAME, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    for prompt in PROMPTS:
        want = direct.completions.create(prompt=prompt, **kw).choices[0].text  # the decode server alone
        got = routed.completions.create(prompt=prompt, **kw)
        assert got.choices[0].text == want and got.usage.completion_tokens == 12
        streamed = "".join(c.choices[0].text for c in routed.completions.create(prompt=prompt, stream=True, **kw)
                           if c.choices)
        assert streamed == want
    messages = [{"role": "user", "content": "你好，介绍一下你自己"}]
    want = direct.chat.completions.create(messages=messages, **kw).choices[0].message.content
    assert routed.chat.completions.create(messages=messages, **kw).choices[0].message.content == want
    # what moved: every split request's KV was exported, offered and pulled once, and nothing stays held
    info = httpx.get(cluster["prefill"]["url"] + "/v1/pd/info", headers=AUTH, timeout=30).json()
    pulled = httpx.get(cluster["decode"]["url"] + "/v1/pd/info", headers=AUTH, timeout=30).json()["transfers"]
    assert info["transfers"]["exported"] == info["transfers"]["offered"] == pulled["pulled"] == 2 * len(PROMPTS) + 1
    assert info["transfers"]["kept"] == 0 and pulled["recomputed"] == 0 and pulled["bytes"] > 0
    # the embedded model's 2 KV heads do not split over 4 devices (each holds a replica), so every batch crossed
    # on one device (test_pages_cross_shard_by_shard_between_pools_laid_out_alike has the other path)
    assert info["transfers"]["offered_sharded"] == pulled["pulled_sharded"] == 0
    assert metric(metrics(cluster["router"]["url"]), "ernie_jax_router:requests_total", path="split") == 7
    for role in ("prefill", "decode"):
        wait_idle(cluster[role]["url"])  # every KV page free again on both servers


def test_a_constrained_request_split_across_servers_validates(cluster):
    """The prefill server samples the first token under the request's JSON schema, the decode server's matcher
    starts from it: the split reply validates and equals the decode server's own."""
    import jsonschema
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["word", "n"], "additionalProperties": False}
    kw = dict(model=EMBEDDED_MODEL_NAME, max_tokens=40, temperature=0, messages=[{"role": "user", "content": "JSON"}],
              response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    split_before = metric(metrics(cluster["router"]["url"]), "ernie_jax_router:requests_total", path="split")
    got = _client(cluster["router"]["url"]).chat.completions.create(**kw).choices[0].message.content
    assert metric(metrics(cluster["router"]["url"]), "ernie_jax_router:requests_total", path="split") == split_before + 1
    jsonschema.validate(json.loads(got), schema)
    assert got == _client(cluster["decode"]["url"]).chat.completions.create(**kw).choices[0].message.content
    for role in ("prefill", "decode"):
        wait_idle(cluster[role]["url"])


def test_samples_and_prompt_lists_split_per_sample_and_merge_into_one_servers_answer(cluster):
    """n > 1 and a prompt list through the router: one split request per prompt and sample (seeded sample j
    carries seed + j, as a server seeds its own samples), merged into the answer one server gives: the same
    texts at the same choice indices, usage counting each prompt once, one id; streamed as well."""
    r, d = cluster["router"]["url"], cluster["decode"]["url"]
    kw = dict(model=EMBEDDED_MODEL_NAME, max_tokens=8, temperature=1.0, seed=7, n=2, extra_body={"ignore_eos": True})
    count = lambda path: metric(metrics(r), "ernie_jax_router:requests_total", path=path)  # noqa: E731
    split, fanned = count("split"), count("fanned_out")
    want = _client(d).completions.create(prompt=PROMPTS[:2], **kw)  # the decode server alone
    got = _client(r).completions.create(prompt=PROMPTS[:2], **kw)
    assert [(c.index, c.text) for c in got.choices] == [(c.index, c.text) for c in want.choices]
    assert got.choices[0].text != got.choices[1].text  # each sample has its own seed
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens, 32)
    texts, ids, usage = {}, set(), None
    for chunk in _client(r).completions.create(prompt=PROMPTS[:2], stream=True,
                                               stream_options={"include_usage": True}, **kw):
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in want.choices} and len(ids) == 1
    assert (usage.prompt_tokens, usage.completion_tokens) == (want.usage.prompt_tokens, 32)
    messages = [{"role": "user", "content": "你好"}]
    want = _client(d).chat.completions.create(messages=messages, **kw)
    got = _client(r).chat.completions.create(messages=messages, **kw)
    assert [c.message.content for c in got.choices] == [c.message.content for c in want.choices]
    assert count("split") == split + 10 and count("fanned_out") == fanned + 3
    for bad in ({"n": 17}, {"temperature": -1}):  # more samples than the servers take; a bad field in every part
        body = {"model": EMBEDDED_MODEL_NAME, "prompt": PROMPTS[:2], "n": 2, **bad}
        refused = httpx.post(r + "/v1/completions", json=body, headers=AUTH, timeout=30)
        assert refused.status_code == 400
        assert refused.json() == httpx.post(d + "/v1/completions", json=body, headers=AUTH, timeout=30).json()
    for role in ("prefill", "decode"):
        wait_idle(cluster[role]["url"])


def test_pages_the_decode_servers_prefix_cache_holds_are_not_pulled(cluster):
    """A prompt the decode server has served (its prefix cache holds the full pages) pulls only the rest."""
    r, p, d = cluster["router"]["url"], cluster["prefill"]["url"], cluster["decode"]["url"]
    prompt = " ".join(["The sea is wide and the rivers run into it from the mountains."] * 6)
    kw = dict(model=EMBEDDED_MODEL_NAME, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    want = _client(d).completions.create(prompt=prompt, **kw).choices[0].text  # the decode server caches it
    before = httpx.get(d + "/v1/pd/info", headers=AUTH, timeout=30).json()["transfers"]
    assert _client(r).completions.create(prompt=prompt, **kw).choices[0].text == want
    after = httpx.get(d + "/v1/pd/info", headers=AUTH, timeout=30).json()["transfers"]
    skipped = httpx.get(p + "/v1/pd/info", headers=AUTH, timeout=30).json()["transfers"]["skipped_pages"]
    assert after["pulled"] == before["pulled"] + 1 and after["reused_pages"] - before["reused_pages"] >= 3
    assert skipped >= after["reused_pages"] - before["reused_pages"]
    wait_idle(d)
    wait_idle(p)


def test_requests_the_roles_cannot_take_are_refused_naming_the_field(cluster):
    d, p = cluster["decode"]["url"], cluster["prefill"]["url"]
    body = {"model": EMBEDDED_MODEL_NAME, "prompt": "The sea is", "max_tokens": 4}
    r = httpx.post(d + "/v1/completions", headers=AUTH, timeout=30, json={**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "--pd-role prefill" in r.json()["error"]["message"]
    layout = httpx.get(p + "/v1/pd/info", headers=AUTH, timeout=30).json()["kv_layout"]
    other = {**layout, "block_size": layout["block_size"] * 2}
    kv = {"do_remote_prefill": True, "kv_layout": other, "remote_request_id": "x", "remote_url": p,
          "first_token_id": 1, "num_prompt_tokens": 3, "remote_num_pages": 1}
    r = httpx.post(d + "/v1/completions", headers=AUTH, timeout=30, json={**body, "kv_transfer_params": kv})
    assert r.status_code == 400 and "block size" in r.json()["error"]["message"]
    r = httpx.post(p + "/v1/pd/kv/offer", headers=AUTH, timeout=30, json={"request_id": "no-such-request"})
    assert r.status_code == 404 and "no-such-request" in r.json()["error"]["message"]
    assert httpx.get(d + "/health", timeout=30).status_code == 200 and httpx.get(p + "/health", timeout=30).status_code == 200


def test_kv_not_pulled_in_time_expires_and_its_pages_are_free(cluster):
    p = cluster["prefill"]["url"]
    before = httpx.get(p + "/v1/pd/info", headers=AUTH, timeout=30).json()["transfers"]
    r = httpx.post(p + "/v1/completions", headers=AUTH, timeout=30, json={
        "model": EMBEDDED_MODEL_NAME, "prompt": "The sea is", "max_tokens": 1, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": {"do_remote_decode": True}})
    kv = r.json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] and kv["remote_num_pages"] >= 1 and kv["num_prompt_tokens"] > 0
    assert httpx.get(p + "/v1/pd/info", headers=AUTH, timeout=30).json()["transfers"]["kept"] == 1
    wait_idle(p)  # the pool's pages are free at once: the kept KV is a copy
    time.sleep(EXPIRY + 1)
    after = httpx.get(p + "/v1/pd/info", headers=AUTH, timeout=30).json()["transfers"]
    assert after["expired"] == before["expired"] + 1 and after["kept"] == 0
    r = httpx.post(p + "/v1/pd/kv/offer", headers=AUTH, timeout=30, json={"request_id": kv["remote_request_id"]})
    assert r.status_code == 404 and "expired" in r.json()["error"]["message"]


def test_a_server_switches_its_role_through_the_router_and_back(cluster):
    """POST /pd_role_switch drains the prefill server and makes it a decode server (weights, programs and pool
    kept): with no prefill server the router serves requests whole; switched back, it splits them again."""
    r, p, d = cluster["router"]["url"], cluster["prefill"]["url"], cluster["decode"]["url"]
    kw = dict(model=EMBEDDED_MODEL_NAME, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    want = _client(d).completions.create(prompt=PROMPTS[1], **kw).choices[0].text
    count = lambda path: metric(metrics(r), "ernie_jax_router:requests_total", path=path)  # noqa: E731
    switched = httpx.post(r + "/pd_role_switch", json={"url": p, "role": "decode"}, headers=AUTH, timeout=120)
    assert switched.status_code == 200 and switched.json()["previous"] == "prefill", switched.text
    assert httpx.get(p + "/v1/pd/info", headers=AUTH, timeout=30).json()["role"] == "decode"
    whole = count("whole")
    assert _client(r).completions.create(prompt=PROMPTS[1], **kw).choices[0].text == want
    assert count("whole") == whole + 1
    bad = httpx.post(p + "/v1/completions", headers=AUTH, timeout=30, json={"model": EMBEDDED_MODEL_NAME, "prompt": "x",
                                                                "kv_transfer_params": {"do_remote_decode": True}})
    assert bad.status_code == 400 and "--pd-role prefill" in bad.json()["error"]["message"]
    back = httpx.post(r + "/pd_role_switch", json={"url": p, "role": "prefill"}, headers=AUTH, timeout=120)
    assert back.status_code == 200 and back.json()["previous"] == "decode", back.text
    split = count("split")
    assert _client(r).completions.create(prompt=PROMPTS[1], **kw).choices[0].text == want
    assert count("split") == split + 1
    wrong = httpx.post(r + "/pd_role_switch", json={"url": p, "role": "sometimes"}, headers=AUTH, timeout=30)
    assert wrong.status_code == 400 and "role 'sometimes'" in wrong.text


def test_the_router_refuses_a_server_in_another_role(cluster):
    p = cluster["prefill"]["url"]
    out = subprocess.run([sys.executable, "-m", "ernie_jax.router", "--prefill", p, "--decode", p, "--api-key", KEY,
                          "--port", "0"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode != 0 and f"{p} serves as 'prefill', not as 'decode'" in out.stderr


def test_a_decode_server_killed_mid_stream_fails_its_stream_and_a_restarted_one_rejoins():
    """Its own servers: the decode server is killed while streaming; the stream ends with an error event, the
    router keeps serving (the prefill server takes whole requests), and a decode server restarted on the same
    port is routed to again once the router's heartbeat sees it."""
    port = free_port()
    join = ["--router", f"http://127.0.0.1:{port}"]  # the router starts once the servers are up and lists them
    with running_servers([COMMON + join + ["--pd-role", "prefill"], COMMON + join + ["--pd-role", "decode"]]) as (p, d):
        router = launch("ernie_jax.router", ["--prefill", p["url"], "--decode", d["url"], "--api-key", KEY,
                                             "--heartbeat", "1"], port=port)
        try:
            wait_healthy(router, time.time() + 60)
            client = _client(router["url"])
            kw = dict(model=EMBEDDED_MODEL_NAME, temperature=0, extra_body={"ignore_eos": True})
            stream = client.completions.create(prompt="The sea is", max_tokens=200, stream=True, **kw)
            with pytest.raises(openai.APIError, match="failed mid-stream"):
                for i, _ in enumerate(stream):
                    if i == 2:
                        d["proc"].kill()
            want = _client(p["url"]).completions.create(prompt=PROMPTS[0], max_tokens=8, **kw).choices[0].text
            assert client.completions.create(prompt=PROMPTS[0], max_tokens=8, **kw).choices[0].text == want
            assert httpx.get(router["url"] + "/health", timeout=30).status_code == 200
            wait_idle(p["url"])
            d2 = launch("ernie_jax.serve", COMMON + join + ["--pd-role", "decode"], port=int(d["url"].rsplit(":", 1)[1]))
            try:
                wait_healthy(d2, time.time() + 300)
                deadline = time.time() + 30
                while metric(metrics(router["url"]), "ernie_jax_router:up", role="decode") < 1:
                    assert time.time() < deadline, "the restarted decode server was not seen"
                    time.sleep(0.5)
                split = metric(metrics(router["url"]), "ernie_jax_router:requests_total", path="split")
                assert client.completions.create(prompt=PROMPTS[0], max_tokens=8, **kw).choices[0].text == want
                assert metric(metrics(router["url"]), "ernie_jax_router:requests_total", path="split") == split + 1
            finally:
                d2["proc"].kill()
        finally:
            router["proc"].kill()
            router["proc"].wait()


@pytest.mark.parametrize("variant", ["mtp", "fp8-kv", "meshes-4-2"])
def test_split_with_mtp_fp8_kv_and_different_meshes(variant):
    """MTP (drafts cross with the first token), FP8 KV (scales cross with the pages), and a decode mesh of
    another size (the KV is resharded on arrival): greedy through the router equals the decode server alone
    (with different meshes, the same first token and a whole answer: the prompt's KV comes from another mesh's
    arithmetic)."""
    extra = {"mtp": ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
             "fp8-kv": ["--kv-cache-dtype", "fp8"], "meshes-4-2": []}[variant]
    decode_mesh = ["--mesh", "2"] if variant == "meshes-4-2" else []
    port = free_port()
    join = ["--router", f"http://127.0.0.1:{port}"]
    with running_servers([COMMON + extra + join + ["--pd-role", "prefill"],
                          COMMON + extra + join + decode_mesh + ["--pd-role", "decode"]]) as (p, d):
        router = launch("ernie_jax.router", ["--prefill", p["url"], "--decode", d["url"], "--api-key", KEY], port=port)
        try:
            wait_healthy(router, time.time() + 60)
            kw = dict(model=EMBEDDED_MODEL_NAME, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
            for prompt in PROMPTS:
                want = _client(d["url"]).completions.create(prompt=prompt, **kw).choices[0]
                got = _client(router["url"]).completions.create(prompt=prompt, **kw)
                if variant == "meshes-4-2":
                    assert got.usage.completion_tokens == 12
                    first = _client(p["url"]).completions.create(prompt=prompt, **{**kw, "max_tokens": 1})
                    assert got.choices[0].text.startswith(first.choices[0].text)
                else:
                    assert got.choices[0].text == want.text
            pulled = httpx.get(d["url"] + "/v1/pd/info", headers=AUTH, timeout=30).json()["transfers"]
            assert pulled["pulled"] == len(PROMPTS)
            assert pulled["pulled_sharded"] == 0  # the 4-device pool holds replicas: pages cross on one device
            wait_idle(p["url"])
            wait_idle(d["url"])
        finally:
            router["proc"].kill()
            router["proc"].wait()


def test_a_router_with_a_prefill_server_and_no_decode_server_says_so_and_serves_whole(cluster):
    """A role without its peer: the router names the missing role at start and serves requests whole on the
    prefill server (a role server is a whole engine), which leaves no KV waiting for a pull."""
    p = cluster["prefill"]["url"]
    router = launch("ernie_jax.router", ["--prefill", p, "--api-key", KEY])
    try:
        wait_healthy(router, time.time() + 60)
        body = {"model": EMBEDDED_MODEL_NAME, "prompt": "The sea is", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(router["url"] + "/v1/completions", headers=AUTH, timeout=60, json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert metric(metrics(router["url"]), "ernie_jax_router:requests_total", path="whole") == 1
        assert httpx.get(p + "/v1/pd/info", headers=AUTH, timeout=30).json()["transfers"]["kept"] == 0
    finally:
        router["proc"].kill()
        router["proc"].wait()
    with open(router["log"]) as f:
        assert "prefill servers and no decode server: requests are served whole" in f.read()


def test_a_role_server_without_a_router_is_refused_naming_the_flag():
    """--pd-role prefill|decode with no --router stops at once (before anything loads) naming the flag and
    what to do instead."""
    from ernie_jax.serve.cli import main
    for role in ("prefill", "decode"):
        with pytest.raises(SystemExit, match=f"--pd-role {role} needs --router URL.*--pd-role mixed"):
            main(["--pd-role", role])


def test_dynamic_roles_across_servers_take_a_prompt_burst_on_the_decode_servers():
    """1 prefill + 2 decode servers, one router per policy over the same servers: under a burst of prompts the
    dynamic router has the decode servers prefill some prompts whole (counted) and every request completes.
    The TTFT p50 of both routers in the same run is printed, not asserted (speed is for benchmarks: on 2 shared
    cores the servers' processes compete for the same cores; RESULTS.md has the runs)."""
    ports = {"static": free_port(), "dynamic": free_port()}
    join = ["--router", f"http://127.0.0.1:{ports['dynamic']}"]  # registered with one; the other lists them
    decode = COMMON + join + ["--mesh", "2", "--pd-role", "decode"]
    with running_servers([COMMON + join + ["--pd-role", "prefill"], decode, decode]) as (p, d1, d2):
        routers = {policy: launch("ernie_jax.router", ["--prefill", p["url"], "--decode", d1["url"], d2["url"],
                                                       "--api-key", KEY, "--pd-policy", policy], port=ports[policy])
                   for policy in ("static", "dynamic")}
        try:
            for r in routers.values():
                wait_healthy(r, time.time() + 60)
            ttft = {}
            for policy, r in routers.items():
                prompt_burst(r["url"], 2)  # warm: every server has served the shapes once
                ttft[policy] = float(np.median(prompt_burst(r["url"], 12)))
            whole_on_decode = taken_whole(routers["dynamic"]["url"], [d1["url"], d2["url"]])
            print(f"TTFT p50 of a 12-prompt burst: {ttft}; prompts the decode servers took whole: {whole_on_decode}")
            assert whole_on_decode > 0, metrics(routers["dynamic"]["url"])
        finally:
            for r in routers.values():
                r["proc"].kill()
                r["proc"].wait()


def test_a_kv_transfer_port_in_use_stops_the_server_naming_the_flag():
    """A prefill server whose --kv-transfer-address port is taken exits 1 with the flag and the address in its
    message, leaving nothing running."""
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        server = launch("ernie_jax.serve", COMMON + ["--router", "http://127.0.0.1:9", "--pd-role", "prefill",
                                                     "--kv-transfer-address",
                                                     f"127.0.0.1:{port}"])
        try:
            assert server["proc"].wait(timeout=300) == 1
        finally:
            if server["proc"].poll() is None:
                server["proc"].kill()
    with open(server["log"]) as f:
        log = f.read()
    assert f"--kv-transfer-address: cannot start the KV transfer server at 127.0.0.1:{port}" in log, log[-2000:]
    assert "Address already in use" in log


def test_pages_cross_shard_by_shard_between_pools_laid_out_alike_else_on_one_device():
    """Two transfer servers in this process, no engine: a prompt's pages exported from a pool on 2 devices
    (its KV heads split, one per device) enter a pool laid out alike shard by shard, and a pool on 4 devices
    (KV heads replicated: replicas are never sent) through one device; both land exactly where they were
    sent, after the pages the receiver already holds are skipped."""
    import types

    import jax

    from ernie_jax.engine.config import CacheConfig
    from ernie_jax.engine.kv_connector import KVExporter, KVImporter
    from ernie_jax.engine.programs import ModelPrograms
    from ernie_jax.sharding import ShardingPlan, make_mesh
    from tests.test_engine import golden_model

    devices = jax.devices()

    def programs(mesh: str, devs):
        model = golden_model().shard(ShardingPlan.create(make_mesh(mesh, devs)))
        return ModelPrograms(model, "x", CacheConfig(num_gpu_blocks_override=8), max_pages_per_seq=4,
                             prefill_buckets=[], decode_buckets=[], startup_kinds=())
    src = programs("data=1,expert=1,tensor=2", devices[:2])
    rng = np.random.default_rng(0)
    src.cache = jax.tree.map(lambda a, s: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), s),
                             src.cache, src.cache_shardings)
    exporter = KVExporter(src)
    req = types.SimpleNamespace(request_id="r", output_ids=[7], logprobs=[], drafts=None, prompt_ids=[3] * 40)
    for mesh, devs, sharded in (("data=1,expert=1,tensor=2", devices[2:4], True),
                                ("data=1,expert=1,tensor=4", devices[4:8], False)):
        dst = programs(mesh, devs)
        importer = KVImporter(dst)
        assert (importer.layout.shards == exporter.layout.shards) is sharded and importer.layout.mismatch(exporter.layout) is None
        exporter.export(req, [1, 2, 3])
        offer = exporter.offer("r", skip=1, shards=importer.layout.shards)  # the receiver holds the first page
        assert offer["sharded"] is sharded and offer["num_pages"] == 2
        batch = importer.pull(offer)
        importer.scatter(batch, [5, 6])
        for a, b in zip(jax.tree.leaves(src.cache), jax.tree.leaves(dst.cache)):
            np.testing.assert_array_equal(np.asarray(b)[:, [5, 6]], np.asarray(a)[:, [2, 3]])
            assert not np.asarray(b)[:, [1, 2, 3, 4, 7]].any()  # nothing else written
        assert importer.sharded == int(sharded) and importer.pulled == 1


def test_the_router_admits_servers_whose_kv_fits_whatever_their_meshes_and_refuses_another_model():
    """The router's check of a server's /v1/pd/info against the others (no server started): another model is
    refused naming both, another KV layout naming the field that differs; a pool laid out on another mesh
    (its `shards`) is admitted, since pages then cross on one device."""
    from ernie_jax.router.routing import Router, RouterError
    layout = {"model": "abc", "block_size": 16, "leaves": [["k", [6, 16, 2, 64], "uint16"]], "shards": "[\"4 devices\"]"}
    router = Router(["http://p:1"], ["http://d:2"], [])
    prefill, decode = router.backends
    router._admit(prefill, httpx.Response(200, json={"role": "prefill", "model": "m", "kv_layout": layout}))

    def admit(**changes):
        info = {"role": "decode", "model": "m", "kv_layout": layout}
        for key, value in changes.items():
            if key in info:
                info[key] = value
            else:
                info["kv_layout"] = {**layout, key: value}
        router._admit(decode, httpx.Response(200, json=info))
    with pytest.raises(RouterError, match="http://d:2 serves 'other', http://p:1 serves 'm'"):
        admit(model="other")
    with pytest.raises(RouterError, match="another layout.*block_size: 16 against 32"):
        admit(block_size=32)
    with pytest.raises(RouterError, match="serves as 'prefill', not as 'decode'"):
        admit(role="prefill")
    admit(shards="[\"2 devices\"]")
    assert decode.info["kv_layout"]["shards"] == "[\"2 devices\"]"


def test_fan_out_sends_one_part_per_prompt_and_sample_and_leaves_the_rest_whole():
    """router/fanout.fan_out, no server: parts in choice order (prompt x n + sample), sample j seeded seed + j
    wrapping within 64 bits as SamplingParams.for_sample; requests it cannot send apart unchanged stay whole."""
    from ernie_jax.router.fanout import fan_out
    from ernie_jax.sampling import SamplingParams
    body = {"prompt": ["a", "b"], "n": 2, "seed": 2**64 - 1, "best_of": 2}
    parts = fan_out("/v1/completions", body, 16, 1024)
    assert [(p["prompt"], p["n"], p["seed"], "best_of" in p) for p in parts] == [
        ("a", 1, 2**64 - 1, False), ("a", 1, 0, False), ("b", 1, 2**64 - 1, False), ("b", 1, 0, False)]
    assert [p["seed"] for p in parts[:2]] == [SamplingParams(n=2, seed=2**64 - 1).for_sample(j).seed for j in (0, 1)]
    assert [p["prompt"] for p in fan_out("/v1/completions", {"prompt": [[1, 2], [3]]}, 16, 1024)] == [[1, 2], [3]]
    assert len(fan_out("/v1/chat/completions", {"messages": [], "n": 3}, 16, 1024)) == 3
    for path, whole in [("/v1/completions", {"prompt": "x"}), ("/v1/completions", {"prompt": [1, 2, 3]}),
                        ("/v1/completions", {"prompt": "x", "n": 17}), ("/v1/completions", {"prompt": "x", "n": "2"}),
                        ("/v1/completions", {"prompt": "x", "n": 2, "seed": 2**64}),
                        ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}),
                        ("/v1/completions", {"prompt": ["x", "y"], "echo": True}),
                        ("/v1/completions", {"prompt": ["x"] * 1025}), ("/v1/completions", {"prompt": ["x", 1]})]:
        assert fan_out(path, whole, 16, 1024) is None, whole


def test_prefill_servers_are_chosen_by_prompt_prefix_within_a_load_slack():
    """Cache affinity (unit, no server): a prompt beginning as an earlier one goes to the prefill server that
    prefilled that one, unless it has over AFFINITY_SLACK more requests in flight than the least busy; other
    prompts go to the least busy. Token ids, text and chat messages each name their beginning."""
    from ernie_jax.router.routing import AFFINITY_SLACK, PREFIX_IDS, Router, prefix_key

    router = Router(["http://p1", "http://p2"], ["http://d"], [])
    p1, p2 = router.of("prefill")
    ids = {"prompt": list(range(100, 100 + PREFIX_IDS)) + [1, 2, 3]}
    same_start = {"prompt": list(range(100, 100 + PREFIX_IDS)) + [9]}
    assert prefix_key(ids) == prefix_key(same_start) != prefix_key({"prompt": [7] + ids["prompt"]})
    assert router.pick_prefill([p1, p2], prefix_key(ids)) is p1  # first seen: the least busy (ties: fewest routed)
    router.prefilled_on(p1, prefix_key(ids))
    p1.in_flight = AFFINITY_SLACK  # busier, but within the slack: the prefix stays with p1
    assert router.pick_prefill([p1, p2], prefix_key(same_start)) is p1 and router.counts["prefill_affinity"] == 1
    assert router.pick_prefill([p1, p2], prefix_key({"prompt": [5, 6, 7]})) is p2  # a new prefix: the least busy
    p1.in_flight = AFFINITY_SLACK + 1  # over the slack: the least busy takes it, and the prefix moves there
    assert router.pick_prefill([p1, p2], prefix_key(same_start)) is p2
    router.prefilled_on(p2, prefix_key(same_start))
    p1.in_flight = 0
    assert router.pick_prefill([p1, p2], prefix_key(ids)) is p2
    chat = {"messages": [{"role": "user", "content": "The sea is"}]}
    text = {"prompt": "The sea is calm tonight."}
    assert prefix_key(chat) is not None and prefix_key(text) != prefix_key({"prompt": "Another prompt."})
    assert prefix_key({"prompt": None}) is None and router.pick_prefill([p1, p2], prefix_key({"prompt": None})) is p1
    assert router.pick_prefill([p2], prefix_key(chat)) is p2  # one server: that one
