"""What structured output costs: the token-mask time per step, and the throughput of unconstrained requests
when constrained ones share their batches, in one run on the embedded model (`LLM`, one device).

    python benchmarks/structured_output.py [--requests 16] [--constrained 8] [--tokens 64] [--repeats 3]

Each repeat runs the same `--requests` unconstrained greedy chats twice, alternating: beside `--constrained`
more unconstrained chats (the baseline), and beside as many chats under a JSON schema. It reports the
unconstrained requests' output tok/s in each and the ratio, the mask seconds per masked step (every
constrained row's bitmask, computed while the forward pass runs), and whether the unconstrained requests'
greedy tokens were the same in both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ernie_jax import LLM, SamplingParams
from ernie_jax.structured import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                    "maxItems": 4}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
QUESTIONS = ["Tell me about the sea.", "What do you think of Mr. Darcy?", "Where is the captain going?", "你好",
             "说说曹操。", "Who are you?", "Describe a storm.", "What is a whale?"]


def run(llm, n: int, beside: int, tokens: int, constrained: bool):
    plain = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    guided = SamplingParams(temperature=0, max_tokens=tokens,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA)) if constrained else plain
    convs = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}] for i in range(n + beside)]
    runner = [i.runner for i in llm.engine.instances]
    masks0 = sum(r.mask_seconds for r in runner), sum(r.masked_steps for r in runner)
    t0 = time.perf_counter()
    outs = llm.chat(convs, [plain] * n + [guided] * beside)
    seconds = time.perf_counter() - t0
    base = outs[:n]
    mask_s = sum(r.mask_seconds for r in runner) - masks0[0]
    mask_steps = sum(r.masked_steps for r in runner) - masks0[1]
    for o in outs[n:] if constrained else ():
        if o.outputs[0].finish_reason == "stop":  # a reply cut by max_tokens is a prefix of one
            json.loads(o.outputs[0].text)
    beside_tokens = sum(len(o.outputs[0].token_ids) for o in outs[n:])
    return (sum(len(o.outputs[0].token_ids) for o in base) / seconds, [o.outputs[0].token_ids for o in base],
            mask_s / max(mask_steps, 1), beside_tokens, mask_steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--constrained", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n, beside = args.requests, args.constrained
    llm = LLM(max_num_seqs=n + beside, max_model_len=256, background_compile=False)
    run(llm, n, beside, 8, True)  # warm-up: every program and the grammar compiled
    base, guided, per_step, same, extra = [], [], [], True, []
    for _ in range(args.repeats):
        tps, want, *_ = run(llm, n, beside, args.tokens, False)
        base.append(tps)
        tps, got, mask, beside_tokens, steps = run(llm, n, beside, args.tokens, True)
        guided.append(tps)
        per_step.append(mask)
        extra.append(beside_tokens / beside)
        same &= got == want
    _, _, mask16, *_ = run(llm, 0, 16, args.tokens, True)
    print(f"unconstrained requests: {n}, beside them {beside} more ({args.tokens} tokens each), {args.repeats} "
          "repeats alternated")
    print(f"  beside unconstrained: {statistics.median(base):.1f} tok/s (runs: "
          f"{', '.join(f'{x:.1f}' for x in base)})")
    print(f"  beside constrained:   {statistics.median(guided):.1f} tok/s (runs: "
          f"{', '.join(f'{x:.1f}' for x in guided)}); ratio {statistics.median(guided) / statistics.median(base):.2f}")
    print(f"  greedy tokens of the unconstrained requests identical: {same}; the constrained replies averaged "
          f"{statistics.mean(extra):.1f} tokens (the unconstrained ones beside: {args.tokens}, ignore_eos)")
    print(f"  mask seconds per masked step: {1e3 * statistics.median(per_step):.2f} ms with {beside} constrained "
          f"rows, {1e3 * mask16:.2f} ms with 16")


if __name__ == "__main__":
    main()
