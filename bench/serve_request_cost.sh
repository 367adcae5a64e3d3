#!/usr/bin/env bash
# The server process's CPU per request (CPU, development machine): `dspark serve` on the small
# model of bench/serve_overhead.py (build it once with that script), loaded by `dspark bench
# serve` with short streamed chat requests (2 tokens, 32 in flight), so the per-request path
# (parsing, preparing, submitting, the stream's chunks and its end) dominates. Prints the
# server process's user + system CPU over the timed requests, per request. A warm-up load runs
# first. Compare versions by alternating them: the VM's speed drifts.
#
#   bash bench/serve_request_cost.sh [NUM_REQUESTS]          (MODEL_DIR, PORT to override)
set -u
MODEL_DIR=${MODEL_DIR:-/tmp/dspark_serve_overhead/model}
PORT=${PORT:-8411}
N=${1:-3000}
[ -d "$MODEL_DIR" ] || { echo "no model in $MODEL_DIR: run bench/serve_overhead.py once"; exit 1; }
python3 -m dspark.cli serve "$MODEL_DIR" --port "$PORT" --disable-access-log \
  > /tmp/serve_request_cost.log 2>&1 &
pid=$!
source "$(dirname "$0")/wait_healthy.sh"
wait_healthy "$PORT" "$pid" 240 || { echo "the server did not come up"; exit 1; }
load() {  # load N: N requests, 32 in flight
  python3 -m dspark.cli bench serve --base-url "http://127.0.0.1:$PORT" \
    --sources gsm8k,alpaca,vicuna --output-len 2 --concurrency 32 --num-prompts "$1" \
    --no-plot --out /tmp/serve_request_cost.json > /dev/null 2>&1
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
load 2000
before=$(cpu_ticks)
load "$N"
after=$(cpu_ticks)
kill -TERM "$pid"
wait "$pid"
python3 - "$before" "$after" "$N" "$(getconf CLK_TCK)" <<'PY'
import json, sys
before, after, n, tck = (float(x) for x in sys.argv[1:])
s = json.load(open("/tmp/serve_request_cost.json"))["levels"][0]["summary"]
print(f"{s['num_completed']} of {int(n)} completed, {s['requests_per_s']:.0f} requests/s; "
      f"server CPU per request {(after - before) / tck / n * 1e6:.0f} us")
PY
