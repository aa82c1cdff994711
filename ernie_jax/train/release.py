"""Release a training run as an ERNIE-4.5 model folder in the FP8 Paddle layout (the embedded default).

    python -m ernie_jax.train.release --run RUN [--dst DIR] [--bf16-dst DIR] [--no-check]

1. The run's latest checkpoint (train.run.load_trained), in BF16, under the Paddle release names
   (checkpoint.layouts.PADDLE: [in, out] linears, one tensor per expert, the correction bias as [1, E], router
   and bias F32), in two shards with an index, plus config.json in the Paddle dialect (docs/model.md §1)
   and the run's tokenizer files, chat template and generation config (train.vocab).
2. converters.quantize_fp8 turns that BF16 folder into the FP8 release layout (128x128 blocks), written to
   --dst (default: the packaged ernie_jax/assets/ernie-4.5-tiny-fp8). --bf16-dst keeps the BF16 folder
   (the evaluation's f32/bf16 reference).

The folder is written under a temporary name and moved into place at the end, so a failed release never
leaves something that looks like a finished model. The output depends only on the checkpoint, the tokenizer
and the library versions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import ml_dtypes
import numpy as np

from ernie_jax.assets import EMBEDDED_MODEL_DIR, EMBEDDED_MODEL_NAME

# ---- model -----------------------------------------------------------------------------------------------
QUANTIZATION_CONFIG = {"weight_block_size": [128, 128]}  # added to quantize_fp8's dense/moe/mix_quant keys


def paddle_tensors(cfg, weights: dict) -> dict[str, np.ndarray]:
    """The weights pytree under the Paddle release names (checkpoint.layouts.PADDLE), [in, out] linears,
    one tensor per expert, the correction bias as [1, E]; router and bias F32, everything else BF16."""
    from ernie_jax.checkpoint.layouts import PADDLE, Src
    from ernie_jax.model.weights import F32_LEAVES

    out: dict[str, np.ndarray] = {}
    leaf_of = {src: leaf for table in (PADDLE.top, PADDLE.layer, PADDLE.mtp) for leaf, src in table.items()}

    def put(prefix: str, src, arr: np.ndarray):
        assert isinstance(src, Src) and not src.transpose, src
        arr = np.asarray(arr, np.float32 if leaf_of[src] in F32_LEAVES else ml_dtypes.bfloat16)
        if "{e}" in src.key:
            for e in range(arr.shape[0]):
                out[prefix + src.key.format(e=e)] = arr[e]
        else:
            out[prefix + src.key] = arr.reshape(1, -1) if src.squeeze else arr

    for leaf in ("embed", "final_norm", "lm_head"):
        if leaf in weights:
            put("", PADDLE.top[leaf], weights[leaf])
    for seg, seg_w in zip(cfg.layer_segments(), weights["segments"]):
        for j in range(seg.count):
            for leaf, arr in seg_w.items():
                put(PADDLE.layer_prefix.format(i=seg.start + j), PADDLE.layer[leaf], arr[j])
    if "mtp" in weights:
        for name in ("emb_norm", "hidden_norm", "proj"):
            put("", PADDLE.mtp[name], weights["mtp"][name])
        for leaf, arr in weights["mtp"]["layer"].items():
            put(PADDLE.mtp_layer_prefix, PADDLE.layer[leaf], arr)
    return out


def write_bf16_checkpoint(folder: str, cfg, tensors: dict[str, np.ndarray]) -> None:
    """Two shards and an index, like the release: embedding and the first half of the layers, then the rest."""
    from ernie_jax.checkpoint.safetensors_io import save_file

    half = cfg.num_hidden_layers // 2
    first = {k for k in tensors if k.startswith("ernie.embed_tokens") or any(
        k.startswith(f"ernie.layers.{i}.") for i in range(half))}
    shards = [sorted(first), sorted(set(tensors) - first)]
    weight_map, total = {}, 0
    for n, names in enumerate(shards):
        file = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        for k in names:
            weight_map[k] = file
            total += tensors[k].nbytes
        save_file({k: tensors[k] for k in names}, os.path.join(folder, file))
    _dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
          os.path.join(folder, "model.safetensors.index.json"))


# ---- build -----------------------------------------------------------------------------------------------
def _dump(obj: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_bf16_release(run: str, dst: str, name: str = EMBEDDED_MODEL_NAME) -> dict:
    """The run's latest checkpoint as a BF16 Paddle model folder; returns its run info."""
    import jax

    from ernie_jax.train.run import load_trained

    cfg, params, info = load_trained(run)
    tokenizer = os.path.join(run, "tokenizer")
    os.makedirs(dst)
    for f in sorted(os.listdir(tokenizer)):
        shutil.copy(os.path.join(tokenizer, f), os.path.join(dst, f))
    _dump({**info["model_config"], "model_name": name, "paddlenlp_version": "3.0.0"},
          os.path.join(dst, "config.json"))
    write_bf16_checkpoint(dst, cfg, paddle_tensors(cfg, jax.tree.map(np.asarray, params)))
    return info


def build(run: str, dst: str = EMBEDDED_MODEL_DIR, bf16_dst: str | None = None) -> str:
    from converters import quantize_fp8

    with tempfile.TemporaryDirectory(prefix="ernie_release_") as tmp:
        src = os.path.join(tmp, "bf16-paddle")
        write_bf16_release(run, src)
        fp8 = os.path.join(tmp, "fp8-paddle")
        quantize_fp8.convert(src, fp8, quiet=True)
        with open(os.path.join(fp8, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"].update(QUANTIZATION_CONFIG)
        _dump(config, os.path.join(fp8, "config.json"))
        for out, folder in ((dst, fp8), (bf16_dst, src)):
            if out:
                shutil.rmtree(out + ".partial", ignore_errors=True)
                shutil.copytree(folder, out + ".partial")
                shutil.rmtree(out, ignore_errors=True)
                os.replace(out + ".partial", out)
    return dst


SAMPLE_PROMPTS = ("Tell me about the sea.", "What do you think of Mr. Darcy?", "你好", "说说曹操。")


def check(path: str) -> None:
    """Print what the model answers to a few chat prompts, greedy and with the default sampling."""
    from ernie_jax.config import ErnieConfig
    from ernie_jax.llm import LLM
    from ernie_jax.sampling import SamplingParams

    max_len = min(512, ErnieConfig.from_pretrained(path).max_position_embeddings)
    llm = LLM(path, max_model_len=max_len, max_num_seqs=2, max_num_batched_tokens=64, compilation_cache_dir=None)
    for label, sp in (("greedy", SamplingParams(temperature=0, max_tokens=48)),
                      ("sampled (T=0.8, top_p=0.8, seed 0)", SamplingParams(temperature=0.8, top_p=0.8, seed=0,
                                                                           max_tokens=48))):
        for prompt in SAMPLE_PROMPTS:
            out = llm.chat([{"role": "user", "content": prompt}], sp)[0].outputs[0]
            print(f"[{label}] {prompt!r} -> {out.text!r} ({out.finish_reason})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.train.release", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="training run folder (python -m ernie_jax.train --out RUN)")
    ap.add_argument("--dst", default=EMBEDDED_MODEL_DIR, help="output folder (default: the packaged one)")
    ap.add_argument("--bf16-dst", default=None, help="also keep the BF16 Paddle folder here")
    ap.add_argument("--no-check", action="store_true", help="skip the sample generations at the end")
    args = ap.parse_args(argv)
    from ernie_jax.train.run import RunError
    try:
        dst = build(args.run, args.dst, args.bf16_dst)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst) for f in fs)
    print(f"wrote {dst}: {size / 1e6:.2f} MB")
    if not args.no_check:
        check(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
