#!/usr/bin/env bash
# speculative_config "mixed_steps_ahead" on against off, arms interleaved in one `dspark bench`
# (a closed loop at C requests, 4 C in all, lengths spread so requests end and arrive apart):
# the arrival steps of docs/PERFORMANCE.md's twenty-third look. Fixed K = 7 (scheduling off),
# so both arms draft every step whatever the drafter's acceptance; then the GPU tests of the
# speculative graphs (mixed steps among them). Results under $OUT.
#
#   MODEL=/tmp/rs DRAFTER=/tmp/rd PROMPTS_DIR=.carry/data bash bench/device_mixed_ahead_ab.sh
#
# MODEL defaults to the default model, DRAFTER to its shipped drafter; LEVELS to 64.
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
SC="\"method\": \"dspark\", \"scheduling\": false${DRAFTER:+, \"model\": \"$DRAFTER\"}"
ARMS="{\"on\": {$SC, \"mixed_steps_ahead\": true}, \"off\": {$SC}}"
timeout "${BENCH_TIMEOUT:-300}" python3 -m dspark.cli bench --model "${MODEL:-default}" \
  --arms "$ARMS" --concurrency "${LEVELS:-64}" --waves 4 --output-len 256 \
  --output-len-spread 0.5 --repeats "${REPEATS:-3}" --prompts-dir "${PROMPTS_DIR:-.data}" \
  --no-plot --out "$OUT/mixed_ahead.json" > "$OUT/mixed_ahead.txt" 2>&1
echo "bench rc=$?"
python3 bench/arm_steps.py "$OUT/mixed_ahead.json" > "$OUT/mixed_ahead_steps.txt" 2>&1
grep -E "tok/s|ahead|mixed" "$OUT/mixed_ahead_steps.txt" | head -20
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/spec/test_spec_graphs.py \
  > "$OUT/pytest_spec_graphs.txt" 2>&1
echo "GPU speculative-graph tests rc=$?: $(tail -1 "$OUT/pytest_spec_graphs.txt")"
tail -4 "$OUT/mixed_ahead.txt"
