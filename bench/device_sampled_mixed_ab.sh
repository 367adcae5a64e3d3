#!/usr/bin/env bash
# Temperature-1 speculation at load, this tree against an earlier one, in one device call: the
# mixed steps (windows, then admitted requests' prefill) of a temperature-only batch replayed the
# FILTERED graph until 784ca13, which sorts every drafter slot's and window token's vocabulary;
# they now replay the TEMPERATURE graph (docs/PERFORMANCE.md, twenty-ninth look).
#
#   git archive 4c322de dspark ':!dspark/drafters' | gzip > .carry/before_fix.tgz
#   PROMPTS_DIR=.carry/data_small SOURCES=alpaca,vicuna bash bench/device_sampled_mixed_ab.sh
#
# The earlier tree (BEFORE, default .carry/before_fix.tgz: the package without its drafters,
# which it borrows from this tree) runs fixed K = 7; this tree runs plain, fixed K = 7 and the
# drafting policy. Closed loop of C requests in flight (4 C in all, lengths 128-384), LEVELS
# (64,256), REPEATS (2). Results under $OUT; the last lines are the table.
# RANDOM_WEIGHTS=1: SmolLM2-shaped random weights and a random K = 7 drafter instead (random_models,
# bench/device_setup.sh; no model part carried): the steps' costs without the policy arm, which
# needs a cost table for its drafter.
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
BEFORE=${BEFORE:-.carry/before_fix.tgz}
MODEL=default
DRAFTER=
if [ "${RANDOM_WEIGHTS:-0}" = 1 ]; then
  random_models || exit 1
  MODEL=/tmp/rs DRAFTER=', "model": "/tmp/rd"'
fi
COMMON=(--model "$MODEL" --prompts-dir "$PWD/${PROMPTS_DIR:-.data}" --sources "${SOURCES:-gsm8k,alpaca,vicuna}"
        --concurrency "${LEVELS:-64,256}" --output-len 256 --output-len-spread 0.5 --waves 4
        --repeats "${REPEATS:-2}" --temperature 1.0 --no-plot)
K7="\"k7\": {\"method\": \"dspark\", \"scheduling\": false$DRAFTER}"
SCHEDULED=', "scheduled": {"method": "dspark"}'
[ -n "$DRAFTER" ] && SCHEDULED=

unpack_before "$BEFORE" || exit 1
(cd /tmp/before && PYTHONPATH=/tmp/site:/tmp/before python3 -m dspark.cli bench "${COMMON[@]}" \
  --arms "{$K7}" --out "$OUT/before.json" 2>&1 | grep -v "^INFO" > "$OUT/before.txt") \
  || echo "the earlier tree's bench failed"
python3 -m dspark.cli bench "${COMMON[@]}" \
  --arms "{\"plain\": null, $K7$SCHEDULED}" \
  --out "$OUT/after.json" 2>&1 | grep -v "^INFO" > "$OUT/after.txt" || echo "this tree's bench failed"

python3 - "$OUT/before.json" "$OUT/after.json" <<'PY'
import json, sys
runs = {}
for tag, path in (("before", sys.argv[1]), ("after", sys.argv[2])):
    try:
        arms = json.load(open(path))["arms"]
    except (OSError, ValueError, KeyError) as e:
        print(f"{path}: {e}")
        continue
    for arm, result in arms.items():
        for level in result["levels"]:
            spec = level.get("speculation") or {}
            runs[(f"{arm} ({tag})", level["concurrency"])] = (
                level["output_tokens_per_s"], level["output_tokens_per_s_runs"],
                spec.get("mean_acceptance_length"), (spec.get("steps") or {}))
print(f"{'arm':18s} {'C':>4s} {'tok/s':>8s}  runs  tau  steps")
for (arm, c), (tps, reps, tau, steps) in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    tau = f"{tau:.2f}" if tau else "-"
    reps = "/".join(f"{r:.0f}" for r in reps)
    print(f"{arm:18s} {c:4d} {tps:8.0f}  {reps}  {tau}  {steps}")
PY
