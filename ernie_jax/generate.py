"""Command-line generation: `python -m ernie_jax.generate [--model DIR|PRESET] [--prompt TEXT]`.

Runs the offline `LLM` API (by default on the trained model shipped in the package) and prints the tokens
(and text when the model folder has a tokenizer), with load, compile and generation times. Prompts are text
(`--prompt`) or token ids (`--prompt-token-ids 1,300,42`); a preset's random model has no tokenizer.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.generate", description=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint folder or preset name (random weights); default: "
                    "the trained ernie-4.5-tiny-fp8 shipped in the package")
    ap.add_argument("--prompt", action="append", help="text prompt (needs tokenizer.model); repeatable")
    ap.add_argument("--prompt-token-ids", action="append",
                    help="comma-separated token ids, e.g. 1,300,42; repeatable")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args(argv)

    from ernie_jax import LLM, SamplingParams
    from ernie_jax.assets import EMBEDDED_MODEL_NAME

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype)
    cfg = llm.model.config
    report = llm.engine.compile_report.programs
    print(f"loaded {args.model or EMBEDDED_MODEL_NAME}: {cfg.num_hidden_layers} layers ({cfg.num_moe_layers} MoE, "
          f"{cfg.moe_num_experts} experts top-{cfg.moe_k}), hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
          f"{args.dtype}; engine ready in {time.perf_counter() - t0:.1f}s ({len(report)} programs compiled in "
          f"{sum(s for _, _, s in report):.1f}s)")
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    if args.prompt_token_ids:
        kw = {"prompt_token_ids": [[int(t) for t in s.split(",") if t.strip()] for s in args.prompt_token_ids]}
    elif args.prompt or llm.tokenizer is not None:
        kw = {"prompts": args.prompt or ["Call me Ishmael."]}
    else:  # a preset has no tokenizer
        kw = {"prompt_token_ids": [[1, 300, 42, 7]]}
    for attempt in ("first call", "second call"):
        t0 = time.perf_counter()
        outs = llm.generate(sampling_params=sp, **kw)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{attempt}: {n} tokens in {dt:.2f}s")
    for o in outs:
        c = o.outputs[0]
        print(f"prompt {o.prompt_token_ids} -> {c.token_ids} ({c.finish_reason})")
        if c.text is not None:
            print(f"  text: {c.text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
