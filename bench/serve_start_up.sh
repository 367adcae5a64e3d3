#!/usr/bin/env bash
# The API process's switch from loading to serving: start `dspark serve` (the default model
# unless MODEL is set) N times, wait for /health, and print each start's start-up line: the
# reads of the engine's pipe up to READY (its tokenizer unpickled on the event loop) and the
# collect-and-freeze after it (dspark/server/engine_loop.py, `_log_start_up`).
#
#   bash bench/serve_start_up.sh [N]          (MODEL, PORT to override)
set -u
source "$(dirname "$0")/wait_healthy.sh"
MODEL=${MODEL:-default}
PORT=${PORT:-8431}
for _ in $(seq "${1:-3}"); do
  python3 -m dspark.cli serve "$MODEL" --port "$PORT" --disable-access-log \
    > /tmp/serve_start_up.log 2>&1 &
  pid=$!
  wait_healthy "$PORT" "$pid" 240
  kill -TERM "$pid"
  wait "$pid"
  grep -o "the server's start-up: .* ms in all; collect and freeze [0-9]* ms" \
    /tmp/serve_start_up.log || echo "no start-up line (see /tmp/serve_start_up.log)"
done
