#!/usr/bin/env bash
# One device call (about 7 minutes, the model already assembled): the GPU tests, the shipped
# drafter's STS calibration refitted (CALIBRATE=1; its greedy section), this GPU's cost table,
# and one `dspark bench` whose arms (plain decoding, fixed K = 3 and 7, the drafting policy with
# the shipped table (also with unobserved rows priced by the population) and with the fresh
# one, and K = 7 and the policy with synchronous drafting
# steps) run interleaved level by level on
# held-out prompts, so the ratios carry no drift between runs. Results under $OUT; the arms'
# table last. ARMS='{...}' replaces the arms (the literal $TABLE in it becomes the fresh
# table's "cost_table" entry); HF=1 runs the Hugging Face peer beside the first arm.
#
#   bash .carry/assemble.sh; bash bench/device_measure_spec.sh
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
DRAFTER=dspark/drafters/smollm2_135m_instruct
# PYTEST_ARGS narrows the GPU tests (default: every one)
python3 -m pytest -q ${PYTEST_ARGS:--m gpu tests} -p no:cacheprovider 2>&1 | tail -3 \
  | tee "$OUT/pytest_gpu.txt"
if [ "${CALIBRATE:-0}" = 1 ]; then  # the calibration first: the table's fingerprint hashes it
  python3 -m dspark.cli calibrate --drafter "$DRAFTER" --prompts-dir "${PROMPTS_DIR:-.data}" \
    --no-progress --plot "$OUT/reliability.png" 2>&1 | grep -v "^INFO" | tail -22 | tee "$OUT/calibrate.txt"
  cp "$DRAFTER/calibration.json" "$OUT/calibration.json"
fi
python3 -m dspark.cli profile --out "$OUT/cost_table_h200.json" 2>&1 | grep -v "^INFO" \
  | tee "$OUT/profile.txt"
TABLE="\"cost_table\": \"$OUT/cost_table_h200.json\""
SYNC='"engine": {"async_spec_steps": false}'
# fixed K needs "scheduling": false: without it the engine finds the drafter's shipped table
FIXED='"scheduling": false'
DEFAULT_ARMS="{\"plain\": null,
  \"k3\": {\"method\": \"dspark\", \"num_speculative_tokens\": 3, $FIXED},
  \"k7\": {\"method\": \"dspark\", $FIXED}, \"k7_sync\": {\"method\": \"dspark\", $FIXED, $SYNC},
  \"shipped\": {\"method\": \"dspark\"},
  \"population\": {\"method\": \"dspark\", \"unobserved\": \"population\"},
  \"scheduled\": {\"method\": \"dspark\", $TABLE},
  \"scheduled_sync\": {\"method\": \"dspark\", $TABLE, $SYNC}}"
ARMS="${ARMS:-$DEFAULT_ARMS}"  # ARMS may name the fresh table as $TABLE (single-quote it)
ARMS="${ARMS//\$TABLE/$TABLE}"
HF_ARGS=""
[ "${HF:-0}" = 1 ] && HF_ARGS="--hf-peer --hf-max-concurrency 64"  # HF against the first arm
python3 -m dspark.cli bench --prompts-dir "${PROMPTS_DIR:-.data}" \
  --concurrency "${LEVELS:-1,4,16,64,256}" --output-len 256 --repeats "${REPEATS:-3}" \
  --arms "$ARMS" $HF_ARGS --out "$OUT/bench_arms.json" 2>&1 | grep -v "^INFO" > "$OUT/bench_arms.txt"
tail -"${TAIL:-16}" "$OUT/bench_arms.txt"
