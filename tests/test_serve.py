"""The OpenAI-compatible server as a real process (`python -m ernie_jax.serve --mesh 8`, prefill on 4 fake CPU
devices, decode on the other 4) on the embedded FP8 model, driven by the official `openai` client.

Tests run in file order against one server; the last one sends SIGTERM and checks the drain.
"""

import asyncio
import json
import re
import signal
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest

from ernie_jax.assets import EMBEDDED_MODEL_DIR, EMBEDDED_MODEL_NAME
from ernie_jax.tokenizer import Tokenizer
from tests.serving import AUTH, KEY, ROOT, metric, metrics, running_server, server_state, wait_idle

MAX_MODEL_LEN = 512
MAX_REQUEST_BYTES = 2**20


@pytest.fixture(scope="module")
def server():
    # static PD: each submesh compiles only its own role's programs (the dynamic policy is test_pd's). XLA's
    # default optimisation: this server runs hundreds of requests (unoptimised programs took 3x the time here)
    with running_server(["--mesh", "8", "--pd-policy", "static", "--max-model-len", str(MAX_MODEL_LEN),
                         "--max-num-seqs", "8",
                         "--max-num-batched-tokens", "64", "--max-queue-len", "64", "--batch-invariant",
                         "--max-request-bytes", str(MAX_REQUEST_BYTES)], optimized=True) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)


def test_start_up_log_and_models(server, client):
    with open(server["log"]) as f:
        log = f.read()
    assert "mesh split: prefill on devices [0,1,2,3], decode on devices [4,5,6,7]" in log
    assert re.search(r"compiled \d+ programs", log) and "block-FP8" in log
    # which implementation each op runs, and why the kernels were passed over on this CPU
    assert re.search(r"op paged_attention: (cpu_decode|xla_cpu) \(not used: pallas_triton: a Pallas-Triton GPU kernel", log)
    assert "op block_fp8_matmul: xla" in log and "op ep_dispatch: replicated" in log
    assert re.search(rf"serving '{EMBEDDED_MODEL_NAME}' at {server['url']}/v1 \(ready [\d.]+ s after launch\)", log)
    assert [m.id for m in client.models.list().data] == [EMBEDDED_MODEL_NAME]
    assert httpx.get(server["url"] + "/health").status_code == 200


def test_chat_completion(client, tokenizer):
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "你好，介绍一下你自己"}]
    # ignore_eos: the trained model may end its turn before 8 tokens
    r = client.chat.completions.create(model=EMBEDDED_MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant" and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(messages))
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert c.message.content and "\ufffd" not in c.message.content
    # content as a list of text parts is the same conversation
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "你好，"},
                                                         {"type": "text", "text": "介绍一下你自己"}]}]
    r2 = client.chat.completions.create(model=EMBEDDED_MODEL_NAME, messages=parts, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r2.choices[0].message.content == c.message.content


def test_text_completions_batches_and_n(client, tokenizer):
    r = client.completions.create(model=EMBEDDED_MODEL_NAME, prompt=["The engine", "专家"], max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == len(tokenizer.encode("The engine")) + len(tokenizer.encode("专家"))
    assert r.usage.completion_tokens == 10
    ids = tokenizer.encode("The engine")
    r_ids = client.completions.create(model=EMBEDDED_MODEL_NAME, prompt=[ids, [5, 6, 7]], max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert r_ids.choices[0].text == r.choices[0].text  # a token-id prompt is the same prompt
    r_n = client.completions.create(model=EMBEDDED_MODEL_NAME, prompt=["a", "b"], max_tokens=4, n=3,
                                    temperature=1.0, seed=7)
    assert [c.index for c in r_n.choices] == list(range(6))
    assert len({c.text for c in r_n.choices[:3]}) > 1  # n samples of one prompt differ


def test_stop_sequences(client):
    kw = {"model": EMBEDDED_MODEL_NAME, "prompt": "User: hello\nAssistant: ", "max_tokens": 24, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full[:full.index(stop)]
    r = client.completions.create(**kw, stop=[stop, "never-appears"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(**kw, stop=stop, stream=True)
                       if ch.choices)
    assert streamed == cut  # streaming holds back text that may start a stop string


def test_seeds_reproducible(client):
    kw = {"model": EMBEDDED_MODEL_NAME, "messages": [{"role": "user", "content": "tell me a story"}],
          "max_tokens": 12, "temperature": 1.0, "top_p": 0.95, "extra_body": {"ignore_eos": True}}
    a = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    b = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    c = client.chat.completions.create(**kw, seed=99).choices[0].message.content
    assert a == b and a != c


def test_streaming_async_client(server):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)
        messages = [{"role": "user", "content": "stream, please"}]
        full = await aclient.chat.completions.create(model=EMBEDDED_MODEL_NAME, messages=messages, max_tokens=10,
                                                     temperature=0, extra_body={"ignore_eos": True})
        chunks = [c async for c in await aclient.chat.completions.create(
            model=EMBEDDED_MODEL_NAME, messages=messages, max_tokens=10, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True})]
        await aclient.close()
        return full, chunks
    full, chunks = asyncio.run(run())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_logprobs_and_extensions(client):
    r = client.chat.completions.create(model=EMBEDDED_MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy picks the top token
    r = client.chat.completions.create(model=EMBEDDED_MODEL_NAME, messages=[{"role": "user", "content": "你好"}],
                                       max_tokens=12, temperature=0, logprobs=True)
    message = r.choices[0].message.content
    assert message and bytes(b for e in r.choices[0].logprobs.content for b in e.bytes).decode() == message
    # ignore_eos + min_tokens + penalties + continuous usage stats in a stream
    chunks = list(client.chat.completions.create(
        model=EMBEDDED_MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=9, temperature=0,
        presence_penalty=1.5, frequency_penalty=1.0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "min_tokens": 9, "top_k": 5, "repetition_penalty": 1.2}))
    usage = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert usage[-1] == 9 and usage == sorted(usage) and len(usage) == len(chunks)


def test_echo_prompt_logprobs(client, tokenizer):
    """What lm-evaluation-harness's loglikelihood sends: token-id prompts, echo, logprobs, max_tokens 0 or 1."""
    ids = tokenizer.encode("The KV cache moves between submeshes after prefill")
    gen = client.completions.create(model=EMBEDDED_MODEL_NAME, prompt=ids, max_tokens=1, temperature=0, logprobs=1)
    g = gen.choices[0].logprobs
    nxt_text, nxt_lp = g.tokens[0], g.token_logprobs[0]
    nxt = tokenizer.encode(gen.choices[0].text) if nxt_text.strip() else None
    r = client.completions.create(model=EMBEDDED_MODEL_NAME, prompt=[ids, ids[:5]], max_tokens=0, echo=True,
                                  logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert r.choices[0].text == tokenizer.decode(ids) and r.usage.completion_tokens == 0
    assert len(r.choices[1].logprobs.tokens) == 5
    streamed = list(client.completions.create(model=EMBEDDED_MODEL_NAME, prompt=ids, max_tokens=0, echo=True,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == tokenizer.decode(ids)  # the prompt, nothing generated
    # the first prompt is a prefix of the second's scoring: same logprobs for shared positions
    assert np.allclose(lp.token_logprobs[1:5], r.choices[1].logprobs.token_logprobs[1:5], atol=2e-2)
    # scoring prompt + greedy token gives that token the logprob generation reported
    if nxt is not None and len(nxt) == 1:
        r2 = client.completions.create(model=EMBEDDED_MODEL_NAME, prompt=ids + nxt, max_tokens=1, echo=True,
                                       logprobs=1, temperature=0)
        lps = r2.choices[0].logprobs.token_logprobs
        assert len(lps) == len(ids) + 2 and lps[len(ids)] == pytest.approx(nxt_lp, abs=2e-2)


BAD = [  # (route, body or raw text, status, words the message must contain)
    ("/v1/chat/completions", "{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400,
     "'temperature': Input should be a valid number"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": True}, 400,
     "'top_p': Input should be a valid number"),
    ("/v1/chat/completions", {"model": EMBEDDED_MODEL_NAME}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": MAX_MODEL_LEN}, 400,
     "max_model_len"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 1000}, 400, "n=1000"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tool"),
    ("/v1/completions", {"prompt": "x " * (2 * MAX_MODEL_LEN)}, 400, "max_model_len"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 10 ** 7]]}, 400, "prompt 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {}, 400, "prompt"),
]


@pytest.mark.parametrize("route,body,status,words", BAD, ids=[f"{b[2]}-{b[3]}" for b in BAD])
def test_bad_input_is_rejected_and_server_keeps_serving(server, client, route, body, status, words):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server["url"] + route, content=content, headers={"content-type": "application/json", **AUTH})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["code"] == status and err["type"]
    ok = client.completions.create(model=EMBEDDED_MODEL_NAME, prompt="still there?", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_bad_model_folder_or_setting_stops_the_cli_with_its_message(tmp_path):
    from ernie_jax.serve import cli
    with pytest.raises(SystemExit, match=r"^error: no config.json in '.*': an ERNIE-4.5 checkpoint folder needs one"):
        cli.main(["--model", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"^error: max_model_len=0: must be from 1 to"):
        cli.main(["--max-model-len", "0"])


def test_api_key_is_required_on_v1_routes(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(server["url"] + "/v1/models", headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        r = httpx.post(server["url"] + "/v1/admin/rebalance_experts", headers=headers)  # admin routes too
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(server["url"] + "/health").status_code == 200  # probes and scrapes stay open
    assert httpx.get(server["url"] + "/metrics").status_code == 200


def test_unknown_fields_are_ignored(client):
    r = client.chat.completions.create(model=EMBEDDED_MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, extra_body={"some_vendor_field": {"a": 1}, "nvext": {}})
    assert r.usage.completion_tokens == 2


def test_64_concurrent_streams_equal_alone_runs(server, client):
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(10, 3000, int(rng.integers(3, 200)))] for _ in range(64)]
    max_tokens = [int(m) for m in rng.integers(4, 24, 64)]

    def kw(i):
        return {"model": EMBEDDED_MODEL_NAME, "prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0,
                "extra_body": {"ignore_eos": True}}
    alone = [client.completions.create(**kw(i)).choices[0].text for i in range(64)]
    rss_before = _rss_mb(server["proc"].pid)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)

        async def one(i):
            text, ids, finish, tokens = "", set(), None, 0
            async for c in await aclient.completions.create(**kw(i), stream=True,
                                                            stream_options={"include_usage": True}):
                ids.add(c.id)
                if c.choices:
                    text += c.choices[0].text
                    finish = c.choices[0].finish_reason or finish
                if c.usage is not None:
                    tokens = c.usage.completion_tokens
            return text, ids, finish, tokens
        out = await asyncio.gather(*(one(i) for i in range(64)))
        await aclient.close()
        return out
    out = asyncio.run(run())
    assert [o[0] for o in out] == alone
    assert all(o[2] == "length" and o[3] == m for o, m in zip(out, max_tokens))
    assert all(len(o[1]) == 1 for o in out) and len({next(iter(o[1])) for o in out}) == 64  # one id each
    m = metrics(server["url"])
    assert metric(m, "ernie_jax:num_requests_running") == 0 and metric(m, "ernie_jax:num_requests_waiting") == 0
    assert metric(m, "ernie_jax:kv_cache_usage_perc") == 0  # every page is back, in both pools
    assert _rss_mb(server["proc"].pid) - rss_before < 100, "host memory grew during the burst"


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def test_client_disconnect_aborts_and_frees_pages(server):
    url = server["url"]
    aborted = metric(metrics(url), "ernie_jax:requests_total", outcome="abort")
    body = {"prompt": "disconnect me", "max_tokens": MAX_MODEL_LEN - 50, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break  # closing the connection mid-stream
    wait_idle(url)
    try:  # a non-streaming request whose client gives up
        httpx.post(url + "/v1/completions", json={**body, "stream": False}, headers=AUTH, timeout=1.0)
    except httpx.TimeoutException:
        pass
    m = wait_idle(url)
    assert metric(m, "ernie_jax:requests_total", outcome="abort") == aborted + 2


def test_full_queue_answers_429_and_keeps_serving(server, client):
    async def burst():
        async with httpx.AsyncClient(base_url=server["url"], headers=AUTH, timeout=120) as h:
            rs = await asyncio.gather(*(h.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 20,
                                                                         "ignore_eos": True}) for _ in range(120)))
        return [r.status_code for r in rs], [r.json() for r in rs if r.status_code == 429]
    codes, errors = asyncio.run(burst())
    assert set(codes) == {200, 429} and codes.count(200) >= 64  # the queue limit, not fewer, was admitted
    assert "busy" in errors[0]["error"]["message"]
    wait_idle(server["url"])
    assert client.completions.create(model=EMBEDDED_MODEL_NAME, prompt="after", max_tokens=2).usage
    assert metric(metrics(server["url"]), "ernie_jax:requests_total", outcome="rejected_busy") == codes.count(429)


# ---- structured output and tool calls ------------------------------------------------------------------------
STRUCTURED_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["colour"], "additionalProperties": False},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": -5,
                                                                            "maximum": 5}, "minItems": 1, "maxItems": 4}},
     "required": ["scores"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": 0, "maximum": 1}, "label": {"type": "string", "maxLength": 6}},
        "required": ["x"], "additionalProperties": False}, "note": {"type": ["string", "null"], "maxLength": 8}},
     "required": ["point", "note"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                         "tag": {"enum": ["a", "b"]}}, "required": ["id", "tag"],
        "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def _chat_text(client, stream: bool, **kw) -> tuple[str, list]:
    """The reply's content and tool calls, streamed or not; streamed tool-call deltas are joined the way the
    openai client's own stream helpers join them (by index: id, name, then argument fragments)."""
    if not stream:
        m = client.chat.completions.create(model=EMBEDDED_MODEL_NAME, **kw).choices[0].message
        return m.content or "", [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
    text, calls = "", {}
    for chunk in client.chat.completions.create(model=EMBEDDED_MODEL_NAME, stream=True, **kw):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                c = calls.setdefault(d.index, ["", "", ""])
                c[0] += d.id or ""
                c[1] += (d.function.name or "") if d.function else ""
                c[2] += (d.function.arguments or "") if d.function else ""
    return text, [tuple(calls[i]) for i in sorted(calls)]


def test_json_schema_replies_validate_streamed_and_not(client):
    """10 json_schema requests (nested objects, arrays, enums, bounded numbers, optional and nullable fields),
    8 at a time, each schema once streamed and once not, once greedy and once sampled: every reply parses and
    validates."""
    import jsonschema
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> None:
        schema = STRUCTURED_SCHEMAS[i % len(STRUCTURED_SCHEMAS)]
        text, _ = _chat_text(client, stream=i >= len(STRUCTURED_SCHEMAS),
                             messages=[{"role": "user", "content": f"Item {i} as JSON."}],
                             max_tokens=160, temperature=0.0 if i % 2 else 0.9, seed=i,
                             response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": schema}})
        jsonschema.validate(json.loads(text), schema)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(2 * len(STRUCTURED_SCHEMAS))))
    obj = client.chat.completions.create(model=EMBEDDED_MODEL_NAME, messages=[{"role": "user", "content": "JSON?"}],
                                         max_tokens=100, response_format={"type": "json_object"}).choices[0]
    # a free-form object may run to max_tokens inside a string (a small model rambles); it parses when it ends
    assert isinstance(json.loads(obj.message.content), dict) if obj.finish_reason == "stop" else \
        obj.message.content.startswith("{")


def test_guided_choice_regex_and_grammar_through_extra_body(client):
    choices = ["sunny", "rainy", "snowy with wind"]
    for seed in range(3):
        r = client.chat.completions.create(model=EMBEDDED_MODEL_NAME, messages=[{"role": "user", "content": "Weather?"}],
                                           max_tokens=10, temperature=1.0, seed=seed, extra_body={"guided_choice": choices})
        assert r.choices[0].message.content in choices
    r = client.completions.create(model=EMBEDDED_MODEL_NAME, prompt="Call me at", max_tokens=20,
                                  extra_body={"guided_regex": r"\+\d{2} \d{3}-\d{4}"})
    assert re.fullmatch(r"\+\d{2} \d{3}-\d{4}", r.choices[0].text)
    r = client.completions.create(model=EMBEDDED_MODEL_NAME, prompt="Say it:", max_tokens=20,
                                  extra_body={"structured_outputs": {"grammar": 'root ::= "A" [0-9] [0-9]? "!"'}})
    assert re.fullmatch(r"A\d\d?!", r.choices[0].text)


def test_tool_calls_named_required_auto_and_none(client):
    """A named tool call returns arguments that validate against the tool's schema, and its streamed deltas
    assemble to the same call; "required" calls one of the tools; "none" never returns a call."""
    import jsonschema
    kw = dict(messages=[{"role": "user", "content": "What is the weather in Oslo?"}], tools=[WEATHER_TOOL, TIME_TOOL],
              max_tokens=80, temperature=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=EMBEDDED_MODEL_NAME, tool_choice=named, **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    _, streamed = _chat_text(client, stream=True, tool_choice=named, **kw)
    assert [(name, args) for _, name, args in streamed] == [("get_weather", call.function.arguments)]
    assert streamed[0][0].startswith("call_")
    _, calls = _chat_text(client, stream=False, tool_choice="required", parallel_tool_calls=False, **kw)
    assert len(calls) == 1 and calls[0][1] in ("get_weather", "get_time")
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[calls[0][1]]
    jsonschema.validate(json.loads(calls[0][2]), tool["function"]["parameters"])
    for stream in (False, True):
        text, calls = _chat_text(client, stream=stream, tool_choice="none", **kw)
        assert calls == [] and text
    text, _ = _chat_text(client, stream=False, tool_choice="auto", **kw)  # the model decides; parsed if it calls
    # a conversation that carries the call and its result back
    follow = kw["messages"] + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "-3 C, snow"}]
    r = client.chat.completions.create(model=EMBEDDED_MODEL_NAME, messages=follow, tools=[WEATHER_TOOL], max_tokens=8)
    assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls


STRUCTURED_BAD = [  # (body fields, the param the 400 names, words of its message)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "response_format", "strng"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}}}}, "response_format",
     "example.com"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}}, "response_format",
     "uniqueItems"),  # a JSON-schema feature llguidance does not implement
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "'yaml' is not supported"),
    ({"guided_regex": "([a-z]"}, "guided_regex", "does not compile"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar", "missing_rule"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "at most one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag is not supported"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_wether"}}},
     "tool_choice", "'get_wether' is not among the request's tools"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools", "function.name"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "cannot be combined"),
]


@pytest.mark.parametrize("fields,param,words", STRUCTURED_BAD, ids=[b[1] + str(i) for i, b in enumerate(STRUCTURED_BAD)])
def test_bad_constraints_get_a_400_naming_the_field(server, client, fields, param, words):
    body = {"model": EMBEDDED_MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **fields}
    r = httpx.post(server["url"] + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    ok = client.chat.completions.create(model=EMBEDDED_MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                        max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_tokenize_and_detokenize(server, tokenizer):
    text = "Hello, world. 你好"
    r = httpx.post(server["url"] + "/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=30).json()
    assert r["tokens"] == tokenizer.encode(text, allow_special=True) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN and len(r["token_strs"]) == r["count"]
    back = httpx.post(server["url"] + "/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back["prompt"] == text
    chat = httpx.post(server["url"] + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30).json()
    assert chat["tokens"] == tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    bad = httpx.post(server["url"] + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_metrics(server):
    m = metrics(server["url"])
    for name in ("ernie_jax:time_to_first_token_seconds_count", "ernie_jax:time_per_output_token_seconds_count",
                 "ernie_jax:e2e_request_latency_seconds_count", "ernie_jax:request_queue_time_seconds_count",
                 "ernie_jax:generation_tokens_total"):
        assert metric(m, name) > 0, name
    assert metric(m, "ernie_jax:requests_total", outcome="length") > 0
    assert metric(m, "ernie_jax:requests_total", outcome="rejected_invalid") >= len(BAD)
    layers = {re.search(r'layer="(\d+)"', k).group(1) for k in m if k.startswith("ernie_jax:moe_expert_tokens")}
    assert layers == {"1", "2", "3", "4", "5"}  # the embedded model's MoE layers
    # every routed token is counted once per MoE layer and chosen expert (top-4)
    per_layer = [metric(m, "ernie_jax:moe_expert_tokens_total", layer=layer) for layer in sorted(layers)]
    assert len(set(per_layer)) == 1 and per_layer[0] > 0 and per_layer[0] % 4 == 0
    assert metric(m, "ernie_jax:submesh_busy_seconds_total", submesh="prefill") > 0
    assert metric(m, "ernie_jax:submesh_busy_seconds_total", submesh="decode") > 0
    assert metric(m, "ernie_jax:kv_transfer_bytes_total") > 0
    assert metric(m, "ernie_jax:structured_output_requests_total", kind="json") >= 2 * len(STRUCTURED_SCHEMAS)
    assert metric(m, "ernie_jax:structured_output_requests_total", kind="tools") >= 3
    assert metric(m, "ernie_jax:structured_output_compile_seconds_count") >= len(STRUCTURED_SCHEMAS)
    assert metric(m, "ernie_jax:structured_output_mask_seconds_total") > 0


HOSTILE = [  # (route, body or raw JSON text, the field the 400 names, words its message contains)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": 2**80}, "seed", "64 bits"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x\ud800"}]}, "messages.0.content",
     "lone surrogate (U+D800)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0.content",
     "content is null"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature",
     "finite number"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_k": 2**40}, "top_k", "top_k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 65}, "stop",
     "at most 64"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**7]}, "stop_token_ids", "outside"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1e9}}, "logit_bias", "[-100, 100]"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 10**6}, "min_tokens", "min_tokens"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e39}, "repetition_penalty", "repetition_penalty"),
    ("/v1/completions", {"prompt": ["x\udfff"]}, "prompt.0", "lone surrogate"),
]


@pytest.mark.parametrize("route,body,param,words", HOSTILE, ids=[h[2] for h in HOSTILE])
def test_hostile_values_get_a_400_naming_the_field(server, client, route, body, param, words):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server["url"] + route, content=content, headers={"content-type": "application/json", **AUTH})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    ok = client.completions.create(model=EMBEDDED_MODEL_NAME, prompt="still there?", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_request_bodies_over_the_limit_get_413(server):
    big = json.dumps({"prompt": "x" * MAX_REQUEST_BYTES})
    r = httpx.post(server["url"] + "/v1/completions", content=big, headers={"content-type": "application/json",
                                                                            **AUTH})
    assert r.status_code == 413 and "at most" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield big[:100].encode()
        yield big[100:].encode()
    r = httpx.post(server["url"] + "/v1/completions", content=chunks(), headers={"content-type": "application/json",
                                                                                 **AUTH})
    assert r.status_code == 413 and "over" in r.json()["error"]["message"]


# Cases per route of the fuzz test: the default suite's are fixed (derandomized), make test-all's random.
FUZZ_CASES = [20, 300]


@pytest.mark.parametrize("cases", FUZZ_CASES)
def test_fuzzed_requests_never_get_a_5xx_or_break_the_server(server, cases):
    from hypothesis import HealthCheck, given, settings
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from tests.fuzz_requests import request_bodies

    openapi = httpx.get(server["url"] + "/openapi.json").json()
    with open(server["log"]) as f:
        log_start = len(f.read())
    seen: dict[int, int] = {}
    with httpx.Client(base_url=server["url"], headers=AUTH, timeout=120) as h:
        for route, schema, full, chunk in [("/v1/chat/completions", "ChatCompletionRequest", ChatCompletion,
                                            ChatCompletionChunk),
                                           ("/v1/completions", "CompletionRequest", Completion, Completion)]:
            @settings(max_examples=cases, deadline=None, database=None, derandomize=cases == FUZZ_CASES[0],
                      suppress_health_check=list(HealthCheck))
            @given(request_bodies(openapi, schema, EMBEDDED_MODEL_NAME, 4, MAX_MODEL_LEN))
            def one(body):
                r = h.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
                seen[r.status_code] = seen.get(r.status_code, 0) + 1
                assert r.status_code < 500, f"{r.status_code} for {body!r}: {r.text[:500]}" + server_state(server)
                if r.status_code != 200:
                    err = r.json()["error"]
                    assert isinstance(err["message"], str) and err["code"] == r.status_code and err["type"], r.text
                elif body.get("stream") is True:
                    lines = [ln for ln in r.text.split("\n") if ln.startswith("data: ")]
                    assert lines[-1] == "data: [DONE]", r.text[-500:]
                    for line in lines[:-1]:
                        data = json.loads(line[6:])
                        assert "error" not in data, f"{data} for {body!r}" + server_state(server)
                        if chunk is Completion:  # the SDK's one type for both; a chunk mid-stream has no finish
                            for c in data["choices"]:
                                assert c["finish_reason"] in (None, "stop", "length"), data
                                c["finish_reason"] = c["finish_reason"] or "length"
                        chunk.model_validate(data)
                else:
                    full.model_validate(r.json())
            one()
    assert seen.get(200, 0) >= cases // 4, seen  # the fuzz reaches the engine, not only the validators
    wait_idle(server["url"])
    assert httpx.get(server["url"] + "/health").status_code == 200
    with open(server["log"]) as f:
        log = f.read()[log_start:]
    assert "step failed" not in log and "Traceback" not in log, log[-4000:]


def test_serve_benchmark_against_the_server(server, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "ernie_jax.bench", "serve", "--url", server["url"], "--api-key", KEY,
                        "--num-prompts",
                        "8", "--concurrency", "4", "--input-len", "32", "--output-len", "8", "--vocab-size", "3000",
                        "--goodput", "ttft:60000", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr + server_state(server)
    res = json.loads(out.read_text())
    assert res["completed"] == 8 and res["failed"] == 0 and res["total_output_tokens"] == 64


def test_sigterm_drains_requests_in_flight(server):
    """Last: SIGTERM while a stream runs; the stream still completes, then the process exits 0."""
    body = {"prompt": "drain", "max_tokens": 60, "stream": True, "ignore_eos": True}
    finish = None
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        for i, line in enumerate(r.iter_lines()):
            if i == 2:
                server["proc"].send_signal(signal.SIGTERM)
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                finish = choices[0]["finish_reason"] if choices else finish
    assert finish == "length"
    assert server["proc"].wait(timeout=60) == 0
    with open(server["log"]) as f:
        log = f.read()
    assert "Traceback" not in log  # nothing (a background compile, a thread) fails on the way out
    assert log.count("KV pool consistent") == 2  # prefill's and decode's, checked once nothing steps
    with pytest.raises(httpx.ConnectError):
        httpx.get(server["url"] + "/health", timeout=2)
