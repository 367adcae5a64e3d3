#!/usr/bin/env bash
# A host-work change measured on the GPU: the same closed loops (plain and fixed K = 7 at
# C = 64 and 256, greedy, the policy trace's host-work split) run by an older tree and by this
# one, alternated, on one machine. The older tree is the package only, archived here and
# carried in (without its drafters: it uses this tree's drafter and cost tables):
#
#   git archive 7819fae dspark ':!dspark/drafters' | gzip > .carry/old_dspark.tgz   # here
#   bash bench/device_host_cut_ab.sh                            # there, carrying that file
#
# ROUNDS (2), LEVELS (64,256), REPEATS (2), PROMPTS_DIR (.carry/data), OUTPUT_LEN (256),
# MIN_REQUESTS (32), TREES ("old new"; "new0" is this tree with DSPARK_STEADY_GC=0, the collector
# as it was before dspark/engine/collector.py). Under $OUT, per tree and round: the bench's JSON and table, and
# bench/policy_trace.py's summary of its trace (periods by G, split into the wait in the step's
# host sync, host work and time off the CPU). The twenty-sixth look of docs/PERFORMANCE.md is
# the change this was written for.
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
REPO=$PWD
OLD=/tmp/old_tree
rm -rf "$OLD" && mkdir -p "$OLD" && tar xzf .carry/old_dspark.tgz -C "$OLD"
ln -s "$REPO/dspark/drafters" "$OLD/dspark/drafters"
ARMS='{"plain": null, "k7": {"method": "dspark", "scheduling": false}}'
for round in $(seq "${ROUNDS:-2}"); do
  for tree in ${TREES:-old new}; do
    dir=$REPO; [ "$tree" = old ] && dir=$OLD
    steady=1; [ "$tree" = new0 ] && steady=0
    traces=/tmp/host_cut_traces_${tree}_$round
    rm -rf "$traces"
    # (run from the tree's own directory: python puts the working directory first on the path)
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir DSPARK_POLICY_TRACE=$traces DSPARK_STEADY_GC=$steady \
      python3 -m dspark.cli \
      bench --prompts-dir "$REPO/${PROMPTS_DIR:-.carry/data}" --concurrency "${LEVELS:-64,256}" \
      --output-len "${OUTPUT_LEN:-256}" --output-len-spread 0.5 --waves 4 \
      --min-requests "${MIN_REQUESTS:-32}" --repeats "${REPEATS:-2}" --temperature 0 \
      --arms "$ARMS" --out "$OUT/${tree}_$round.json" \
      2>&1 | grep -v "^INFO" > "$OUT/${tree}_$round.txt")
    for f in "$traces"/*.jsonl; do python3 bench/policy_trace.py "$f"; done \
      > "$OUT/${tree}_${round}_trace.txt"
  done
done
for f in "$OUT"/*_[0-9].json; do python3 bench/arm_steps.py "$f" > "${f%.json}_steps.txt"; done
# few files come back from a device call: the tables stay, the rest travels in one archive
(cd "$OUT" && tar czf host_cut_ab.tgz ./*.json ./*_trace.txt ./*_steps.txt \
  && cat ./*_steps.txt > steps.txt && rm ./*.json ./*_trace.txt ./*_[0-9]_steps.txt)
for f in "$OUT"/*_[0-9].txt; do echo "== $f"; tail -6 "$f"; done
