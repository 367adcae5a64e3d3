#!/usr/bin/env bash
# Train the shipped SmolLM2 drafter and its DFlash ablation on one GPU, in calls of <= 10 minutes.
#
#   MINUTES=9 bash bench/train_default_drafter.sh      # run it again until it prints "all done"
#   TRAIN_MINUTES=16 INIT_FROM=dspark/drafters/smollm2_135m_instruct MINUTES=9 bash ...  # further
#   DFLASH_STEPS=7484 INIT_FROM=... TOTAL_STEPS=3000 ...  # the ablation at the shipped drafter's
#                                   total steps, from scratch, beside DSpark trained further
#
# Every call does what is left within MINUTES: regenerate the data, train DSpark (its step count
# sized to TRAIN_MINUTES of solo GPU time) and, beside it on the same GPU as soon as that count is
# known, the DFlash ablation (Markov rank 0, no confidence head) with the same data and steps;
# then calibrate DSpark and evaluate both. Each stage saves and resumes (docs/TRAINING.md).
# The two trainings share the GPU, so each runs slower than alone; the log.json of each work dir
# records the wall time of its stages.
set -u
WORK=${WORK:-/root/keep/runs}
MINUTES=${MINUTES:-9}
TRAIN_MINUTES=${TRAIN_MINUTES:-6}
START=$(date +%s)
# shellcheck disable=SC2206  # TRAIN_ARGS: extra options for every stage (a smoke run: small counts)
COMMON=(--prompts-dir "${PROMPTS_DIR:-.data}" --no-progress ${TRAIN_ARGS:-})
# INIT_FROM: start DSpark from a saved drafter (e.g. dspark/drafters/smollm2_135m_instruct)
DSPARK=(python3 -m dspark.cli train --work-dir "$WORK/dspark" "${COMMON[@]}"
        ${INIT_FROM:+--init-from "$INIT_FROM"})
DFLASH=(python3 -m dspark.cli train --work-dir "$WORK/dflash" --data-dir "$WORK/dspark/data"
        --markov-rank 0 "${COMMON[@]}")

left() {  # minutes left in this call, less a margin for saving
  python3 -c "import time; print(round($MINUTES - (time.time() - $START) / 60 - 0.3, 2))"
}
enough() {  # enough() M: at least M minutes left
  python3 -c "import sys; sys.exit(0 if $(left) >= $1 else 1)"
}
steps_of_dspark() {  # the step count the DSpark run fixed (from its log), empty until then
  grep -o "total_steps [0-9]*" "$WORK/dspark/pipeline.log" 2>/dev/null | tail -1 | cut -d' ' -f2
}

"${DSPARK[@]}" --stage regenerate --max-num-seqs 512 --max-minutes "$(left)" || exit 1
[ -f "$WORK/dspark/data/regenerate.json" ] || { echo "regenerate not done yet"; exit 0; }

if [ ! -f "$WORK/dspark/train/train.json" ] || [ ! -f "$WORK/dflash/train/train.json" ]; then
  "${DSPARK[@]}" --stage train --train-minutes "$TRAIN_MINUTES" --total-steps "${TOTAL_STEPS:-0}" \
    --max-minutes "$(left)" &
  main=$!
  steps=${DFLASH_STEPS:-$(steps_of_dspark)}
  while [ -z "$steps" ] && kill -0 $main 2>/dev/null; do sleep 2; steps=$(steps_of_dspark); done
  if [ -n "$steps" ]; then
    "${DFLASH[@]}" --stage train --total-steps "$steps" --max-minutes "$(left)" &
    ablation=$!
    wait $ablation
  fi
  wait $main
fi
[ -f "$WORK/dspark/train/train.json" ] && [ -f "$WORK/dflash/train/train.json" ] \
  || { echo "training not done yet"; exit 0; }

KV=(--kv-cache-memory-gb 16)  # two engines share the GPU below
enough 1.5 && "${DSPARK[@]}" --stage calibrate "${KV[@]}" --max-minutes "$(left)"
if enough 2.5; then
  "${DSPARK[@]}" --stage evaluate "${KV[@]}" --max-minutes "$(left)" > "$WORK/dspark_eval.txt" 2>&1 &
  "${DFLASH[@]}" --stage evaluate "${KV[@]}" --max-minutes "$(left)" > "$WORK/dflash_eval.txt" 2>&1 &
  wait
  cat "$WORK/dspark_eval.txt" "$WORK/dflash_eval.txt" | grep -v "^INFO"
fi
[ -f "$WORK/dspark/eval.json" ] && [ -f "$WORK/dflash/eval.json" ] || { echo "eval not done"; exit 0; }
"${DSPARK[@]}" --stage evaluate --baseline-work-dir "$WORK/dflash"
echo "all done"
