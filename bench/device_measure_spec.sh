#!/usr/bin/env bash
# One device call (about 5 minutes, the model already assembled): the GPU tests, this GPU's cost
# table, and plain decoding vs fixed-K speculation vs speculation with the drafting policy, side by
# side on real held-out prompts. Results under $OUT; a short table last.
#
#   bash .carry/assemble.sh; bash bench/device_measure_spec.sh
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
python3 -m pytest -q -m gpu tests -x 2>&1 | tail -5 | tee "$OUT/pytest_gpu.txt"
python3 -m dspark.cli profile --out "$OUT/cost_table_h200.json" 2>&1 | grep -v "^INFO"
B=(python3 -m dspark.cli bench --prompts-dir "${PROMPTS_DIR:-.data}" --concurrency "${LEVELS:-1,16,64,256}"
   --output-len 256 --no-plot)
"${B[@]}" --out "$OUT/bench_plain.json" > "$OUT/bench_plain.txt" 2>&1
"${B[@]}" --speculative-config '{"method": "dspark"}' --out "$OUT/bench_spec_k7.json" \
  > "$OUT/bench_spec_k7.txt" 2>&1
"${B[@]}" --speculative-config "{\"method\": \"dspark\", \"cost_table\": \"$OUT/cost_table_h200.json\"}" \
  --out "$OUT/bench_spec_policy.json" > "$OUT/bench_spec_policy.txt" 2>&1
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
runs = {name: json.load(open(f"{out}/bench_{name}.json"))["dspark"]["levels"]
        for name in ("plain", "spec_k7", "spec_policy")}
print(f"{'C':>5} {'plain':>9} {'K=7':>9} {'policy':>9} {'K=7/plain':>10} {'policy/plain':>13}")
for p, k, s in zip(*runs.values()):
    a, b, c = p["output_tokens_per_s"], k["output_tokens_per_s"], s["output_tokens_per_s"]
    print(f"{p['concurrency']:>5} {a:>9.0f} {b:>9.0f} {c:>9.0f} {b / a:>10.2f} {c / a:>13.2f}")
PY
