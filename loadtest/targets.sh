# The targets both benchmark clients run against (sourced by loadtest/guidellm.sh and loadtest/vllm_bench.sh after
# they define `bench LABEL URL MODEL` and PY, WORK, DTYPE, PORT_SWIFTKV, PORT_VLLM): the default SmolLM2 platform
# by its public name and each pool by name, then vLLM's OpenAI server on the base model, one after the other.

wait_ready() {  # url pid log
  for _ in $(seq 600); do
    kill -0 "$2" 2>/dev/null || { tail -50 "$3"; return 1; }
    curl -sf "$1" >/dev/null && return 0
    sleep 1
  done
  return 1
}

cat > "$WORK/platform.yaml" <<EOF
model: swiftkv-smollm2
host: 127.0.0.1
port: $PORT_SWIFTKV
pools:
  swiftkv:
    model: models/smollm2-135m-instruct-swiftkv
    engine_args: {max_model_len: 2048, dtype: $DTYPE, enforce_eager: true, kv_cache_memory_bytes: 268435456}
  base:
    model: models/smollm2-135m-instruct
    engine_args: {max_model_len: 2048, dtype: $DTYPE, enforce_eager: true, kv_cache_memory_bytes: 268435456}
EOF
SWIFTKV_API_KEYS= .venv/bin/swiftkv serve --config "$WORK/platform.yaml" --engine inprocess > "$WORK/serve.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
wait_ready "http://127.0.0.1:$PORT_SWIFTKV/ready" $PID "$WORK/serve.log"
bench swiftkv-routed "http://127.0.0.1:$PORT_SWIFTKV" swiftkv-smollm2
bench swiftkv-pool-swiftkv "http://127.0.0.1:$PORT_SWIFTKV" swiftkv-smollm2-swiftkv
bench swiftkv-pool-base "http://127.0.0.1:$PORT_SWIFTKV" swiftkv-smollm2-base
kill $PID; wait $PID 2>/dev/null || true

$PY -m vllm.entrypoints.openai.api_server --model models/smollm2-135m-instruct --served-model-name base --host 127.0.0.1 \
  --port "$PORT_VLLM" --max-model-len 2048 --dtype "$DTYPE" --enforce-eager --kv-cache-memory-bytes 268435456 --enable-prompt-tokens-details > "$WORK/vllm.log" 2>&1 &
PID=$!
wait_ready "http://127.0.0.1:$PORT_VLLM/health" $PID "$WORK/vllm.log"
bench vllm-serve-base "http://127.0.0.1:$PORT_VLLM" base
kill $PID; wait $PID 2>/dev/null || true
rm -rf "$WORK"
