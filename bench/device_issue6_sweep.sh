#!/usr/bin/env bash
# The confidence-scheduling issue's sweep in one device call per temperature: arms plain,
# fixed K = 1 / 3 / 5 / 7 and scheduled (the policy with the shipped or given table), a closed
# loop of C requests in flight ending at different steps (4 C per level, lengths 128-384),
# held-out prompts. Results (JSON, PNG, steps by path) under $OUT.
#
#   TEMPERATURE=0 bash bench/device_issue6_sweep.sh        # then TEMPERATURE=1.0
#
# MIN_REQUESTS (32: a level's requests are 4 C, at least this many, so C = 1 runs 32 in a row,
# not 4: PERFORMANCE.md twenty-fourth look),
# LEVELS (default 1,2,4,8,16,32,64,128,256,512), REPEATS (3: each level's median; a speculative
# arm's first run of a level can be much slower than its next ones, PERFORMANCE.md sixteenth look), COST_TABLE (a path for the
# scheduled arm; default: the table shipped beside the drafter, if its fingerprint matches),
# TRIMMED_TABLE (a table profiled with trimmed_widths TRIMMED_WIDTHS, default [2,3,4]: adds the
# arm "trimmed", the policy with those cells), ARMS_JSON (a whole `dspark bench --arms` object),
# With no cost table for this GPU shipped or saved, `dspark profile` measures one first
# (ensure_cost_table, bench/device_setup.sh; its output in $OUT/cost_table.txt).
# The whole sweep does not fit one 600 s call: run it in parts, each with its own LEVELS and
# PART (a name for its files), then `python3 bench/merge_sweeps.py` the parts' JSON. At 512 the
# six resident arms' graph pools hold ~42 B per verified position and vocabulary entry (8.5 GB
# for K = 7; PERFORMANCE.md twenty-fourth look), and a KV cache sized for every request at full
# length is 12 GB an arm: KV_GB=8 (--kv-cache-memory-gb, per arm) holds 512 requests of this
# bench's lengths (prompts ~100 tokens, outputs up to 384); preemptions, if any, are counted.
# POLICY_TRACE=1 (each policy's decisions step by step, dspark/spec/policy_trace.py: the traces
# in $OUT/policy_traces.tgz, their summaries in ${name}_policy_trace.txt).
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
T=${TEMPERATURE:-0}
TABLE=${COST_TABLE:+, \"cost_table\": \"$COST_TABLE\"}
ARMS="{\"plain\": null,
  \"k1\": {\"method\": \"dspark\", \"scheduling\": false, \"num_speculative_tokens\": 1},
  \"k3\": {\"method\": \"dspark\", \"scheduling\": false, \"num_speculative_tokens\": 3},
  \"k5\": {\"method\": \"dspark\", \"scheduling\": false, \"num_speculative_tokens\": 5},
  \"k7\": {\"method\": \"dspark\", \"scheduling\": false},
  \"scheduled\": {\"method\": \"dspark\"${TABLE}}${TRIMMED_TABLE:+, \"trimmed\": {\"method\": \"dspark\", \"trimmed_widths\": ${TRIMMED_WIDTHS:-[2,3,4]}, \"cost_table\": \"$TRIMMED_TABLE\"\}}}"
ARMS=${ARMS_JSON:-$ARMS}
# the policy arms need a table for this GPU (the model's default drafter; COST_TABLE overrides)
# (and a ladder to the highest level: a sweep to 512 builds its engines with 512 seats)
LEVELS=${LEVELS:-1,2,4,8,16,32,64,128,256,512}
TOP=$(tr , '\n' <<< "$LEVELS" | sort -n | tail -1)
[ -n "${COST_TABLE:-}" ] || ensure_cost_table "${MODEL:-default}" "$TOP" > "$OUT/cost_table.txt" 2>&1
name=issue6_sweep_t${T}${PART:+_$PART}
TRACES=/tmp/policy_traces_t$T
if [ -n "${POLICY_TRACE:-}" ]; then rm -rf "$TRACES"; export DSPARK_POLICY_TRACE=$TRACES; fi
python3 -m dspark.cli bench --prompts-dir "${PROMPTS_DIR:-.data}" \
  --concurrency "$LEVELS" \
  --output-len 256 --output-len-spread 0.5 --waves 4 --min-requests "${MIN_REQUESTS:-32}" \
  --repeats "${REPEATS:-3}" ${KV_GB:+--kv-cache-memory-gb "$KV_GB"} \
  --temperature "$T" --arms "$ARMS" --out "$OUT/$name.json" 2>&1 | grep -v "^INFO" \
  > "$OUT/$name.txt"
python3 bench/arm_steps.py "$OUT/$name.json" > "$OUT/${name}_steps.txt"
if [ -n "${POLICY_TRACE:-}" ]; then
  for f in "$TRACES"/*.jsonl; do python3 bench/policy_trace.py "$f"; done > "$OUT/${name}_policy_trace.txt"
  tar czf "$OUT/policy_traces_t$T.tgz" -C "$(dirname "$TRACES")" "$(basename "$TRACES")"
fi
tail -14 "$OUT/$name.txt"
