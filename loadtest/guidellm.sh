#!/usr/bin/env bash
# guidellm, the benchmark client vLLM's docs recommend (`make setup` builds it in its own venv, .tools/guidellm:
# its pins conflict with the project's), against `swiftkv serve` (default config: SmolLM2 SwiftKV + base pools,
# in-process engines) and against vLLM's OpenAI server on the base model with the same engine arguments, one after
# the other on the same cores, as loadtest/vllm_bench.sh does with vLLM's own client. Synthetic prompts of a fixed
# token count (SmolLM2's tokenizer, from models/), streamed chat completions with continuous usage stats and
# ignore_eos, N requests with CONC in flight. One guidellm worker process: its default of ten would take the cores
# from the engines.
#
#   loadtest/guidellm.sh [num_requests] [prompt_tokens] [output_tokens] [concurrency]
#
# Reports: $OUT/<label>.json (guidellm's full report), one RESULT line per target on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
N=${1:-16} IN=${2:-512} OUT_TOKENS=${3:-32} CONC=${4:-4}
PY=.venv/bin/python
GUIDELLM=.tools/guidellm/bin/guidellm
OUT=${OUT:-runs/guidellm}
[ -x "$GUIDELLM" ] || { echo "guidellm is not installed: run \`make setup\` (builds .tools/guidellm)" >&2; exit 1; }
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
PORT_SWIFTKV=${PORT_SWIFTKV:-8731} PORT_VLLM=${PORT_VLLM:-8732}
DTYPE=$($PY -c "from swiftkv_core.hardware import engine_args_for_machine, vllm_on_cpu; print(engine_args_for_machine({'dtype': 'auto'}, vllm_on_cpu(), 'x')['dtype'])")
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 GUIDELLM__MAX_WORKER_PROCESSES=${GUIDELLM_WORKERS:-1}

bench() {  # label base_url model
  (cd "$WORK" && "$ROOT/$GUIDELLM" run --backend "kind=openai_http,target=$2,model=$3,request_format=/v1/chat/completions" \
    --profile "kind=concurrent,streams=$CONC" --constraint "kind=max_requests,count=$N" \
    --data "kind=synthetic_text,prompt_tokens=$IN,output_tokens=$OUT_TOKENS" \
    --tokenizer "kind=huggingface_auto,model=$ROOT/models/smollm2-135m-instruct" \
    --output "kind=json,path=$OUT/$1.json" --disable-console-interactive > "$WORK/$1.log" 2>&1) ||
    { tail -50 "$WORK/$1.log"; return 1; }
  python3 - "$1" "$OUT/$1.json" <<'EOF'
import json, sys
label, path = sys.argv[1:3]
(b,) = json.load(open(path))["benchmarks"]
m = b["metrics"]
ok = lambda k: m[k]["successful"]
print("RESULT", label, json.dumps({
    "requests": m["request_totals"], "duration": round(b["duration"], 2),
    "output_throughput": round(ok("output_token_count")["total_sum"] / b["duration"], 2),
    "mean_ttft_ms": round(ok("time_to_first_token_ms")["mean"], 1), "median_ttft_ms": round(ok("time_to_first_token_ms")["median"], 1),
    "p99_ttft_ms": round(ok("time_to_first_token_ms")["percentiles"]["p99"], 1),
    "mean_tpot_ms": round(ok("time_per_output_token_ms")["mean"], 1), "mean_itl_ms": round(ok("inter_token_latency_ms")["mean"], 1),
    "median_e2el_ms": round(ok("request_latency")["median"] * 1000, 1)}))
EOF
}

. loadtest/targets.sh  # the working directory is the repository root (cd above)
