"""Soak (`make test-all` only): a few hundred concurrent clients against a real server on loopback, some
streaming to the end, some disconnecting mid-stream, some giving up on a non-streaming request, some sending
malformed or hostile bodies. Every stream that completes carries exactly its prompt's solo greedy text (f32,
batch-invariant decoding): no token lost or duplicated; afterwards nothing runs, every KV page is free, and
the pools' bookkeeping passes its invariant check at shutdown."""

import asyncio
import json
import signal
import time

import httpx
import numpy as np

from tests.serving import AUTH, metric, running_server, server_state, wait_idle

CLIENTS = 300
MAX_TOKENS = 12
MALFORMED = [  # bodies every one of which must get a 4xx
    '{"prompt": [5, 6], "max_tokens": 4',
    {"prompt": [5, 6], "seed": 2**80},
    {"prompt": "x\ud800"},
    {"prompt": [5, 6], "temperature": float("nan")},
    {"prompt": [5, 6], "max_tokens": 10**9},
    {"prompt": [[5, 6], [10**9]]},
    {"prompt": [5, 6], "stop": ["a"] * 100},
    {"prompt": [5, 6], "logit_bias": {"x": 1}},
    {"prompt": [5, 6], "n": 0},
    {"prompt": None},
]


def test_hundreds_of_clients_with_disconnects_and_malformed_requests():
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(10, 3000, int(rng.integers(3, 60)))] for _ in range(24)]
    kinds = rng.choice(["stream", "disconnect", "give_up", "malformed"], CLIENTS, p=[0.55, 0.15, 0.1, 0.2])
    with running_server(["--mesh", "8", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "32",
                         "--max-num-batched-tokens", "256", "--max-queue-len", "1024", "--batch-invariant"],
                        optimized=True) as server:
        url = server["url"]

        def body(i, **kw):
            return {"prompt": prompts[i % len(prompts)], "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, **kw}
        with httpx.Client(base_url=url, headers=AUTH, timeout=300) as h:
            solo = [h.post("/v1/completions", json=body(i)).json()["choices"][0]["text"] for i in range(len(prompts))]

        async def client(i, h):
            kind = kinds[i]
            await asyncio.sleep(float(rng.uniform(0, 2)))  # arrivals spread over two seconds
            if kind == "malformed":
                bad = MALFORMED[i % len(MALFORMED)]
                r = await h.post("/v1/completions", content=bad if isinstance(bad, str) else json.dumps(bad),
                                 headers={"content-type": "application/json"})
                return kind, r.status_code, None
            if kind == "give_up":
                try:
                    await h.post("/v1/completions", json=body(i, max_tokens=200), timeout=0.5)
                except httpx.TimeoutException:
                    return kind, None, None
                return kind, "finished", None
            text, chunks = "", 0
            async with h.stream("POST", "/v1/completions", json=body(i, stream=True)) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    data = json.loads(line[6:])
                    assert "error" not in data, data
                    text += data["choices"][0]["text"]
                    chunks += 1
                    if kind == "disconnect" and chunks == 3:
                        return kind, None, None  # leaving the block closes the connection
            return kind, r.status_code, text

        async def run():
            limits = httpx.Limits(max_connections=CLIENTS + 10)
            async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=600, limits=limits) as h:
                return await asyncio.gather(*(client(i, h) for i in range(CLIENTS)))
        t0 = time.perf_counter()
        results = asyncio.run(run())
        seconds = time.perf_counter() - t0
        streams = [(i, status, text) for i, (kind, status, text) in enumerate(results) if kind == "stream"]
        assert all(status == 200 for _, status, _ in streams)
        wrong = [i for i, _, text in streams if text != solo[i % len(prompts)]]
        assert not wrong, f"{len(wrong)} of {len(streams)} streams differ from their solo text: {wrong[:5]}"
        malformed = [status for kind, status, _ in results if kind == "malformed"]
        assert all(400 <= s < 500 for s in malformed), malformed
        m = wait_idle(url, timeout=120)
        assert metric(m, "ernie_jax:kv_cache_usage_perc") == 0 and metric(m, "ernie_jax:num_requests_running") == 0
        aborted = metric(m, "ernie_jax:requests_total", outcome="abort")
        print(f"soak: {CLIENTS} clients in {seconds:.1f} s: {len(streams)} streams completed and equal to their "
              f"solo text, {list(kinds).count('disconnect')} disconnected mid-stream, "
              f"{list(kinds).count('give_up')} gave up, {len(malformed)} malformed -> 4xx; {aborted:.0f} aborted "
              "in the engine; every KV page free")
        server["proc"].send_signal(signal.SIGTERM)
        assert server["proc"].wait(timeout=120) == 0
        with open(server["log"]) as f:
            log = f.read()
        assert log.count("KV pool consistent") == 2, server_state(server)
        assert "step failed" not in log and "Traceback" not in log, server_state(server)
