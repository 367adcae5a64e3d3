#!/usr/bin/env bash
# This tree against an earlier one, the same arms on the same machine in one device call: tells
# a change of the code from a change of the host (docs/PERFORMANCE.md, thirty-second look, where
# a noisy H100 made the policy look 10-20% slower and 492dd1d against 27f1c10 on the next
# machine showed the code unchanged).
#
#   git archive 27f1c10 dspark ':!dspark/drafters' | gzip > .carry/before.tgz
#   PROMPTS_DIR=/root/keep/data LEVELS=1,4,64 bash bench/device_tree_ab.sh
#
# BEFORE (default .carry/before.tgz: the earlier package without its drafters, which it borrows
# from this tree; BEFORE_COMMIT names it in its results), ARMS (a `dspark bench --arms` object;
# default fixed K = 7 and the policy), LEVELS (1,4,64), REPEATS (2), TEMPERATURE (0),
# MIN_REQUESTS (32), MODEL (default), OUTPUT_LEN (256), BENCH_ARGS (more `dspark bench`
# options). The earlier tree runs first. Results before.json / after.json and their steps by
# path under $OUT; the last lines are both runs' tables.
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
BEFORE=${BEFORE:-.carry/before.tgz}
ARMS=${ARMS:-'{"k7": {"method": "dspark", "scheduling": false}, "scheduled": {"method": "dspark"}}'}
LEVELS=${LEVELS:-1,4,64}
COMMON=(--model "${MODEL:-default}" --prompts-dir "$(realpath "${PROMPTS_DIR:-.data}")"
        --concurrency "$LEVELS" --output-len "${OUTPUT_LEN:-256}"
        --output-len-spread 0.5 --waves 4 --min-requests "${MIN_REQUESTS:-32}"
        --repeats "${REPEATS:-2}" --temperature "${TEMPERATURE:-0}" --no-plot ${BENCH_ARGS:-})

unpack_before "$BEFORE" || exit 1
(cd /tmp/before && PYTHONPATH=/tmp/site:/tmp/before DSPARK_GIT_COMMIT=${BEFORE_COMMIT:-before} \
  python3 -m dspark.cli bench "${COMMON[@]}" --arms "$ARMS" --out "$OUT/before.json" 2>&1 \
  | grep -v "^INFO" > "$OUT/before.txt") || echo "the earlier tree's bench failed"
python3 -m dspark.cli bench "${COMMON[@]}" --arms "$ARMS" --out "$OUT/after.json" 2>&1 \
  | grep -v "^INFO" > "$OUT/after.txt" || echo "this tree's bench failed"
for run in before after; do
  [ -f "$OUT/$run.json" ] && python3 bench/arm_steps.py "$OUT/$run.json" > "$OUT/${run}_steps.txt"
  echo "$run:"; tail -n "$(( $(tr , '\n' <<< "$LEVELS" | wc -l) + 1 ))" "$OUT/$run.txt"
done
