#!/usr/bin/env bash
# The confidence-scheduling sweep with trimmed cells, real model (assembled by .carry/assemble.sh):
# `dspark profile` with trimmed_widths [2,3,4] (once per machine: kept in /root/keep), then the
# closed-loop sweep of bench/device_issue6_sweep.sh over plain, K = 3, K = 7, the policy with the
# shipped table ("scheduled") and the policy with trimmed cells ("trimmed").
#
#   TEMPERATURE=1.0 bash bench/device_trimmed_real.sh          LEVELS (1,4,16,64,256)
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
TABLE=/root/keep/cost_table_trimmed.json
if [ ! -f "$TABLE" ]; then
  python3 -m dspark.cli profile --out "$TABLE" \
    --speculative-config '{"method": "dspark", "trimmed_widths": [2, 3, 4]}' \
    > /root/keep/profile_trimmed.txt 2>&1
fi
cp /root/keep/profile_trimmed.txt "$OUT/"; [ -f "$TABLE" ] && cp "$TABLE" "$OUT/"
grep -v "^INFO" /root/keep/profile_trimmed.txt | tail -22
export ARMS_JSON="{\"plain\": null,
  \"k3\": {\"method\": \"dspark\", \"scheduling\": false, \"num_speculative_tokens\": 3},
  \"k7\": {\"method\": \"dspark\", \"scheduling\": false},
  \"scheduled\": {\"method\": \"dspark\"},
  \"trimmed\": {\"method\": \"dspark\", \"trimmed_widths\": [2, 3, 4], \"cost_table\": \"$TABLE\"}}"
LEVELS=${LEVELS:-1,4,16,64,256} bash bench/device_issue6_sweep.sh
