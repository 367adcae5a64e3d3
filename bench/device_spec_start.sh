#!/usr/bin/env bash
# Does the speculative engine start at max_num_seqs 256 on this GPU (an H100's 80 GB had too
# little left for the speculative graphs' pool before the memory plan reserved it:
# docs/PERFORMANCE.md, twenty-fourth look)? Starts LLM(MODEL, speculative_config={"method":
# "dspark"}) and a greedy and a sampled generate, printing the memory plan's lines and the GPU's
# memory after capture; then bench/gc_census.py on the speculative engine (fixed K = 7).
#
#   MODEL=/tmp/rs DRAFTER=/tmp/rd bash bench/device_spec_start.sh     (random weights)
#   bash bench/device_spec_start.sh                                    (the default model)
#   SPEC_EXTRA=', "mixed_prefill_tokens": [256, 512]' bash bench/device_spec_start.sh  (more keys)
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
MODEL=${MODEL:-default}
SC="{\"method\": \"dspark\"${DRAFTER:+, \"model\": \"$DRAFTER\"}${SPEC_EXTRA:-}}"
timeout 300 python3 - "$MODEL" "$SC" > "$OUT/spec_start.txt" 2>&1 <<'PY'
import json, sys, time
import torch
from dspark import LLM, SamplingParams
start = time.perf_counter()
llm = LLM(sys.argv[1], max_num_seqs=256, speculative_config=json.loads(sys.argv[2]))
free, total = torch.cuda.mem_get_info()
print(f"started in {time.perf_counter() - start:.1f} s; GPU memory free {free / 2**30:.2f} of "
      f"{total / 2**30:.2f} GiB; KV pages {llm.engine.kv_plan.num_pages}")
for t in (0.0, 1.0):
    out = llm.generate(["Write a haiku about the sea."] * 4,
                       SamplingParams(temperature=t, seed=1, max_tokens=32))
    print(f"temperature {t}: {[len(o.outputs[0].token_ids) for o in out]} tokens")
PY
echo "start rc=$?"; grep -E "GPU memory|KV cache|started|temperature|Error" "$OUT/spec_start.txt"
if [ -n "${DRAFTER:-}" ]; then
  timeout 200 python3 bench/gc_census.py --model "$MODEL" --drafter "$DRAFTER" \
    > "$OUT/gc_census_spec.txt" 2>&1
  echo "census rc=$?"; grep -vE "^INFO|Warn" "$OUT/gc_census_spec.txt" | tail -3
fi
