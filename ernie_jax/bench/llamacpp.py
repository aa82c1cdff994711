"""llama.cpp on the same weights, for `bench offline --compare-llamacpp DIR`: the GGUF and the timed run.

    python -m ernie_jax.bench offline --model MODEL --compare-llamacpp LLAMA_CPP_DIR --num-prompts 16 \\
        --input-len 128 --output-len 128 [--threads 2]

LLAMA_CPP_DIR is a llama.cpp checkout with `llama-batched-bench` built (in build/bin, or bin, or the folder
itself). The same weights reach both stacks in BF16 (or F32 with `--dtype float32`) through the HF layout:
- a preset (bench-512, ...): random weights saved by HF transformers (as `--compare-hf` makes them; torch),
  with the embedded model's SentencePiece tokenizer beside them (the converter needs one; the prompts are
  random token ids, so which tokenizer does not matter, but the preset's vocabulary must hold its pieces);
- a Paddle-layout folder (the embedded model, a release): `converters.export_hf --drop-mtp` (FP8 and integer
  weights dequantized and rounded once to BF16);
- an HF-layout folder: as it is.
ernie_jax then loads that HF folder, and llama.cpp's own `convert_hf_to_gguf.py` (it imports torch) writes the
GGUF (`--gguf FILE` gives one instead). That converter does not read the shared experts' width from the config:
it writes intermediate_size // num_key_value_heads, which holds for the released models but not for every
config (the embedded model's shared experts are 2 x 128 = 256 wide, the formula gives 384, and llama.cpp then
refuses the file); the width is checked after converting and set to moe_intermediate_size x
moe_num_shared_experts with gguf-py's `gguf_set_metadata.py` when it differs, saying so. Each timed run of
the engine is followed by one `llama-batched-bench -npp IN -ntg OUT -npl N` run (a process each time: it
loads the model and warms up before timing), so a slow spell of a shared machine hits both. Both figures
are output tokens per second, prompt processing included: llama.cpp's B x TG tokens over its T (prompt +
generation seconds). What the two runs do differs in one way that favours llama.cpp: its batched bench
feeds random tokens and never samples, while the engine samples greedily and detokenizes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from ernie_jax.config import PRESETS, ErnieConfig

BINARY = "llama-batched-bench"


def find_binary(llama_dir: str) -> str:
    """The batched-bench binary under a llama.cpp checkout (or on PATH when `llama_dir` is empty)."""
    if not llama_dir:
        found = shutil.which(BINARY)
        if found:
            return found
        raise SystemExit(f"--compare-llamacpp: no {BINARY} on PATH; give the llama.cpp folder")
    for sub in ("build/bin", "bin", "."):
        path = os.path.join(llama_dir, sub, BINARY)
        if os.access(path, os.X_OK):
            return path
    raise SystemExit(f"--compare-llamacpp {llama_dir}: no {BINARY} in build/bin, bin or the folder itself "
                     f"(build it: cmake -B build && cmake --build build --target {BINARY})")


def hf_folder(model: str, dtype: str, folder: str) -> str:
    """An HF-layout folder holding `model`'s weights (written into `folder` unless it is one already)."""
    if model.lower() in PRESETS:
        from ernie_jax.bench.offline import hf_model
        hf_model(ErnieConfig.preset(model), folder, dtype)
        return with_tokenizer(folder)
    from ernie_jax.checkpoint.plan import CheckpointPlan
    if CheckpointPlan(model, ErnieConfig.from_pretrained(model)).layout.name == "hf":
        return model
    from converters.export_hf import convert
    convert(model, folder, drop_mtp=True, quiet=True)
    return folder


def with_tokenizer(folder: str) -> str:
    """A folder of random weights (a preset's) with the embedded model's tokenizer beside them: the GGUF
    converter needs one, and the prompts are random token ids, so which one does not matter; the vocabulary
    must hold its pieces."""
    from ernie_jax.assets import EMBEDDED_MODEL_DIR
    vocab = ErnieConfig.from_pretrained(folder).vocab_size
    pieces = ErnieConfig.from_pretrained(EMBEDDED_MODEL_DIR).vocab_size
    if vocab < pieces:
        raise SystemExit(f"--compare-llamacpp: the model's vocabulary ({vocab}) is smaller than the embedded "
                         f"tokenizer's ({pieces} pieces), which its GGUF would carry")
    for name in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(EMBEDDED_MODEL_DIR, name), folder)
    return folder


def make_gguf(llama_dir: str, hf: str, out: str, dtype: str) -> str:
    script = os.path.join(llama_dir, "convert_hf_to_gguf.py")
    if not os.path.exists(script):
        raise SystemExit(f"--compare-llamacpp {llama_dir}: no convert_hf_to_gguf.py there (give --gguf FILE)")
    outtype = {"bfloat16": "bf16", "float32": "f32"}[dtype]
    run = subprocess.run([sys.executable, script, hf, "--outtype", outtype, "--outfile", out],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed ({run.returncode}):\n{run.stderr[-2000:]}")
    _fix_shared_expert_width(llama_dir, hf, out)
    return out


def _fix_shared_expert_width(llama_dir: str, hf: str, gguf: str) -> None:
    cfg = ErnieConfig.from_pretrained(hf)
    width = cfg.moe_intermediate_size * cfg.moe_num_shared_experts
    sys.path.insert(0, os.path.join(llama_dir, "gguf-py"))
    from gguf import GGUFReader
    reader = GGUFReader(gguf)
    key = next((k for k in reader.fields if k.endswith(".expert_shared_feed_forward_length")), None)
    if key is None or not width:
        return
    field = reader.fields[key]
    written = int(field.parts[field.data[0]][0])
    del reader  # its memory map, before the file is edited
    if written == width:
        return
    print(f"{gguf}: {key} was {written} (convert_hf_to_gguf.py's intermediate_size // num_key_value_heads); "
          f"set to {width} (moe_intermediate_size x moe_num_shared_experts)")
    script = os.path.join(llama_dir, "gguf-py", "gguf", "scripts", "gguf_set_metadata.py")
    env = {**os.environ, "PYTHONPATH": os.path.join(llama_dir, "gguf-py")}
    run = subprocess.run([sys.executable, script, gguf, key, str(width), "--force"], capture_output=True, text=True,
                         env=env)
    if run.returncode != 0:
        raise SystemExit(f"gguf_set_metadata.py failed ({run.returncode}):\n{run.stderr[-2000:]}")


def batched_bench(binary: str, gguf: str, streams: int, input_len: int, output_len: int, threads: int) -> dict:
    """One llama-batched-bench run -> its JSON record (t seconds, speed_tg, ...) plus output tok/s."""
    context = -(-streams * (input_len + output_len) // 256) * 256 + 256  # llama.cpp pads its KV: leave room
    cmd = [binary, "-m", gguf, "-c", str(context), "-b", "2048", "-ub", "512",
           "-npp", str(input_len), "-ntg", str(output_len), "-npl", str(streams), "-t", str(threads),
           "-ngl", "0", "--output-format", "jsonl"]
    for attempt in range(10):  # now and then the tool exits (status 0) with nothing on stdout: about 1 run in
        if attempt:             # 7 of a 0.1 s one-stream bench, sometimes several in a row
            time.sleep(0.5)
        run = subprocess.run(cmd, capture_output=True, text=True)
        records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"n_kv_max"')]
        if run.returncode != 0 or records:
            break
    if run.returncode != 0 or not records:
        raise SystemExit(f"{' '.join(cmd)} failed ({run.returncode}):\n{(run.stderr or run.stdout)[-2000:]}")
    rec = records[-1]
    rec["output_tok_s"] = streams * output_len / rec["t"]
    return rec
