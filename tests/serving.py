"""Helpers for tests that run `python -m ernie_jax.serve` as a real process on loopback: start one, read its
Prometheus metrics, wait for it to be idle, send a burst of prompts."""

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from tests.conftest import TEST_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(args: list[str], timeout: float = 600, optimized: bool = False):
    """A server on a free loopback port with `args` (plus --api-key KEY and the tests' compilation cache),
    up and healthy; yields {"url", "proc", "log"} and kills it on the way out if it still runs. optimized:
    XLA's default optimisation (for a server that runs many requests) instead of TEST_XLA_FLAGS."""
    with running_servers([args], timeout, optimized=optimized) as servers:
        yield servers[0]


def launch(module: str, args: list[str], port: int | None = None, optimized: bool = False) -> dict:
    """`python -m module --port P ... args` on loopback (a free port unless given), started (not waited for):
    {"url", "proc", "log"}. A server module gets --api-key KEY and the tests' compilation cache; its programs
    compile with TEST_XLA_FLAGS unless optimized."""
    port = port or free_port()
    env = {**os.environ, "XLA_FLAGS": "" if optimized else TEST_XLA_FLAGS}  # the server sets up its own devices
    env["JAX_PLATFORMS"] = "cpu"
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cache = os.path.join(tempfile.gettempdir(), "ernie_jax_test_xla_cache")
    extra = ["--api-key", KEY, "--compilation-cache-dir", cache] if module == "ernie_jax.serve" else []
    proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *extra, *args],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return {"url": f"http://127.0.0.1:{port}", "proc": proc, "log": log.name}


def wait_healthy(server: dict, deadline: float) -> None:
    while time.time() < deadline:
        if server["proc"].poll() is not None:
            with open(server["log"]) as f:
                raise RuntimeError(f"server exited with {server['proc'].returncode}:\n{f.read()}")
        try:
            if httpx.get(server["url"] + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server {server['url']} did not come up in time")


@contextlib.contextmanager
def running_servers(arg_lists: list[list[str]], timeout: float = 600, module: str = "ernie_jax.serve",
                    optimized: bool = False):
    """Several servers started together (they compile side by side), each up and healthy; yields their
    dicts (see launch) and kills those still running on the way out."""
    servers = [launch(module, args, optimized=optimized) for args in arg_lists]
    try:
        deadline = time.time() + timeout
        for s in servers:
            wait_healthy(s, deadline)
        yield servers
    finally:
        for s in servers:
            if s["proc"].poll() is None:
                s["proc"].kill()
                s["proc"].wait()


def server_state(server) -> str:
    """The server's exit status and log tail, for a failure message (a crash shows as a closed connection)."""
    with open(server["log"]) as f:
        tail = f.read()[-4000:]
    return f"\nserver exit status: {server['proc'].poll()}\nserver log tail:\n{tail}"


def metrics(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def metric(values: dict, name: str, **labels) -> float:
    """Sum of the series of `name` whose labels include `labels`."""
    total = 0.0
    for key, v in values.items():
        base = key.split("{")[0]
        if base == name and all(f'{k}="{val}"' in key for k, val in labels.items()):
            total += v
    return total


def wait_idle(url: str, timeout: float = 30) -> dict:
    """Metrics once nothing runs or waits and every KV page is free; fails after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = metrics(url)
        if metric(m, "ernie_jax:num_requests_running") == 0 and metric(m, "ernie_jax:kv_cache_usage_perc") == 0 \
                and metric(m, "ernie_jax:num_requests_waiting") == 0:
            return m
        time.sleep(0.2)
    raise AssertionError(f"requests still running after {timeout}s: {m}")


def taken_whole(router_url: str, server_urls: list[str]) -> float:
    """The router's count of requests one of these servers both prefilled and decoded (pd_requests_total)."""
    return sum(v for k, v in metrics(router_url).items() if k.startswith("ernie_jax_router:pd_requests_total")
               and any(k.count(u) == 2 for u in server_urls))


def prompt_burst(url: str, n: int, first: int = 0, prompt_len: int = 200, max_tokens: int = 8) -> list[float]:
    """n streamed completions sent at once, prompts first .. first + n - 1 (token ids; prompts of different
    numbers share no prefix, below 900); each one's seconds to its first token."""
    from ernie_jax.assets import EMBEDDED_MODEL_NAME

    async def one(client, i):
        body = {"model": EMBEDDED_MODEL_NAME, "prompt": [10 + (13 * j + i) % 900 for j in range(prompt_len)],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        t0 = time.perf_counter()
        async with client.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    assert '"error"' not in line, line
                    return time.perf_counter() - t0

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(first, first + n)))
    return asyncio.run(run())
