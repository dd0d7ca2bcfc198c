#!/usr/bin/env bash
# The quality/speed frontier of SwiftKV SmolLM2-135M-Instruct (docs/benchmarks.md, "Frontier").
#
#   scripts/frontier.sh train ROW...    distill the named rows (resumes an interrupted row)
#   scripts/frontier.sh eval ROW...     evaluate them (skips a row whose result file exists)
#   scripts/frontier.sh speed L[:G]...  prefill speed-up of a layout (undistilled weights: same cost)
#
# Every row: least-squares K/V init, then KL distillation (T = 2) for the same 256,000 training tokens
# (125 steps x 8 rows x 256 tokens: two epochs over the first 512 packed rows of data/mix/train.jsonl)
# through one teacher cache; lr 1e-3, linear schedule with 5% warm-up (later flags of a row override these). Needs `swiftkv models prepare smollm2-135m-instruct` and `swiftkv data prepare --out data/mix`.
set -euo pipefail
cd "$(dirname "$0")/.."
SWIFTKV=${SWIFTKV:-.venv/bin/swiftkv}
BASE=${BASE:-models/smollm2-135m-instruct}
DATA=${DATA:-data/mix}
RUNS=${RUNS:-runs}
CACHE=$RUNS/cache-mix-256

# name -> distill flags beyond the common ones
declare -A ROW=(
  [l15]="--num-key-value-layers 15"
  [l18]="--num-key-value-layers 18"
  [l20]="--num-key-value-layers 20"
  [l22]="--num-key-value-layers 22"
  [l24]="--num-key-value-layers 24"
  # the recipe variants and AcrossKV at l = 22, the best layout of {15, 18, 20, 22} (closest to the quality bar)
  [l22-t1]="--num-key-value-layers 22 --temperature 1"
  [l22-hidden]="--num-key-value-layers 22 --hidden-weight 1"
  [l22-g2]="--num-key-value-layers 22 --key-value-group-size 2"
  [l22-qkv]="--num-key-value-layers 22 --init lstsq-qkv"
  # a longer budget at one layout (not a frontier row: 4x the tokens, one pass over 2,048 rows, its own cache)
  [l22-1m]="--num-key-value-layers 22 --rows 2048 --max-steps 500 --cache $RUNS/cache-mix-2048-l22"
  [l20-1m]="--num-key-value-layers 20 --rows 2048 --max-steps 500 --cache $RUNS/cache-mix-2048-l20"
  # T = 1 beat T = 2 at l = 22 (l22-t1): the longer budget and the shipped layout at T = 1
  [l22-t1-1m]="--num-key-value-layers 22 --temperature 1 --rows 2048 --max-steps 500 --cache $RUNS/cache-mix-2048-l22"
  [l24-t1]="--num-key-value-layers 24 --temperature 1"
  # more capacity in the later layers: student-only rank-16 adapters on o_proj and the MLP of layers >= l, at T = 1
  [l22-lora]="--num-key-value-layers 22 --temperature 1 --train-scope lora"
  [l20-lora]="--num-key-value-layers 20 --temperature 1 --train-scope lora"
  # the learning rate at the frontier budget (the paper's 2e-4 was for far more tokens; the common recipe uses 1e-3)
  [l22-t1-lr3]="--num-key-value-layers 22 --temperature 1 --lr 3e-3"
  # data shaped like the SwiftKV pool's traffic (`swiftkv data answers`): 1,024-token rows, same tokens per step
  [l22-answers]="--num-key-value-layers 22 --data $DATA/answers.jsonl --all-tokens --seq-len 1024 --batch-size 2 --rows 125 --cache $RUNS/cache-answers-1024"
)
# float32 on every CPU: precision is not a variable of the frontier (auto would pick bf16 autocast on CPUs with native bf16)
COMMON=(--base "$BASE" --data "$DATA/train.jsonl" --cache "$CACHE" --init lstsq --lr 1e-3 --max-steps 125
        --batch-size 8 --seq-len 256 --rows 512 --checkpoint-every 25 --precision fp32)
# THREADS=1 keeps one core free for other work (the results do not depend on it).
THREADS_FLAG=(); [ -n "${THREADS:-}" ] && THREADS_FLAG=(--threads "$THREADS")

cache() {
  "$SWIFTKV" distill-cache --base "$BASE" --data "$DATA/train.jsonl" --out "$CACHE" --layers 15,18,20,22,24 --rows 512 --seq-len 256 "${THREADS_FLAG[@]}"
}

train() {
  cache
  for name in "$@"; do
    [ -n "${ROW[$name]:-}" ] || { echo "unknown row $name (known: ${!ROW[*]})" >&2; exit 2; }
    [ -f "$RUNS/$name/summary.json" ] && continue
    # shellcheck disable=SC2086
    "$SWIFTKV" distill "${COMMON[@]}" "${THREADS_FLAG[@]}" --out "$RUNS/$name" ${ROW[$name]}
  done
}

evaluate() {
  for name in "$@"; do
    for text in heldout heldout_manpages; do
      out="$RUNS/$name/eval-$text.json"
      [ -f "$out" ] && continue
      "$SWIFTKV" eval "${THREADS_FLAG[@]}" --teacher "$BASE" --student "$RUNS/$name" --text "$DATA/$text.jsonl" --seq-len 512 \
        --max-tokens 8192 --num-prompts 8 --gen-tokens 32 --long-docs 6 --json > "$out.tmp"
      mv "$out.tmp" "$out"
    done
  done
}

speed() {
  for layout in "$@"; do
    l=${layout%%:*}; g=1; [ "$layout" != "$l" ] && g=${layout#*:}
    model="$RUNS/speed-l$l-g$g"
    [ -f "$model/config.json" ] || "$SWIFTKV" convert --base "$BASE" --out "$model" --num-key-value-layers "$l" --key-value-group-size "$g"
    "$SWIFTKV" bench engine --model "$model" --baseline "$BASE" --json > "$RUNS/speed-l$l-g$g.json"
  done
}

cmd=${1:-}; shift || true
case "$cmd" in
  train) train "$@" ;;
  eval) evaluate "$@" ;;
  speed) speed "$@" ;;
  *) sed -n '2,10p' "$0"; exit 2 ;;
esac
