#!/usr/bin/env bash
# Where the server process's time goes at one load level: `dspark serve` under cProfile
# (DSPARK_SERVER_PROFILE) loaded by `dspark bench serve` (C streams, 4 C requests), with the
# server's own TTFT and e2e means from /metrics beside the client's. Carry .whl, .data and
# .carry/tok (a random SmolLM2-shaped model) or give MODEL. Results under $OUT. PROFILE=0: no
# cProfile (the server at full speed; the loop-lag and reader lines still say where time goes).
# The server also traces each stream (DSPARK_REQUEST_TRACE) and the client keeps its records
# (--save-requests): bench/request_phases.py prints where a request's time went. SERVE_WARMUP=1:
# one untimed wave of C requests first (a fresh server's first wave is slower: cold paths).
#
#   C=256 bash bench/device_serve_profile.sh [serve arguments...]     (SPREAD=0.5: spread lengths)
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
if [ -z "${MODEL:-}" ]; then
  [ -d /tmp/rs ] || python3 bench/random_smollm2.py --out /tmp/rs --tokenizer .carry/tok > /dev/null 2>&1
  MODEL=/tmp/rs
fi
PROMPTS=${PROMPTS_DIR:-.data}
C=${C:-256}
python3 -c "import time, timeit; n = 200000
print(f'thread_time {timeit.timeit(time.thread_time, number=n) / n * 1e6:.2f} us a call,'
      f' perf_counter {timeit.timeit(time.perf_counter, number=n) / n * 1e6:.2f} us')"
[ "${PROFILE:-1}" = 1 ] && export DSPARK_SERVER_PROFILE=$OUT/server.prof
rm -f /tmp/request_trace.*
export DSPARK_REQUEST_TRACE=/tmp/request_trace
python3 -m dspark.cli serve "$MODEL" --port 8290 \
  --max-num-seqs 256 --disable-access-log "$@" > /tmp/serve_profile.log 2>&1 &
pid=$!
wait_healthy 8290 "$pid" || echo "the server did not come up"
if [ "${SERVE_WARMUP:-0}" = 1 ]; then  # one untimed wave first, as device_serve_ab.sh's levels
  python3 -m dspark.cli bench serve --base-url http://127.0.0.1:8290 --prompts-dir "$PROMPTS" \
    --sources gsm8k,alpaca,vicuna --output-len 256 --concurrency "$C" --num-prompts "$C" \
    --no-plot --out /tmp/serve_profile_warm.json > /dev/null 2>&1
fi
python3 -m dspark.cli bench serve --base-url http://127.0.0.1:8290 --prompts-dir "$PROMPTS" \
  --sources gsm8k,alpaca,vicuna --output-len 256 ${SPREAD:+--output-len-spread "$SPREAD"} --concurrency "$C" --num-prompts $((4 * C)) \
  --no-plot --save-requests --out "$OUT/served.json" 2>&1 | tail -2
curl -s http://127.0.0.1:8290/metrics | python3 -c "
import sys
v = {l.split('{')[0]: float(l.split()[-1]) for l in sys.stdin if l.startswith('vllm:') and '{' in l}
for name in ('time_to_first_token_seconds', 'e2e_request_latency_seconds'):
    print(f'server {name} mean {1e3 * v[\"vllm:\" + name + \"_sum\"] / v[\"vllm:\" + name + \"_count\"]:.1f} ms')"
kill -TERM "$pid"
wait "$pid"
grep -E "engine loop:|engine pipe, read" /tmp/serve_profile.log | tail -3
python3 bench/request_phases.py "$OUT/served.json" /tmp/request_trace --first-wave "$C" \
  | tee "$OUT/phases.txt"
tar czf "$OUT/request_trace.tgz" -C /tmp $(cd /tmp && ls request_trace.*)  # (the joins, again)
cp /tmp/serve_profile.log "$OUT/"
[ -f "$OUT/server.prof" ] || exit 0
python3 -c "import pstats; pstats.Stats('$OUT/server.prof').sort_stats('tottime').print_stats(45)" \
  > "$OUT/server_profile.txt"
python3 -c "import pstats; pstats.Stats('$OUT/server.prof').sort_stats('cumulative').print_stats(60)" \
  >> "$OUT/server_profile.txt"
