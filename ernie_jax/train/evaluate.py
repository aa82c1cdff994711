"""Held-out evaluation of a model folder: perplexity per numerics variant, MTP accuracy, expert load, baseline.

    python -m ernie_jax.train.evaluate --bf16 BF16_FOLDER --fp8 FP8_FOLDER --corpus CORPUS [--json OUT]

Every held-out document is scored the way lm-evaluation-harness scores `loglikelihood_rolling`: its tokens
cut into windows of --max-length that predict disjoint spans, the first token predicted from a prefix
token (`<s>`), later windows with the preceding tokens as context. So the figures here are the ones the
harness reports through the server (benchmarks/lm_eval_tasks/heldout_rolling.yaml), token for token.

Variants: f32 and bf16 (the BF16 folder), FP8 weight-only and FP8 w8a8 (the FP8 folder), the FP8 KV
cache (bf16 weights, fp8 cache), and the integer weights quantized from the BF16 folder at load (wint8, wint4
per channel and in groups of 128 and 64, w4a8; quant/int_weights.py); every variant but f32 attends through a paged KV cache as the engine does.
Reported per variant: token, byte and word perplexity (English and Chinese too), next-token top-1 and the
MTP block's next-next-token top-1 accuracy (an upper bound of greedy MTP acceptance), and, for bf16, the
tokens per expert per MoE layer. The unigram baseline uses the train split's token frequencies (add-one).

Shapes: windows [B, L]; B windows per batch, L = max length.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ernie_jax.config import ErnieConfig
from ernie_jax.model.forward import forward, mtp_forward
from ernie_jax.model.kv_cache import KVCache
from ernie_jax.ops.selfcheck import execution_for
from ernie_jax.train.corpus import load_corpus

BATCH = 8
PREFIX_TOKEN = 1  # <s>: lm-evaluation-harness's prefix for rolling loglikelihood (the tokenizer's BOS)


def rolling_windows(tokens: list[int], prefix: int, max_len: int) -> list[tuple[list[int], int]]:
    """(window input ids, how many of its last positions are scored) covering `tokens` once each:
    lm-evaluation-harness's rolling windows with a context of 1 (its get_rolling_token_windows followed by
    make_disjoint_window). The window's targets are its inputs shifted by one, plus the next token."""
    out, done, n = [], 0, len(tokens)
    seq = [prefix] + tokens
    while done < n:
        span = min(max_len, n - done)
        end = done + span  # predict tokens[done:end] = seq[done + 1:end + 1]
        start = max(0, end - max_len)  # inputs seq[start:end]
        out.append((seq[start:end + 1], span))
        done = end
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "kv_dtype", "ex"))
def _score(weights, window, scored, *, cfg: ErnieConfig, kv_dtype, ex):
    """window [B, L+1] ids (inputs window[:, :L], targets window[:, 1:]); scored [B, L] 0/1.
    Returns per window (log-likelihood sum, top-1 hits, MTP top-1 hits, MTP positions) and expert counts."""
    B, L1 = window.shape
    L = L1 - 1
    ids, targets = window[:, :L], window[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    cache = None if kv_dtype is None else KVCache.create(cfg, B, L, jnp.dtype(kv_dtype))
    out = forward(weights, cfg, ids, positions, cache, ex=ex)
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    ll = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    hit = (jnp.argmax(out.logits, axis=-1) == targets)
    res = [jnp.sum(ll * scored, -1), jnp.sum(hit * scored, -1)]
    if cfg.has_mtp:  # from x_{t+1} = targets[t] and h_t, predict targets[t+1]
        mtp = mtp_forward(weights, cfg, targets, out.hidden, positions, ex)
        both = scored[:, :-1] * scored[:, 1:]
        res += [jnp.sum((jnp.argmax(mtp[:, :-1], -1) == targets[:, 1:]) * both, -1), jnp.sum(both, -1)]
    valid = scored.reshape(-1).astype(jnp.int32)
    loads = tuple(jnp.sum(jax.nn.one_hot(e, cfg.moe_num_experts, dtype=jnp.int32) * valid[None, :, None, None],
                          axis=(1, 2)) for e in out.expert_ids)
    return res, loads


def _windows(sp, docs: list[dict], max_len: int):
    """Padded windows [n, L+1], scored masks [n, L], and each window's document index."""
    rows, masks, owner = [], [], []
    for i, d in enumerate(docs):
        for seq, span in rolling_windows(sp.encode(d["text"]), PREFIX_TOKEN, max_len):
            pad = max_len + 1 - len(seq)
            rows.append(seq + [0] * pad)
            m = np.zeros(max_len, np.float32)
            m[len(seq) - 1 - span:len(seq) - 1] = 1
            masks.append(m)
            owner.append(i)
    return np.asarray(rows, np.int32), np.stack(masks), np.asarray(owner)


def score_model(weights, cfg: ErnieConfig, rows, masks, kv_dtype=None) -> dict:
    """Score every window; windows run in batches of BATCH, each batch cut to the shortest of the lengths
    L/4, L/2, L that holds its windows (most Song ci are a fraction of a window). Returns the per-window
    results [n, 2 or 4] (in the windows' order) and the expert counts."""
    ex = execution_for(jax.devices()[0])
    n, L = masks.shape
    used = np.asarray([int(np.nonzero(m)[0].max()) + 1 if m.any() else 1 for m in masks])
    buckets = sorted({max(L // 4, 1), max(L // 2, 1), L})
    order = np.argsort(used, kind="stable")
    results, loads = np.zeros((n, 4 if cfg.has_mtp else 2)), None
    for b in range(0, n, BATCH):
        idx = order[b:b + BATCH]
        width = next(w for w in buckets if w >= used[idx].max())
        r = np.zeros((BATCH, width + 1), rows.dtype)
        m = np.zeros((BATCH, width), masks.dtype)
        r[:len(idx)], m[:len(idx)] = rows[idx, :width + 1], masks[idx, :width]
        res, ld = _score(weights, jnp.asarray(r), jnp.asarray(m), cfg=cfg, kv_dtype=kv_dtype, ex=ex)
        results[idx] = np.stack([np.asarray(x) for x in res], axis=-1)[:len(idx)]
        ld = [np.asarray(x) for x in ld]
        loads = ld if loads is None else [a + c for a, c in zip(loads, ld)]
    return {"per_window": results, "expert_load": loads}


def summarize(per_window: np.ndarray, owner: np.ndarray, docs: list[dict], masks: np.ndarray) -> dict:
    """Perplexities (token, byte, word as lm-evaluation-harness counts words: whitespace-separated) overall and
    per language, and top-1 accuracies."""
    tokens = masks.sum(-1)
    out = {}
    for lang in ("all", "en", "zh"):
        sel = [i for i, d in enumerate(docs) if lang == "all" or _lang(d) == lang]
        if not sel:
            continue
        w = np.isin(owner, sel)
        ll = per_window[w, 0].sum()
        text = [docs[i]["text"] for i in sel]
        n_bytes = sum(len(t.encode("utf-8")) for t in text)
        n_words = sum(len(t.split()) for t in text)
        out[lang] = {"tokens": int(tokens[w].sum()), "token_ppl": float(np.exp(-ll / tokens[w].sum())),
                     "byte_ppl": float(np.exp(-ll / n_bytes)), "word_ppl": float(np.exp(-ll / n_words)),
                     "bits_per_byte": float(-ll / n_bytes / np.log(2)),
                     "top1": float(per_window[w, 1].sum() / tokens[w].sum())}
        if per_window.shape[1] > 2:
            out[lang]["mtp_top1"] = float(per_window[w, 2].sum() / max(per_window[w, 3].sum(), 1))
    return out


def _lang(doc: dict) -> str:
    return "zh" if doc["source"] in ("songci", "sanguo") else "en"


def unigram_ppl(train_stream: np.ndarray, rows: np.ndarray, masks: np.ndarray, vocab: int) -> float:
    counts = np.bincount(train_stream, minlength=vocab).astype(np.float64) + 1
    logp = np.log(counts / counts.sum())
    targets = rows[:, 1:]
    return float(np.exp(-(logp[targets] * masks).sum() / masks.sum()))


VARIANTS = (  # name, folder, dtype, load_pretrained settings, KV cache dtype
    ("f32", "bf16", jnp.float32, {}, None),
    ("bf16", "bf16", jnp.bfloat16, {}, "bfloat16"),
    ("fp8 weight-only", "fp8", jnp.bfloat16, dict(fp8_compute="weight_only"), "bfloat16"),
    ("fp8 w8a8", "fp8", jnp.bfloat16, dict(fp8_compute="w8a8"), "bfloat16"),
    ("fp8 kv cache", "bf16", jnp.bfloat16, {}, "float8_e4m3fn"),
    ("wint8", "bf16", jnp.bfloat16, dict(quantization="wint8"), "bfloat16"),
    ("wint4", "bf16", jnp.bfloat16, dict(quantization="wint4"), "bfloat16"),
    ("wint4 g128", "bf16", jnp.bfloat16, dict(quantization="wint4", quant_group_size=128), "bfloat16"),
    ("wint4 g64", "bf16", jnp.bfloat16, dict(quantization="wint4", quant_group_size=64), "bfloat16"),
    ("w4a8", "bf16", jnp.bfloat16, dict(quantization="w4a8"), "bfloat16"),
)


def evaluate(bf16: str, fp8: str, corpus: str, max_len: int = 256, variants=VARIANTS, log=print,
             limit: int | None = None) -> dict:
    import sentencepiece as spm

    from ernie_jax.checkpoint.loader import load_pretrained
    from ernie_jax.train.data import build_stream

    sp = spm.SentencePieceProcessor(model_file=f"{bf16}/tokenizer.model")
    docs = load_corpus(corpus, "heldout")[:limit]
    if not docs:
        raise ValueError(f"{corpus}: no held-out documents to score (limit={limit})")
    rows, masks, owner = _windows(sp, docs, max_len)
    report = {"max_length": max_len, "documents": len(docs), "windows": len(rows), "variants": {}}
    cfg = None
    for name, which, dtype, settings, kv in variants:
        model = load_pretrained({"bf16": bf16, "fp8": fp8}[which], dtype=dtype, **settings)
        cfg = model.config
        res = score_model(model.weights(), cfg, rows, masks, kv)
        report["variants"][name] = summarize(res["per_window"], owner, docs, masks)
        if name == "bf16":
            report["expert_load"] = [x.tolist() for x in res["expert_load"]]
        log(f"{name:16} token ppl {report['variants'][name]['all']['token_ppl']:.2f}")
    train_stream = build_stream(sp, load_corpus(corpus, "train"), with_chat=False)
    report["unigram_token_ppl"] = unigram_ppl(train_stream, rows, masks, cfg.vocab_size)
    return report


def markdown(report: dict) -> str:
    lines = ["| variant | token ppl | byte ppl | en token ppl | zh token ppl | top-1 | MTP top-1 |",
             "|---|---|---|---|---|---|---|"]
    for name, v in report["variants"].items():
        en, zh = (v.get(lang, {}).get("token_ppl", float("nan")) for lang in ("en", "zh"))
        lines.append(f"| {name} | {v['all']['token_ppl']:.2f} | {v['all']['byte_ppl']:.4f} | "
                     f"{en:.2f} | {zh:.2f} | {v['all']['top1']:.3f} | "
                     f"{v['all'].get('mtp_top1', float('nan')):.3f} |")
    lines.append(f"| unigram baseline | {report['unigram_token_ppl']:.2f} | | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.train.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bf16", required=True, help="BF16 Paddle model folder (release --bf16-dst)")
    ap.add_argument("--fp8", required=True, help="FP8 Paddle model folder (the released one)")
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--max-length", type=int, default=256, help="window length (lm-eval's max_length)")
    ap.add_argument("--limit", type=int, default=None,
                    help="score the first N held-out documents only (what lm_eval --limit N scores)")
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated subset of {[v[0] for v in VARIANTS]} (default: all)")
    ap.add_argument("--json", default=None, help="write the full report here")
    args = ap.parse_args(argv)
    variants = VARIANTS
    if args.variants:
        names = [n.strip() for n in args.variants.split(",")]
        unknown = sorted(set(names) - {v[0] for v in VARIANTS})
        if unknown:
            ap.error(f"--variants: unknown {unknown}; known: {[v[0] for v in VARIANTS]}")
        variants = tuple(v for v in VARIANTS if v[0] in names)
    report = evaluate(args.bf16, args.fp8, args.corpus, args.max_length, variants, limit=args.limit)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
