#!/usr/bin/env bash
# Trimmed cells on the GPU with random SmolLM2-shaped weights (no model file needed): the GPU
# tests of speculation, then `dspark profile` of plain, trimmed (w = 2..5) and full-block cells.
# The tokenizer directory of the default model travels as .carry/tok. Results under $OUT.
#
#   bash bench/device_trimmed_random.sh          BATCH (1,16,64,256), WIDTHS ([2,3,4,5])
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
python3 bench/random_smollm2.py --out /tmp/rs --tokenizer .carry/tok > /dev/null 2>&1
python3 bench/random_drafter.py --target /tmp/rs --out /tmp/rd > /dev/null 2>&1
python3 -m pytest -q -m gpu tests/spec tests/test_gpu.py -p no:cacheprovider 2>&1 \
  | tail -25 > "$OUT/pytest_gpu.txt"
SPEC="{\"method\": \"dspark\", \"model\": \"/tmp/rd\", \"trimmed_widths\": ${WIDTHS:-[2,3,4,5]}}"
python3 -m dspark.cli -v profile --model /tmp/rs --speculative-config "$SPEC" --greedy-only \
  --batch "${BATCH:-1,16,64,256}" --out "$OUT/cost_table_trimmed_random.json" \
  > "$OUT/profile_trimmed_random.txt" 2>&1
grep -v "^INFO\|^DEBUG" "$OUT/profile_trimmed_random.txt" | tail -20
grep -i "captured" "$OUT/profile_trimmed_random.txt" | head -3
tail -5 "$OUT/pytest_gpu.txt"
