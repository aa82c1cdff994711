"""`python -m ernie_jax.bench serve` against an in-process mock OpenAI streaming server with known timings."""

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ernie_jax.bench import cli as bench_cli
from ernie_jax.bench import serve as serve_bench

# Seconds: the mock's first-chunk delay, inter-chunk delay, and slow first chunk. Bounds on measured times leave
# room for scheduler noise (the test shares its CPUs with other jobs), so SLOW_FIRST sits far above FIRST: a
# loaded 2-core CI machine once took 0.77 s for a FIRST of 0.05 s, past the old 0.3 s goodput bound.
FIRST, GAP, SLOW_FIRST = 0.05, 0.02, 2.0


def mock_app(state: dict) -> FastAPI:
    """Streams max_tokens one-token chunks: FIRST (or SLOW_FIRST for even first token ids when state["slow_even"])
    before the first, GAP between, then a usage chunk and [DONE]; every state["fail_every"]-th request after the
    first (the warm-up) gets a 500."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "mock-ernie", "object": "model"}]}

    async def complete(request: Request, chat: bool):
        body = await request.json()
        k = state["count"]
        state["count"] += 1
        state["bodies"].append(body)
        if state["status"] != 200:
            return JSONResponse({"error": {"message": "forced"}}, status_code=state["status"])
        if state["fail_every"] and k and k % state["fail_every"] == 0:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        n = body["max_completion_tokens"] if chat else body["max_tokens"]
        n_prompt = len(body["messages"][0]["content"].split()) if chat else len(body["prompt"])
        first = SLOW_FIRST if state["slow_even"] and not chat and body["prompt"][0] % 2 == 0 else FIRST

        def chunk(text, usage=None, finish=None):
            if usage:
                return f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                      else {"index": 0, "text": text, "finish_reason": finish})
            return f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"

        async def events():
            state["inflight"] += 1
            state["max_inflight"] = max(state["max_inflight"], state["inflight"])
            try:
                yield chunk("")  # an empty first chunk (a role header) must not count as the first token
                await asyncio.sleep(first)
                for i in range(n):
                    if i:
                        await asyncio.sleep(GAP)
                    yield chunk(f" t{i}")
                yield chunk("", finish="length")
                if not state["no_usage"] and body.get("stream_options", {}).get("include_usage"):
                    yield chunk(None, usage={"prompt_tokens": n_prompt, "completion_tokens": n,
                                             "total_tokens": n_prompt + n})
                yield "data: [DONE]\n\n"
            finally:
                state["inflight"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    return app


@pytest.fixture(scope="module")
def mock_server():
    state = {}
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(mock_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 5
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    assert server.started, "mock server did not start"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", state
    server.should_exit = True
    thread.join(5)


@pytest.fixture
def mock(mock_server):
    url, state = mock_server
    state.clear()
    state.update(count=0, bodies=[], status=200, fail_every=0, slow_even=False, no_usage=False, inflight=0,
                 max_inflight=0)
    return url, state


def run(url, *extra):
    args = serve_bench.parse_args(["--url", url, "--num-prompts", "8", "--input-len", "16", "--output-len", "5",
                                   "--concurrency", "4", *extra])
    return args, asyncio.run(serve_bench.run_benchmark(args))


def test_counts_and_timings(mock):
    url, state = mock
    args, res = run(url, "--vocab-size", "50", "--percentiles", "50,90,99.9")
    assert (res["completed"], res["failed"]) == (8, 0)
    assert res["total_output_tokens"] == 8 * 5 and res["total_input_tokens"] == 8 * 16
    assert res["usage_missing"] == 0 and res["good_completed"] is None and res["request_goodput"] is None
    assert res["config"]["model"] == "mock-ernie"  # from GET /v1/models
    # What went on the wire: one warm-up, then exact-length token-id prompts from [10, vocab), greedy, ignore_eos.
    assert state["count"] == 9 and state["max_inflight"] <= 4
    for body in state["bodies"]:
        assert len(body["prompt"]) == 16 and all(10 <= t < 50 for t in body["prompt"])
        assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["temperature"] == 0
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "mock-ernie"
    # Arrival order at the server may differ from dispatch order under concurrency.
    assert sorted(b["prompt"] for b in state["bodies"][1:]) == sorted(p for p, _, _ in serve_bench.sample_requests(args))
    # Timings: TTFT skips the empty first chunk, ITL and TPOT match the mock's gaps.
    assert min(res["ttfts"]) >= FIRST
    assert all(len(itl) == 4 for itl in res["itls"])
    assert GAP * 0.9 <= res["median_itl_ms"] / 1e3 < GAP * 3
    assert GAP * 0.9 <= res["median_tpot_ms"] / 1e3 < GAP * 3
    assert all(e >= t + 4 * GAP * 0.9 for e, t in zip(res["e2els"], res["ttfts"]))
    assert res["p50_ttft_ms"] == pytest.approx(res["median_ttft_ms"]) and "p99.9_e2el_ms" in res
    assert res["mean_e2el_ms"] / 1e3 <= res["duration"]
    assert res["request_throughput"] == pytest.approx(8 / res["duration"])
    assert res["output_throughput"] == pytest.approx(40 / res["duration"])
    assert res["total_token_throughput"] == pytest.approx((40 + 128) / res["duration"])


def test_goodput(mock):
    url, state = mock
    state["slow_even"] = True
    args, res = run(url, "--goodput", "ttft:1000", "tpot:1000", "--concurrency", "8", "--warmup", "0")
    slow = sum(p[0] % 2 == 0 for p, _, _ in serve_bench.sample_requests(args))
    assert 0 < slow < 8, "the seed should give a mix of slow and fast requests"
    assert res["good_completed"] == 8 - slow, res["ttfts"]
    assert res["request_goodput"] == pytest.approx((8 - slow) / res["duration"])
    state["slow_even"] = False
    _, tight = run(url, "--goodput", "ttft:1")
    assert tight["good_completed"] == 0 and tight["request_goodput"] == 0
    _, loose = run(url, "--goodput", "ttft:5000", "tpot:1000", "e2el:20000")
    assert loose["good_completed"] == 8
    # One-token requests have no TPOT and do not fail a TPOT SLO.
    _, one = run(url, "--output-len", "1", "--goodput", "tpot:0.001")
    assert one["good_completed"] == 8 and one["mean_tpot_ms"] == 0 and not any(one["itls"])


def test_failures_counted(mock):
    url, state = mock
    state["fail_every"] = 3
    _, res = run(url, "--num-prompts", "9")
    assert (res["completed"], res["failed"]) == (6, 3)
    assert res["total_output_tokens"] == 6 * 5 and res["total_input_tokens"] == 6 * 16
    errors = [e for e in res["errors"] if e]
    assert len(errors) == 3 and all(e.startswith("HTTP 500") and "boom" in e for e in errors)
    assert res["request_throughput"] == pytest.approx(6 / res["duration"])


def test_missing_usage_falls_back_to_chunks(mock, capsys):
    url, state = mock
    state["no_usage"] = True
    args, res = run(url)
    assert res["total_output_tokens"] == 40 and res["usage_missing"] == 8
    serve_bench.print_report(res, args.percentile_list)
    assert "no usage block" in capsys.readouterr().out


def test_chat_endpoint(mock):
    url, state = mock
    _, res = run(url, "--endpoint", "chat", "--model", "m")
    assert (res["completed"], res["failed"], res["total_output_tokens"]) == (8, 0, 40)
    body = state["bodies"][-1]
    assert body["max_completion_tokens"] == 5 and body["model"] == "m" and body["stream"] is True
    assert len(body["messages"][0]["content"].split()) == 16
    assert res["total_input_tokens"] == 8 * 16  # the mock's usage.prompt_tokens


def test_request_rate_and_ranges(mock):
    url, state = mock
    args, res = run(url, "--request-rate", "40", "--num-prompts", "6", "--range-ratio", "0.5", "--warmup", "0",
                    "--concurrency", "2")
    gaps = np.random.default_rng(args.seed + 1).exponential(1 / 40, 6)
    assert res["duration"] >= gaps[1:].sum() and res["completed"] == 6 and state["max_inflight"] <= 2
    assert [len(b["prompt"]) for b in state["bodies"]] == res["input_lens"]
    assert all(8 <= n <= 24 for n in res["input_lens"]) and all(2 <= n <= 8 for n in res["output_lens"])
    assert [b["max_tokens"] for b in state["bodies"]] == res["output_lens"]


def test_cli_json_and_errors(mock, tmp_path, capsys):
    url, state = mock
    out = tmp_path / "r.json"
    assert bench_cli.main(["serve", "--url", url + "/v1/", "--num-prompts", "3", "--input-len", "4", "--output-len",
                       "2", "--goodput", "e2el:10000", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Request goodput (req/s):" in printed and "P99 ITL" in printed
    saved = json.loads(out.read_text())
    assert saved["completed"] == 3 and saved["good_completed"] == 3 and saved["config"]["model"] == "mock-ernie"
    state["status"] = 404
    assert serve_bench.main(["--url", url, "--num-prompts", "2"]) == 1
    err = capsys.readouterr().err
    assert "warm-up request" in err and "HTTP 404" in err and "Traceback" not in err
    assert serve_bench.main(["--url", url, "--num-prompts", "2", "--warmup", "0"]) == 1
    assert "all 2 requests failed" in capsys.readouterr().err
    assert serve_bench.main(["--url", "localhost:1"]) == 1
    assert "expected http://host:port" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--goodput", "latency:5"])


def test_goodput_rules():
    """Exact SLO bookkeeping on synthetic results: every given SLO must hold, bounds are inclusive."""
    R = serve_bench.RequestResult
    results = [R(4, True, ttft=0.1, latency=0.4, output_tokens=4),   # tpot 0.1
               R(4, True, ttft=0.3, latency=0.6, output_tokens=4),   # tpot 0.1, late first token
               R(4, True, ttft=0.1, latency=1.0, output_tokens=4),   # tpot 0.3
               R(4, True, ttft=0.2, latency=0.2, output_tokens=1),   # no tpot
               R(4, False, error="HTTP 500: x")]
    good = lambda *slo: serve_bench.calculate_metrics(results, 2.0, serve_bench.parse_goodput(list(slo)), [50])
    assert good("ttft:200")["good_completed"] == 3
    assert good("tpot:150")["good_completed"] == 3
    assert good("ttft:200", "tpot:150")["good_completed"] == 2
    assert good("ttft:200", "tpot:150", "e2el:300")["good_completed"] == 1
    m = good("e2el:100000")
    assert m["good_completed"] == 4 and m["request_goodput"] == 2.0 and (m["completed"], m["failed"]) == (4, 1)
    assert m["mean_tpot_ms"] == pytest.approx(500 / 3) and m["total_output_tokens"] == 13


def test_server_down(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    assert bench_cli.main(["serve", "--url", f"http://127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach") and "Traceback" not in err
    assert bench_cli.main(["serve", "--url", f"http://127.0.0.1:{port}", "--model", "m"]) == 1
    assert "warm-up request" in capsys.readouterr().err


def test_spec_decode_figures_from_two_metrics_scrapes():
    """bench serve reports speculative decoding (vLLM's figures) from the server's counters before and after."""
    from ernie_jax.bench.serve import parse_spec_counters, spec_decode_metrics

    def scrape(drafts, accepted, per_pos):
        return parse_spec_counters(
            f'ernie_jax:spec_decode_num_drafts_total{{model_name="m"}} {drafts}\n'
            f'ernie_jax:spec_decode_num_draft_tokens_total{{model_name="m"}} {2 * drafts}\n'
            f'ernie_jax:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}\n' +
            "".join(f'ernie_jax:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {n}\n'
                    for i, n in enumerate(per_pos)))
    spec = spec_decode_metrics(scrape(10, 5, [4, 1]), scrape(30, 35, [24, 11]))
    assert spec["drafts"] == 20 and spec["accepted_tokens"] == 30 and spec["acceptance_rate"] == 0.75
    assert spec["acceptance_length"] == 2.5 and spec["per_position"] == [1.0, 0.5]
    assert parse_spec_counters("ernie_jax:num_requests_running 1\n") is None
