#!/usr/bin/env bash
# The decode GEMV at several rows, A/B on the GPU (docs/PERFORMANCE.md, sixteenth look: the one-row
# GEMV and the fused prologues were measured with this script then; since, a GEMV of 2-8 rows keeps
# each W tile in registers across its rows): the kernel tests (with attention's), the GEMV chain at
# 2-8 rows over tiles and warps, then steady decode steps of the same model at batch 1-8 in four
# arms (env vars of dspark/layers/linear.py, kernels/pdl.py), and the speculative step at G = 1
# with the GEMV at 1 row, at up to 4 rows and at up to 8. (A second kernel for 2-8 rows, the
# deferred sums, lost in every step and was removed: docs/PERFORMANCE.md, twenty-third look.)
#   MODEL=/tmp/rs DRAFTER=/tmp/rd bash bench/device_gemv_ab.sh      (random model and drafter)
source bench/device_setup.sh
mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/rs}
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv_triton.py \
  tests/kernels/test_model_triton_backend.py tests/kernels/test_paged_attention_triton.py \
  > "$OUT/pytest_gemv.txt" 2>&1
echo "kernel tests rc=$?: $(tail -1 "$OUT/pytest_gemv.txt")"
timeout 240 python3 bench/pdl_chain.py --rows "${CHAIN_ROWS:-8}" --block-n 2,4 --block-k 1024 \
  --num-warps 1,2,4 --out "$OUT/pdl_rows.json" \
  > "$OUT/pdl_rows.txt" 2>&1
echo "chain rc=$?"; grep "^layer" "$OUT/pdl_rows.txt"
for arm in "cublas:DSPARK_GEMV=0 DSPARK_PDL=0" "gemv:DSPARK_GEMV=1" "rows4:DSPARK_GEMV_ROWS=4" \
  "rows8:DSPARK_GEMV_ROWS=8"; do
  name=${arm%%:*}
  env ${arm#*:} timeout 150 python3 bench/step_profile.py --model "$MODEL" --batch 1,2,4,8 \
    --steps 50 --out "$OUT/step_$name.json" > "$OUT/step_$name.txt" 2>&1
  echo "== $name rc=$?"; grep -A3 "step us" "$OUT/step_$name.txt" | head -4
done
if [ -n "${DRAFTER:-}" ]; then
  for arm in "rows1:DSPARK_GEMV_ROWS=1" "rows4:DSPARK_GEMV_ROWS=4" "rows8:DSPARK_GEMV_ROWS=8"; do
    name=${arm%%:*}
    env ${arm#*:} timeout 150 python3 bench/spec_step_profile.py --model "$MODEL" \
      --drafter "$DRAFTER" --k 7 --batch 1 --out "$OUT/spec_$name.json" \
      > "$OUT/spec_$name.txt" 2>&1
    echo "== spec G=1, $name, rc=$?"; tail -3 "$OUT/spec_$name.txt"
  done
fi
