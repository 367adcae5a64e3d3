#!/usr/bin/env bash
# The offline engine's throughput (random SmolLM2-shaped model, C = 1 and 256, greedy, 256
# tokens) by where its process runs: free, with one intra-op thread, pinned to two CPUs (two
# different pairs) and to one. Carry .whl, .data and .carry/tok. One line per variant.
source bench/device_setup.sh
[ -d /tmp/rs ] || python3 bench/random_smollm2.py --out /tmp/rs --tokenizer .carry/tok > /dev/null 2>&1
mkdir -p /tmp/data && cp .data/* /tmp/data/ && mkdir -p "$OUT"
variant() {
  local name=$1; shift
  "$@" python3 -c "import torch; print('$name torch threads', torch.get_num_threads())"
  "$@" python3 -m dspark.cli bench --model /tmp/rs --prompts-dir /tmp/data --output-len 256 \
    --sources gsm8k,alpaca,vicuna --concurrency "${LEVELS:-1,256}" --waves 2 --repeats 2 \
    --no-plot --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  python3 - "$OUT/$name.json" "$name" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], [(lv["concurrency"], [round(x) for x in lv["output_tokens_per_s_runs"]],
                     lv["tpot_ms"]["p50"]) for lv in d["dspark"]["levels"]])
PY
}
for v in ${VARIANTS:-free omp1 pin01 pin56 pin0 free2}; do
  case $v in
    free*) variant "$v" env ;;
    omp1) variant "$v" env OMP_NUM_THREADS=1 ;;
    pin01) variant "$v" taskset -c 0,1 ;;
    pin56) variant "$v" taskset -c 5,6 ;;
    pin0) variant "$v" taskset -c 0 ;;
  esac
done
