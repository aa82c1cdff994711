#!/usr/bin/env bash
# Smoke-run the two standard OpenAI-API clients against a running server:
#   aiperf  (NVIDIA's load generator)   -> chat endpoint, streaming, 8 requests
#   lm_eval (lm-evaluation-harness)     -> tiny_mc (loglikelihood) and heldout_rolling (loglikelihood_rolling:
#                                          held-out perplexity) via /v1/completions echo+logprobs
# Usage: benchmarks/run_eval_clients.sh URL TOKENIZER_DIR MODEL_NAME [VENV=/tmp/evalenv]
#   URL            server base, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
#   TOKENIZER_DIR  local HF tokenizer folder (tokenizer.json + tokenizer_config.json)
#   MODEL_NAME     the id the server serves (sent as "model" in every request)
#   VENV           venv with `pip install aiperf 'lm_eval[api]' transformers` (lm_eval 0.4.13's api extra
#                  leaves out the transformers its tokenizer needs)
# Env: OUT_DIR (artifacts; default a fresh /tmp dir), TOKENIZED_REQUESTS (True: lm_eval sends
#      token ids; False: strings), AIPERF_ARGS (extra aiperf flags), LMEVAL_TASKS (default
#      tiny_mc,heldout_rolling), LMEVAL_MAX_LENGTH (default 258: rolling windows of 256 tokens, the
#      windows of python -m ernie_jax.train.evaluate --max-length 256), LMEVAL_LIMIT (lm_eval --limit N: the
#      first N documents of each task; python -m ernie_jax.train.evaluate --limit N scores the same ones),
#      CLIENTS (default "aiperf lm_eval"; name one to run it alone).
# Exits non-zero if either client fails or any aiperf request errored.
set -euo pipefail

if [[ $# -lt 3 ]]; then
  sed -n 6,11p "$0" >&2
  exit 2
fi
URL="${1%/}"; URL="${URL%/v1}"
TOK="$(cd "$2" && pwd)"
MODEL="$3"
VENV="${4:-/tmp/evalenv}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT_DIR:-$(mktemp -d /tmp/eval_clients.XXXXXX)}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
echo "artifacts: $OUT"

# aiperf 0.13 in offline mode only loads tokenizers from the HF cache (a plain folder path is
# rejected as an invalid repo id), so expose the folder as a fake cached repo "local/tokenizer".
REV=0000000000000000000000000000000000000000
HUB="$OUT/hf_hub"
mkdir -p "$HUB/models--local--tokenizer/snapshots/$REV" "$HUB/models--local--tokenizer/refs"
ln -sf "$TOK"/* "$HUB/models--local--tokenizer/snapshots/$REV/"
printf %s "$REV" > "$HUB/models--local--tokenizer/refs/main"

CLIENTS="${CLIENTS:-aiperf lm_eval}"
AIPERF_RC=0
LMEVAL_RC=0
if [[ " $CLIENTS " == *" aiperf "* ]]; then
echo "== aiperf: chat, streaming, 8 requests, concurrency 2, ISL 32 / OSL 16"
# ignore_eos pins the output length so OSL/ITL are comparable between runs; telemetry and
# /metrics scraping are off because they probe ports this smoke test is not about; the mmap
# base keeps aiperf's per-run dataset folder out of /tmp.
set +e
HF_HUB_CACHE="$HUB" AIPERF_DATASET_MMAP_BASE_PATH="$OUT" "$VENV/bin/aiperf" profile \
  --model "$MODEL" --url "$URL" --endpoint-type chat --streaming \
  --tokenizer local/tokenizer \
  --isl 32 --isl-stddev 0 --osl 16 --extra-inputs ignore_eos:true \
  --request-count 8 --concurrency 2 --random-seed 0 \
  --ui none --no-gpu-telemetry --no-server-metrics \
  --artifact-dir "$OUT/aiperf" ${AIPERF_ARGS:-} > "$OUT/aiperf.log" 2>&1
AIPERF_RC=$?
set -e
# the last table printed is the per-request LLM metrics summary
awk '/NVIDIA AIPerf \| LLM Metrics *$/{p=1} p{print} p&&/└/{exit}' "$OUT/aiperf.log"
if [[ $AIPERF_RC -eq 0 ]]; then
  # aiperf exits 0 when only some requests fail: require a clean run
  "$VENV/bin/python" - "$OUT/aiperf/profile_export_aiperf.json" <<'EOF' || AIPERF_RC=1
import json, sys
d = json.load(open(sys.argv[1]))
n, err = d["request_count"]["avg"], d.get("request_error_rate", {}).get("avg", 0)
print(f"aiperf: {n:.0f} requests, error rate {err}%")
sys.exit(0 if n == 8 and not err and not d.get("error_summary") else 1)
EOF
fi
[[ $AIPERF_RC -eq 0 ]] || { echo "aiperf FAILED (rc=$AIPERF_RC), see $OUT/aiperf.log" >&2; tail -25 "$OUT/aiperf.log" >&2; }
fi

if [[ " $CLIENTS " == *" lm_eval "* ]]; then

TASKS="${LMEVAL_TASKS:-tiny_mc,heldout_rolling}"
echo "== lm_eval: $TASKS via /v1/completions"
# run from the repo root: the task's data_files path is relative to the working directory
set +e
(cd "$REPO" && "$VENV/bin/lm_eval" --model local-completions \
  --model_args "model=$MODEL,base_url=$URL/v1/completions,tokenizer=$TOK,tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,tokenized_requests=${TOKENIZED_REQUESTS:-True},max_length=${LMEVAL_MAX_LENGTH:-258}" \
  --include_path benchmarks/lm_eval_tasks --tasks "$TASKS" \
  --output_path "$OUT/lm_eval" --log_samples ${LMEVAL_LIMIT:+--limit "$LMEVAL_LIMIT"}) > "$OUT/lm_eval.log" 2>&1
LMEVAL_RC=$?
set -e
grep -E '^\|' "$OUT/lm_eval.log" || true
[[ $LMEVAL_RC -eq 0 ]] || { echo "lm_eval FAILED (rc=$LMEVAL_RC), see $OUT/lm_eval.log" >&2; tail -25 "$OUT/lm_eval.log" >&2; }
fi

if [[ $AIPERF_RC -ne 0 || $LMEVAL_RC -ne 0 ]]; then exit 1; fi
echo "clients OK: $CLIENTS"
