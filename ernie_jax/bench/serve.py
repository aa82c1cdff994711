"""Serving benchmark client: `python -m ernie_jax.bench serve ...`, defined like vLLM's `vllm bench serve`.

    python -m ernie_jax.bench serve --url http://127.0.0.1:8180 --num-prompts 64 --input-len 512 --output-len 128 \\
        [--concurrency 16] [--request-rate 8] [--goodput ttft:2000 tpot:50] [--json result.json]

This module owns the load generator (random token-id prompts, Poisson arrivals, a concurrency cap), the
per-request measurement over a streaming OpenAI-compatible endpoint, and the aggregate report. Metrics follow
vLLM's benchmark_serving definitions: TTFT is send -> first chunk carrying non-empty text; ITL is the gap between
successive content chunks; E2EL is send -> last content chunk; TPOT = (E2EL - TTFT) / (output tokens - 1), with
output tokens taken from the server's usage block; goodput counts requests meeting every given SLO. It talks HTTP
only (httpx + numpy), so it never loads JAX itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")
# The chat endpoint needs text; common short words stay close to one token each, so the word count
# approximates --input-len (the server's usage block gives the true count).
_WORD_TEXT = ("the of and to in is it that for on as with was at by be this are from or have an not but they his "
               "her one all we can there which do their if will up out about who get so them some when make time "
               "like into just him know take year your good could see other than then now look only come over "
               "think also back after use two how our work first well way even new want because any these give "
               "day most")
WORDS = _WORD_TEXT.split()


class BenchError(Exception):
    """Ends the run with a one-line message instead of a traceback."""


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    usage_reported: bool = False
    error: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8180", help="server base URL")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    ap.add_argument("--model", default=None, help="default: the first id from GET /v1/models")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=None, help="max requests in flight (default: unbounded)")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests/s with Poisson arrivals (default inf: all at once, subject to --concurrency)")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="lengths uniform in [len*(1-r), len*(1+r)]")
    ap.add_argument("--vocab-size", type=int, default=1000, help="prompt token ids are drawn from [10, vocab)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                    help="SLOs in ms, e.g. ttft:2000 tpot:50 e2el:10000")
    ap.add_argument("--percentiles", default="50,99", help="comma-separated, e.g. 50,90,99.9")
    ap.add_argument("--warmup", type=int, default=1, help="requests sent first and not counted")
    ap.add_argument("--json", default=None, metavar="FILE", help="write config, metrics and per-request data")
    args = ap.parse_args(argv)
    try:
        args.percentile_list = [float(p) for p in args.percentiles.split(",") if p.strip()]
    except ValueError:
        ap.error(f"--percentiles: expected numbers like 50,99, got {args.percentiles!r}")
    if any(not 0 < p <= 100 for p in args.percentile_list):
        ap.error("--percentiles must lie in (0, 100]")
    try:
        args.slos = parse_goodput(args.goodput or [])
    except ValueError as e:
        ap.error(str(e))
    if not 0 <= args.range_ratio < 1:
        ap.error("--range-ratio must lie in [0, 1)")
    if args.vocab_size <= 10:
        ap.error("--vocab-size must exceed 10")
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.concurrency is not None and args.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    if args.request_rate <= 0 or args.warmup < 0:
        ap.error("--request-rate must be > 0 and --warmup >= 0")
    return args


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`ttft:2000 tpot:50` -> {"ttft": 2.0, "tpot": 0.05} (seconds)."""
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS:
            raise ValueError(f"--goodput: unknown SLO {key!r} in {item!r}; use {', '.join(SLO_KEYS)}")
        try:
            slos[key] = float(value) / 1e3
        except ValueError:
            raise ValueError(f"--goodput: {item!r} is not KEY:MILLISECONDS") from None
    return slos


def sample_requests(args) -> list[tuple[list[int] | str, int, int]]:
    """(prompt, input_len, output_len) per request; the seed makes runs repeatable across servers."""
    rng = np.random.default_rng(args.seed)
    r = args.range_ratio

    def lens(n):
        lo, hi = max(1, math.floor(n * (1 - r))), max(1, math.ceil(n * (1 + r)))
        return rng.integers(lo, hi + 1, args.num_prompts).tolist()

    in_lens, out_lens = lens(args.input_len), lens(args.output_len)
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        if args.endpoint == "chat":
            prompt = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_in))
        else:
            prompt = rng.integers(10, args.vocab_size, n_in).tolist()
        out.append((prompt, n_in, n_out))
    return out


def _payload(endpoint: str, model: str, prompt, output_len: int) -> dict:
    body = {"model": model, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        return {**body, "messages": [{"role": "user", "content": prompt}], "max_completion_tokens": output_len}
    return {**body, "prompt": prompt, "max_tokens": output_len}


async def send_request(client: httpx.AsyncClient, url: str, body: dict, prompt_len: int) -> RequestResult:
    res = RequestResult(prompt_len=prompt_len)
    chat = "messages" in body
    n_chunks, last = 0, 0.0
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace").strip()
                res.error = f"HTTP {resp.status_code}: {text[:500]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments / keep-alives
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return res
                if usage := chunk.get("usage"):
                    if usage.get("completion_tokens") is not None:
                        res.output_tokens, res.usage_reported = int(usage["completion_tokens"]), True
                    if chat and usage.get("prompt_tokens") is not None:
                        res.prompt_len = int(usage["prompt_tokens"])  # words -> tokens is the server's business
                choices = chunk.get("choices") or [{}]
                text = (choices[0].get("delta") or {}).get("content") if chat else choices[0].get("text")
                if not text:
                    continue  # role-only / finish / usage chunks carry no token
                now = time.perf_counter()
                if n_chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last, n_chunks = now, n_chunks + 1
    # Malformed chunks (bad JSON, unexpected shapes) fail this request rather than the whole run.
    except (httpx.HTTPError, httpx.InvalidURL, ValueError, TypeError, AttributeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return res
    if n_chunks == 0:
        res.error = "stream ended without any content chunk (no TTFT)"
        return res
    res.latency = last - start
    if not res.usage_reported:
        res.output_tokens = n_chunks
    res.success = True
    return res


async def _first_model(client: httpx.AsyncClient, base: str) -> str:
    resp = await client.get(f"{base}/v1/models")
    if resp.status_code != 200:
        raise BenchError(f"GET {base}/v1/models -> HTTP {resp.status_code}: {resp.text[:300]}")
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"GET {base}/v1/models: no model id in {resp.text[:300]!r}; pass --model") from None


SPEC_METRIC = re.compile(r'^ernie_jax:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens|'
                         r'num_accepted_tokens_per_pos)_total\{([^}]*)\} ([0-9.e+-]+)$', re.M)


def parse_spec_counters(text: str) -> dict | None:
    """The speculative-decoding counters of a Prometheus scrape: {name or (name, position): value}, or None
    when the server does not speculate."""
    found: dict = {}
    for name, labels, value in SPEC_METRIC.findall(text):
        position = re.search(r'position="(\d+)"', labels)
        key = (name, int(position.group(1))) if position else name
        found[key] = found.get(key, 0.0) + float(value)
    return found or None


async def _spec_counters(client, base: str) -> dict | None:
    try:
        return parse_spec_counters((await client.get(f"{base}/metrics")).text)
    except httpx.HTTPError:
        return None


def spec_decode_metrics(before: dict | None, after: dict | None) -> dict | None:
    """vLLM's bench serve figures over the run: acceptance rate, mean acceptance length, per-position rates."""
    if not before or not after:
        return None
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts = d.get("num_drafts", 0.0)
    if not drafts:
        return None
    positions = sorted(k[1] for k in d if isinstance(k, tuple))
    return {"drafts": int(drafts), "draft_tokens": int(d.get("num_draft_tokens", 0)),
            "accepted_tokens": int(d.get("num_accepted_tokens", 0)),
            "acceptance_rate": d.get("num_accepted_tokens", 0) / max(d.get("num_draft_tokens", 0), 1),
            "acceptance_length": 1 + d.get("num_accepted_tokens", 0) / drafts,
            "per_position": [d[("num_accepted_tokens_per_pos", p)] / drafts for p in positions]}


async def run_benchmark(args) -> dict:
    base = args.url.rstrip("/").removesuffix("/v1")
    if not base.startswith(("http://", "https://")):
        raise BenchError(f"--url {args.url!r}: expected http://host:port")
    url = f"{base}/v1/chat/completions" if args.endpoint == "chat" else f"{base}/v1/completions"
    requests = sample_requests(args)
    # Arrival gaps are drawn up front from their own stream, so prompts do not depend on --request-rate.
    gaps = (np.random.default_rng(args.seed + 1).exponential(1 / args.request_rate, len(requests))
            if math.isfinite(args.request_rate) else np.zeros(len(requests)))
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    # No overall deadline (long generations are legitimate), but an unreachable server fails fast.
    timeout = httpx.Timeout(None, connect=10.0)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        try:
            model = args.model or await _first_model(client, base)
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise BenchError(f"cannot reach {base}: {type(e).__name__}: {e}") from None
        sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None

        async def one(prompt, n_in, n_out):
            body = _payload(args.endpoint, model, prompt, n_out)
            if sem is None:
                return await send_request(client, url, body, n_in)
            async with sem:
                return await send_request(client, url, body, n_in)

        if args.warmup:
            warm = await asyncio.gather(*(one(*requests[i % len(requests)]) for i in range(args.warmup)))
            if bad := next((w for w in warm if not w.success), None):
                raise BenchError(f"warm-up request to {url} failed: {bad.error}")
        spec_before = await _spec_counters(client, base)
        tasks = []
        start = time.perf_counter()
        for req, gap in zip(requests, gaps):
            if tasks and gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(*req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        spec_after = await _spec_counters(client, base)
    metrics = calculate_metrics(results, duration, args.slos, args.percentile_list)
    metrics["spec_decode"] = spec_decode_metrics(spec_before, spec_after)
    config = {k: v for k, v in vars(args).items() if k not in ("slos", "percentile_list")}
    return {"config": {**config, "model": model, "request_rate": str(args.request_rate)}, **metrics}


def calculate_metrics(results: list[RequestResult], duration: float, slos: dict[str, float],
                      percentiles: list[float]) -> dict:
    ok = [r for r in results if r.success]
    # Single-token requests have no TPOT; like vLLM they count as meeting a TPOT SLO.
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None for r in ok]
    n_good = None
    if slos:
        n_good = sum(all(v <= slos[k] for k, v in (("ttft", r.ttft), ("tpot", t), ("e2el", r.latency))
                         if k in slos and v is not None) for r, t in zip(ok, tpot))
    total_in, total_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    m = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
         "total_token_throughput": (total_in + total_out) / duration,
         "good_completed": n_good, "request_goodput": None if n_good is None else n_good / duration,
         "usage_missing": sum(not r.usage_reported for r in ok)}
    series = {"ttft": [r.ttft for r in ok], "tpot": [t for t in tpot if t is not None],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
    for name, xs in series.items():
        a = np.asarray(xs, dtype=np.float64) * 1e3 if xs else np.zeros(1)
        m[f"mean_{name}_ms"], m[f"median_{name}_ms"], m[f"std_{name}_ms"] = a.mean(), np.median(a), a.std()
        for p in percentiles:
            m[f"p{p:g}_{name}_ms"] = float(np.percentile(a, p))
    m = {k: float(v) if isinstance(v, np.floating) else v for k, v in m.items()}
    m.update(input_lens=[r.prompt_len for r in results], output_lens=[r.output_tokens for r in results],
             ttfts=[r.ttft for r in results], itls=[r.itl for r in results], e2els=[r.latency for r in results],
             errors=[r.error for r in results])
    return m


def print_report(res: dict, percentiles: list[float], file=None) -> None:
    file = file or sys.stdout  # looked up per call, so redirected stdout is honoured
    c = res["config"]

    def row(label, value):
        print(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}", file=file)

    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="), file=file)
    row("Model:", c["model"])
    row("Endpoint:", c["endpoint"])
    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    row("Maximum request concurrency:", c["concurrency"] or "unbounded")
    row("Request rate (req/s):", c["request_rate"])
    row("Benchmark duration (s):", res["duration"])
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"])
    if res["request_goodput"] is not None:
        row("Request goodput (req/s):", res["request_goodput"])
    row("Output token throughput (tok/s):", res["output_throughput"])
    row("Total token throughput (tok/s):", res["total_token_throughput"])
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print("{s:{c}^50}".format(s=title, c="-"), file=file)
        row(f"Mean {name.upper()} (ms):", res[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", res[f"median_{name}_ms"])
        for p in percentiles:
            if p != 50:  # the median row already shows it
                row(f"P{p:g} {name.upper()} (ms):", res[f"p{p:g}_{name}_ms"])
    if spec := res.get("spec_decode"):
        print("{s:{c}^50}".format(s="Speculative Decoding", c="-"), file=file)
        row("Acceptance rate (%):", 100 * spec["acceptance_rate"])
        row("Acceptance length:", spec["acceptance_length"])
        row("Drafts:", spec["drafts"])
        row("Draft tokens:", spec["draft_tokens"])
        row("Accepted tokens:", spec["accepted_tokens"])
        for i, rate in enumerate(spec["per_position"]):
            row(f"Position {i} acceptance rate (%):", 100 * rate)
    print("=" * 50, file=file)
    if res["usage_missing"]:
        print(f"note: {res['usage_missing']} responses had no usage block; their output tokens are the count "
              "of content chunks", file=file)
    if res["failed"]:
        first = next(e for e in res["errors"] if e)
        print(f"note: {res['failed']} requests failed; first error: {first}", file=file)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        res = asyncio.run(run_benchmark(args))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print_report(res, args.percentile_list)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if not res["completed"]:
        print(f"error: all {res['failed']} requests failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
