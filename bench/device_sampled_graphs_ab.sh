#!/usr/bin/env bash
# Sampled plain decode steps with and without their sampling captured (DSPARK_SAMPLED_DECODE_GRAPHS,
# runner/sampled_decode_graphs.py; on by default since this A/B), in one device call: the same
# `dspark bench` at temperature 1, arms plain decoding and the drafting policy (whose plain steps
# were host-bound at C = 1 on the H100: docs/PERFORMANCE.md, thirtieth look), the flag off then
# on, ROUNDS times alternating, so that drift falls on both.
#
#   PROMPTS_DIR=.carry/data LEVELS=1,256 bash bench/device_sampled_graphs_ab.sh
#
# LEVELS (1,256), REPEATS (2 a round), ROUNDS (2), MIN_REQUESTS (32), ARMS_JSON (default plain and
# scheduled), POLICY_TRACE=1 (each step's host work: traces' summaries in $OUT). Results under
# $OUT; the last lines are the table (each arm's tok/s per round and flag).
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
ensure_cost_table > "$OUT/cost_table.txt" 2>&1  # the scheduled arm's table for this GPU
ARMS=${ARMS_JSON:-'{"plain": null, "scheduled": {"method": "dspark"}}'}
for round in $(seq "${ROUNDS:-2}"); do
  for flag in 0 1; do
    name=r${round}_graphs$flag
    TRACES=/tmp/traces_$name
    if [ -n "${POLICY_TRACE:-}" ]; then rm -rf "$TRACES"; export DSPARK_POLICY_TRACE=$TRACES; fi
    DSPARK_SAMPLED_DECODE_GRAPHS=$flag python3 -m dspark.cli bench \
      --prompts-dir "${PROMPTS_DIR:-.data}" --concurrency "${LEVELS:-1,256}" \
      --output-len 256 --output-len-spread 0.5 --waves 4 --min-requests "${MIN_REQUESTS:-32}" \
      --repeats "${REPEATS:-2}" --temperature 1.0 --no-plot --arms "$ARMS" \
      --out "$OUT/$name.json" 2>&1 | grep -v "^INFO" > "$OUT/$name.txt" || echo "$name failed"
    if [ -n "${POLICY_TRACE:-}" ]; then
      for f in "$TRACES"/*.jsonl; do python3 bench/policy_trace.py "$f"; done > "$OUT/${name}_trace.txt"
    fi
  done
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
rows = {}
for path in sorted(Path(sys.argv[1]).glob("r*_graphs*.json")):
    rnd, flag = path.stem.split("_")
    for arm, a in json.loads(path.read_text())["arms"].items():
        for lv in a["levels"]:
            rows.setdefault((arm, lv["concurrency"]), []).append(
                f"{rnd} {flag}: {lv['output_tokens_per_s']:,.0f}")
print("arm, C: tok/s per round and flag (graphs0 = eager sampling, graphs1 = captured)")
for (arm, c), cells in rows.items():
    print(f"{arm:>10} {c:>4}  " + "  ".join(cells))
PY
