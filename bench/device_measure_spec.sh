#!/usr/bin/env bash
# One device call (about 6 minutes, the model already assembled): the shipped drafter's STS
# calibration refitted with its greedy section, this GPU's cost table, and one `dspark bench`
# whose arms (plain decoding, fixed K = 7 and 3, the drafting policy) run interleaved level by
# level on held-out prompts, so the ratios carry no drift between runs. Results under $OUT; the
# arms' table last.
#
#   bash .carry/assemble.sh; bash bench/device_measure_spec.sh
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
DRAFTER=dspark/drafters/smollm2_135m_instruct
if [ "${CALIBRATE:-1}" = 1 ]; then  # the calibration first: the table's fingerprint hashes it
  python3 -m dspark.cli calibrate --drafter "$DRAFTER" --prompts-dir "${PROMPTS_DIR:-.data}" \
    --no-progress 2>&1 | grep -v "^INFO" | tail -20 | tee "$OUT/calibrate.txt"
  cp "$DRAFTER/calibration.json" "$OUT/calibration.json"
fi
python3 -m dspark.cli profile --out "$OUT/cost_table_h200.json" 2>&1 | grep -v "^INFO" \
  | tee "$OUT/profile.txt"
ARMS="{\"plain\": null, \"k7\": {\"method\": \"dspark\"},
  \"k3\": {\"method\": \"dspark\", \"num_speculative_tokens\": 3},
  \"scheduled\": {\"method\": \"dspark\", \"cost_table\": \"$OUT/cost_table_h200.json\"}}"
python3 -m dspark.cli bench --prompts-dir "${PROMPTS_DIR:-.data}" \
  --concurrency "${LEVELS:-1,4,16,64,256}" --output-len 256 --repeats "${REPEATS:-3}" \
  --arms "$ARMS" --out "$OUT/bench_arms.json" 2>&1 | grep -v "^INFO" > "$OUT/bench_arms.txt"
tail -"${TAIL:-16}" "$OUT/bench_arms.txt"
