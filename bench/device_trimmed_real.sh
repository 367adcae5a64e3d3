#!/usr/bin/env bash
# The confidence-scheduling sweep with trimmed cells, real model (assembled by .carry/assemble.sh):
# `dspark profile` with trimmed_widths [2,3,4] (once per machine: kept in /root/keep; its plain
# and full-block cells alone, fingerprint without trimmed cells, are the "fresh" table), then
# the closed-loop sweep of bench/device_issue6_sweep.sh over plain, K = 7, the policy with the
# shipped table ("shipped"), with the fresh table ("fresh") and with trimmed cells ("trimmed").
#
#   TEMPERATURE=1.0 bash bench/device_trimmed_real.sh    LEVELS (1,4,16,64,256), REPEATS (1)
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
TABLE=/root/keep/cost_table_trimmed.json
FRESH=/root/keep/cost_table_fresh.json
if [ ! -f "$TABLE" ]; then
  python3 -m dspark.cli profile --out "$TABLE" \
    --speculative-config '{"method": "dspark", "trimmed_widths": [2, 3, 4]}' \
    > /root/keep/profile_trimmed.txt 2>&1
  python3 - "$TABLE" "$FRESH" <<'PY'
import json, sys
table = json.load(open(sys.argv[1]))
k = table["fingerprint"]["draft_len"]
def plain_and_full(cells):
    return {g: {v: t for v, t in row.items() if int(v) in (int(g), int(g) * (k + 1))}
            for g, row in cells.items()}
table["fingerprint"]["trimmed_widths"] = []
table["cells"] = plain_and_full(table["cells"])
if table.get("sampled_cells"):
    table["sampled_cells"] = plain_and_full(table["sampled_cells"])
json.dump(table, open(sys.argv[2], "w"), indent=1)
PY
fi
cp /root/keep/profile_trimmed.txt "$OUT/"; cp "$TABLE" "$FRESH" "$OUT/" 2> /dev/null
grep -v "^INFO" /root/keep/profile_trimmed.txt | tail -22
export ARMS_JSON="{\"plain\": null,
  \"k7\": {\"method\": \"dspark\", \"scheduling\": false},
  \"shipped\": {\"method\": \"dspark\"},
  \"fresh\": {\"method\": \"dspark\", \"cost_table\": \"$FRESH\"},
  \"trimmed\": {\"method\": \"dspark\", \"trimmed_widths\": [2, 3, 4], \"cost_table\": \"$TABLE\"}}"
LEVELS=${LEVELS:-1,4,16,64,256} bash bench/device_issue6_sweep.sh
