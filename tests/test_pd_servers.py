"""Prefill and decode on different server processes behind the router (`--pd-role prefill|decode`,
`python -m ernie_jax.router`), 4 fake CPU devices each, on loopback: the prompt's KV moves between the
processes through jax.experimental.transfer (engine/kv_connector.py)."""

import httpx
import openai
import pytest

from ernie_jax.assets import EMBEDDED_MODEL_NAME
from tests.serving import AUTH, KEY, launch, metric, metrics, running_servers, wait_healthy, wait_idle

COMMON = ["--mesh", "4", "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
          "--batch-invariant"]
PROMPTS = ["The sea is", "说说曹操。", "Tell me about the mountains and the rivers of"]


@pytest.fixture(scope="module")
def cluster():
    with running_servers([COMMON + ["--pd-role", "prefill"], COMMON + ["--pd-role", "decode"]]) as (p, d):
        router = launch("ernie_jax.router", ["--prefill", p["url"], "--decode", d["url"], "--api-key", KEY])
        try:
            wait_healthy(router, __import__("time").time() + 60)
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
    info = httpx.get(cluster["prefill"]["url"] + "/v1/pd/info", headers=AUTH).json()
    pulled = httpx.get(cluster["decode"]["url"] + "/v1/pd/info", headers=AUTH).json()["transfers"]
    assert info["transfers"]["exported"] == info["transfers"]["offered"] == pulled["pulled"] == 2 * len(PROMPTS) + 1
    assert info["transfers"]["kept"] == 0 and pulled["recomputed"] == 0 and pulled["bytes"] > 0
    assert metric(metrics(cluster["router"]["url"]), "ernie_jax_router:requests_total", path="split") == 7
    for role in ("prefill", "decode"):
        wait_idle(cluster[role]["url"])  # every KV page free again on both servers


def test_requests_the_roles_cannot_take_are_refused_naming_the_field(cluster):
    d, p = cluster["decode"]["url"], cluster["prefill"]["url"]
    body = {"model": EMBEDDED_MODEL_NAME, "prompt": "The sea is", "max_tokens": 4}
    r = httpx.post(d + "/v1/completions", headers=AUTH, json={**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "--pd-role prefill" in r.json()["error"]["message"]
    layout = httpx.get(p + "/v1/pd/info", headers=AUTH).json()["kv_layout"]
    other = {**layout, "block_size": layout["block_size"] * 2}
    kv = {"do_remote_prefill": True, "kv_layout": other, "remote_request_id": "x", "remote_url": p,
          "first_token_id": 1, "num_prompt_tokens": 3, "remote_num_pages": 1}
    r = httpx.post(d + "/v1/completions", headers=AUTH, json={**body, "kv_transfer_params": kv})
    assert r.status_code == 400 and "block size" in r.json()["error"]["message"]
    r = httpx.post(p + "/v1/pd/kv/offer", headers=AUTH, json={"request_id": "no-such-request"})
    assert r.status_code == 404 and "no-such-request" in r.json()["error"]["message"]
    assert httpx.get(d + "/health").status_code == 200 and httpx.get(p + "/health").status_code == 200
