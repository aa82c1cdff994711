"""Integer weights against BF16: greedy agreement on chat prompts, and logit errors on a random model.

    python benchmarks/int_accuracy.py --bf16 BF16_FOLDER [--corpus CORPUS] [--prompts 32] [--tokens 32]
        [--preset bench-512]

1. Greedy agreement: each variant served as `LLM(BF16_FOLDER, quantization=...)` (the FP8 row from the same
   folder quantized at load) answers the same chat prompts greedily (held-out paragraphs of CORPUS as user
   turns, or fixed questions); reported against bf16: prompts answered identically, and the mean share of
   each answer that matches bf16 up to its first different token.
2. Logit error on a random model of `--preset` (no checkpoint: its weights drawn, then quantized in memory
   as `--quantization` does): max and mean |variant - bf16| relative to max and mean |bf16|, top-1
   agreement and KL(bf16 || variant) over every position of random token sequences, all in f32 compute so
   only the weights differ.
The held-out perplexity table is `python -m ernie_jax.train.evaluate` (its wint* and w4a8 rows).
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {"fp8 w8a8": dict(quantization="fp8"), "wint8": dict(quantization="wint8"),
            "wint4": dict(quantization="wint4"), "wint4 g128": dict(quantization="wint4", quant_group_size=128),
            "wint4 g64": dict(quantization="wint4", quant_group_size=64), "w4a8": dict(quantization="w4a8")}
QUESTIONS = ["Tell me about the sea.", "你好", "What do you think of Mr. Darcy?", "说说曹操。",
             "Where is the captain going?", "写一首词。"]


def greedy_agreement(bf16: str, corpus: str | None, n: int, tokens: int) -> None:
    from ernie_jax import LLM, SamplingParams
    from ernie_jax.bench.mtp import _prompts
    settings = dict(max_model_len=512, max_num_seqs=8)
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    def answers(**kw):
        llm = LLM(bf16, **settings, **kw)
        prompts = _prompts(llm, corpus, n) if corpus else [
            llm.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(n)]
        out = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
        llm.engine.shutdown()
        return out
    ref = answers()
    print(f"greedy agreement with bf16: {n} chat prompts ({'held-out paragraphs of ' + corpus if corpus else 'fixed'}"
          f"), {tokens} tokens each")
    print("| variant | identical answers | mean matching prefix |")
    print("|---|---|---|")
    for name, kw in VARIANTS.items():
        got = answers(**kw)
        same = sum(a == b for a, b in zip(got, ref))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) / len(b) for a, b in zip(got, ref)]
        print(f"| {name} | {same} / {n} | {np.mean(prefix):.3f} |")


def logit_errors(preset: str, batch: int, length: int) -> None:
    import jax
    import jax.numpy as jnp

    from ernie_jax import ErnieConfig
    from ernie_jax.accuracy import logit_metrics
    from ernie_jax.model.ernie import ErnieForCausalLM
    from ernie_jax.model.weights import init_weights, quantize_weights
    cfg = ErnieConfig.preset(preset)
    bf16 = jax.tree.map(np.asarray, init_weights(cfg, 0, jnp.bfloat16))
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (batch, length)).astype(np.int32)

    def logits(weights):
        return np.asarray(ErnieForCausalLM(cfg, weights, dtype=jnp.float32)(ids), np.float64)
    ref = logits(bf16)
    print(f"random {preset} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.moe_num_experts} "
          f"experts): logits of {batch} x {length} random tokens, f32 compute, against its bf16 weights")
    print("| variant | max rel error | mean rel error | top-1 agreement | KL |")
    print("|---|---|---|---|---|")
    for name, kw in VARIANTS.items():
        scheme = kw["quantization"]
        w = quantize_weights(bf16, "w8a8", scheme, kw.get("quant_group_size", -1))
        got = logits(w)
        m = logit_metrics(ref, got)
        err = np.abs(got - ref)
        print(f"| {name} | {err.max() / np.abs(ref).max():.4f} | {err.mean() / np.abs(ref).mean():.4f} | "
              f"{m['top1_agreement']:.3f} | {m['kl']:.2e} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bf16", default=None, help="BF16 checkpoint folder (converters.dequantize of an FP8 one)")
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--preset", default="bench-512")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=64)
    args = ap.parse_args()
    if args.bf16:
        greedy_agreement(args.bf16, args.corpus, args.prompts, args.tokens)
    if args.preset:
        logit_errors(args.preset, args.batch, args.length)
    return 0


if __name__ == "__main__":
    sys.exit(main())
