"""Greedy outputs of the embedded model in four engine setups, saved or compared with a saved run: the check
that a change to the CPU formulations (or anything else under the model) leaves every token the same.

    python benchmarks/greedy_outputs.py --out before.json            # on the old commit
    python benchmarks/greedy_outputs.py --compare before.json        # on the new one: exit 1 on a difference
    python benchmarks/greedy_outputs.py --model DIR --dtype bfloat16 --variant routed_experts=xla_cpu --out a.json
    python benchmarks/greedy_outputs.py --compare before.json --num-scheduler-steps 8  # multi-step decode

Setups: colocated, colocated with MTP (2 draft tokens), PD (prefill and decode on their own devices) and PD
with MTP; 8 chat prompts, 48 greedy tokens each, EOS ignored; float32 by default (`--dtype`). A difference is
reported with its setup, prompt and first differing position.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a mixture of experts is.",
           "List three prime numbers.", "Translate 'good morning' into German.", "Tell me a short story about a fox.",
           "How do airplanes fly?", "What is 12 times 7?"]
SETUPS = {"colocated": {}, "colocated+mtp": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
          "pd": {"mesh": 2, "prefill_devices": 1},
          "pd+mtp": {"mesh": 2, "prefill_devices": 1,
                     "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}}


def run(dtype: str, max_tokens: int, model: str | None = None, variant: str | None = None,
        setups: list[str] | None = None, num_scheduler_steps: int = 1) -> dict[str, list[list[int]]]:
    from ernie_jax.sharding.mesh import request_host_devices
    request_host_devices(2)
    from ernie_jax import LLM, SamplingParams
    from ernie_jax.assets import EMBEDDED_MODEL_DIR
    from ernie_jax.bench.step_profile import _variant_model
    from ernie_jax.tokenizer import Tokenizer
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokenizer = Tokenizer.from_pretrained(model if model and os.path.isdir(model) else EMBEDDED_MODEL_DIR)
    prompts = [{"prompt_token_ids": tokenizer.encode_chat([{"role": "user", "content": p}])} for p in PROMPTS]
    out = {}
    for name in setups or SETUPS:
        llm = LLM(model if variant is None else _variant_model(model, dtype, variant), dtype=dtype, max_num_seqs=8,
                  max_model_len=256, background_compile=False, num_scheduler_steps=num_scheduler_steps, **SETUPS[name])
        out[name] = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, sp)]
        print(f"{name}: {sum(map(len, out[name]))} tokens", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the outputs here")
    ap.add_argument("--compare", help="compare with the outputs saved here")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--model", help="a checkpoint folder or preset (default: the embedded model)")
    ap.add_argument("--variant", help="an execution config, as bench step-profile's --variant (FIELD=VALUE,...)")
    ap.add_argument("--num-scheduler-steps", type=int, default=1, help="decode steps a program runs (multi-step "
                    "decode; the MTP setups take single steps)")
    ap.add_argument("--setups", help=f"comma-separated, of {','.join(SETUPS)} (default: all; the MTP ones need "
                    "the model's MTP block)")
    args = ap.parse_args()
    setups = args.setups.split(",") if args.setups else None
    if unknown := set(setups or ()) - set(SETUPS):
        raise SystemExit(f"--setups: unknown {sorted(unknown)}; expected of {list(SETUPS)}")
    got = {"dtype": args.dtype, "max_tokens": args.max_tokens,
           "outputs": run(args.dtype, args.max_tokens, args.model, args.variant, setups, args.num_scheduler_steps)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(got, f)
    if not args.compare:
        return 0
    with open(args.compare) as f:
        want = json.load(f)
    if (want["dtype"], want["max_tokens"]) != (args.dtype, args.max_tokens):
        raise SystemExit(f"{args.compare} holds {want['dtype']} outputs of {want['max_tokens']} tokens; "
                         f"run with --dtype {want['dtype']} --max-tokens {want['max_tokens']}")
    differ = 0
    if set(want["outputs"]) != set(got["outputs"]):
        raise SystemExit(f"{args.compare} holds the setups {sorted(want['outputs'])}; this run {sorted(got['outputs'])}")
    for setup, rows in want["outputs"].items():
        for i, (a, b) in enumerate(zip(rows, got["outputs"][setup])):
            if a != b:
                differ += 1
                at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                print(f"{setup}, prompt {i}: differs from token {at} on")
    total = sum(map(len, want["outputs"].values()))
    print(f"{total - differ} of {total} greedy outputs identical")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
