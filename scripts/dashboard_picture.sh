#!/usr/bin/env bash
# The dashboard picture (docs/dashboard-latency.png) drawn from a real platform load test: `swiftkv serve` with the
# embedded default (SmolLM2 and its SwiftKV model, the default routing and speculation), a Prometheus scraping its
# /metrics every 5 s, `swiftkv bench platform --target` driving WORKLOAD at RATE requests/s, then
# deploy/grafana/render_png.py over the whole run. Needs `make setup` (Prometheus in .tools/), the models
# (`swiftkv models prepare ...`) and the text (`swiftkv data prepare --out data/mix`).
#   WORKLOAD=mixed RATE=0.5 COUNT=60 DURATION=180 OUT=docs/dashboard-latency.png scripts/dashboard_picture.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/dashboard-latency.png} WORKLOAD=${WORKLOAD:-mixed} RATE=${RATE:-0.5} COUNT=${COUNT:-60} DURATION=${DURATION:-180}
PORT=${PORT:-8000} PROM_PORT=${PROM_PORT:-9090}
PROMETHEUS=.tools/prometheus/usr/bin/prometheus
work=$(mktemp -d)
serve=; prom=
trap '[ -n "$prom" ] && kill $prom; [ -n "$serve" ] && kill -INT $serve; wait; rm -rf "$work"' EXIT

.venv/bin/swiftkv serve --port "$PORT" > "$work/serve.log" 2>&1 & serve=$!
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/ready" | grep -q '"base":true' && curl -sf "http://127.0.0.1:$PORT/ready" | grep -q '"swiftkv":true' && break
  kill -0 $serve 2>/dev/null || { cat "$work/serve.log"; exit 1; }
  sleep 1
done
cat > "$work/prometheus.yml" <<YAML
global: {scrape_interval: 5s, evaluation_interval: 5s}
scrape_configs: [{job_name: swiftkv-gateway, static_configs: [{targets: ["127.0.0.1:$PORT"]}]}]
YAML
"$PROMETHEUS" --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" --web.listen-address="127.0.0.1:$PROM_PORT" \
  > "$work/prometheus.log" 2>&1 & prom=$!
until curl -sf "http://127.0.0.1:$PROM_PORT/-/ready" > /dev/null; do sleep 1; done
sleep 10  # a scrape before the traffic: every series starts at zero, so rate() sees its first requests
start=$(date +%s)
.venv/bin/swiftkv bench platform --target "http://127.0.0.1:$PORT" --target-model swiftkv-smollm2 --workload "$WORKLOAD" \
  --rate "$RATE" --count "$COUNT" --duration "$DURATION" --out "$work/report.json" --no-progress
sleep 15  # the last scrapes
minutes=$(( ($(date +%s) - start) / 60 + 1 ))
.venv/bin/python deploy/grafana/render_png.py --prometheus "http://127.0.0.1:$PROM_PORT" --out "$OUT" --minutes "$minutes" --rate-window 30s
cp "$work/report.json" "${OUT%.png}-load-test.json"
