"""Model files shipped inside the package.

`EMBEDDED_MODEL_DIR` is a small but genuine ERNIE-4.5 MoE checkpoint in the layout of Baidu's FP8 Paddle
release (block-FP8 `quant_weight` + `weight_scale` linears, a sharded `model.safetensors.index.json`, the
Paddle `config.json` dialect with its `quantization_config`, an MTP block), with a SentencePiece tokenizer
(`tokenizer.model`, plus a `tokenizer.json` that `transformers.AutoTokenizer` loads without remote code)
and ERNIE's chat template and generation config. It was trained here on public-domain English and Chinese text
(`python -m ernie_jax.train`, recipe "embedded") and released with `python -m ernie_jax.train.release`, which
rebuilds the folder from the training run's checkpoint. The server uses it when no `--model` is given.
"""

import os

EMBEDDED_MODEL_NAME = "ernie-4.5-tiny-fp8"
EMBEDDED_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), EMBEDDED_MODEL_NAME)

__all__ = ["EMBEDDED_MODEL_DIR", "EMBEDDED_MODEL_NAME"]
