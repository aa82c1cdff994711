"""Requests with n > 1 or several prompts, split between prefill and decode servers: one request per (prompt,
sample), each with one prompt and n = 1, routed like any other, and their answers merged into the answer one
server gives (choices indexed prompt x n + sample, one id, usage counting each prompt once); streamed chunks
are relayed as they arrive with their choice index rewritten.

Sample j of a seeded request carries seed + j (sampling.sample_seed, the rule a server applies to its own n
samples), so the texts equal one server's. A request this cannot send apart unchanged (an n or seed out of
range, more samples than the servers allow, an unknown prompt form) is not fanned out: it goes whole to a
server, whose error the client then gets as that server words it; so do requests for the prompt's echo or
logprobs, which the router never splits. A server's error for any one part is the
answer (the other parts' streams are closed).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

from ernie_jax.sampling import MAX_SEED, MIN_SEED, sample_seed


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def fan_out(path: str, body: dict, max_n: int, max_prompts: int) -> list[dict] | None:
    """The single-prompt, n = 1 requests of `body` in choice order, or None when it is one already or cannot
    be sent apart unchanged (then it goes whole to a server)."""
    n, seed = body.get("n", 1), body.get("seed")
    if not _is_int(n) or not 1 <= n <= max_n or body.get("best_of") not in (None, n):
        return None
    if body.get("echo") or body.get("prompt_logprobs") is not None:  # the router sends these whole
        return None
    if seed is not None and (not _is_int(seed) or not MIN_SEED <= seed <= MAX_SEED):
        return None
    if path.endswith("chat/completions"):
        prompts: list = [None]
    else:
        p = body.get("prompt")
        if isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)):
            prompts = [p]
        elif isinstance(p, list) and 0 < len(p) <= max_prompts and (
                all(isinstance(x, str) for x in p)
                or all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in p)):
            prompts = p
        else:
            return None
    if len(prompts) * n == 1:
        return None
    parts = []
    for prompt in prompts:
        for j in range(n):
            part = {**body, "n": 1, "seed": sample_seed(seed, j)}
            part.pop("best_of", None)
            if prompt is not None:
                part["prompt"] = prompt
            parts.append(part)
    return parts


def _merged_usage(usages: dict[int, dict], n: int) -> dict:
    """The usage of choices' usages (by choice index): each prompt's tokens once, cached tokens the most any
    of a prompt's samples reused (as one server counts them), completion tokens summed."""
    prompt: dict[int, int] = {}
    cached: dict[int, int] = {}
    completion = 0
    for k, u in usages.items():
        prompt[k // n] = u.get("prompt_tokens", 0)
        details = u.get("prompt_tokens_details") or {}
        cached[k // n] = max(cached.get(k // n, 0), details.get("cached_tokens") or 0)
        completion += u.get("completion_tokens", 0)
    total_prompt = sum(prompt.values())
    return {"prompt_tokens": total_prompt, "completion_tokens": completion, "total_tokens": total_prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


async def _close(answers: list[Response]) -> None:
    for a in answers:
        if isinstance(a, StreamingResponse):
            await a.upstream.close()


async def merge(answers: list[Response | BaseException], n: int, stream: bool) -> Response:
    """One answer from the parts' answers (in choice order)."""
    ok = [a for a in answers if isinstance(a, Response)]
    failed = next((a for a in answers if not isinstance(a, Response) or a.status_code != 200), None)
    if failed is not None:
        await _close(ok)
        if isinstance(failed, BaseException):
            raise failed
        return failed
    if not stream or not all(isinstance(a, StreamingResponse) for a in answers):
        if stream:  # a part answered whole although asked to stream: not expected of a server
            await _close(ok)
            return JSONResponse({"error": {"message": "a server answered a streamed request unstreamed",
                                           "type": "server_error", "code": 502}}, status_code=502)
        bodies = [json.loads(a.body) for a in answers]
        out = dict(bodies[0])
        out["choices"] = [{**b["choices"][0], "index": k} for k, b in enumerate(bodies)]
        out["usage"] = _merged_usage({k: b.get("usage") or {} for k, b in enumerate(bodies)}, n)
        return JSONResponse(out)
    return StreamingResponse(_merged_stream(answers, n), media_type="text/event-stream")


async def _events(answer: StreamingResponse) -> AsyncIterator[dict | None]:
    """The JSON events of a part's server-sent stream (None for its [DONE])."""
    buffer = b""
    async for chunk in answer.body_iterator:
        buffer += chunk if isinstance(chunk, bytes) else chunk.encode()
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    yield None if data == b"[DONE]" else json.loads(data)


async def _merged_stream(answers: list[StreamingResponse], n: int) -> AsyncIterator[bytes]:
    """The parts' chunks as they arrive, choice index rewritten, under the first chunk's id; their final usage
    chunks as one; an error event from any part ends the stream."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, answer: StreamingResponse) -> None:
        try:
            async for event in _events(answer):
                if event is not None:
                    await queue.put((k, event))
        except Exception as e:  # noqa: BLE001 -- a broken part is reported to the client, not raised mid-stream
            await queue.put((k, {"error": {"message": f"a part of this request failed: {e!r}",
                                           "type": "server_error", "code": 502}}))
        finally:
            await queue.put((k, None))

    tasks = [asyncio.create_task(pump(k, a)) for k, a in enumerate(answers)]
    usages: dict[int, dict] = {}
    final: dict | None = None
    head: dict | None = None
    running = len(tasks)
    try:
        while running:
            k, event = await queue.get()
            if event is None:
                running -= 1
                continue
            if "error" in event:
                yield f"data: {json.dumps(event)}\n\n".encode()
                break
            head = head or {key: event[key] for key in ("id", "created") if key in event}
            if event.get("usage"):
                usages[k] = event["usage"]
            if not event.get("choices") and event.get("usage"):  # a part's closing usage chunk
                final = event
                continue
            event = {**event, **head, "choices": [{**c, "index": k} for c in event["choices"]]}
            if event.get("usage"):  # continuous usage stats: the whole request's so far
                event["usage"] = _merged_usage(usages, n)
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
        else:
            if final is not None:
                yield f"data: {json.dumps({**final, **(head or {}), 'usage': _merged_usage(usages, n)})}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(answers)
