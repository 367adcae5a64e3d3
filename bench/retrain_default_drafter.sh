#!/usr/bin/env bash
# Train the shipped SmolLM2 drafter further, alone on one GPU, as one detached job (about
# 20 minutes on an H200 with TRAIN_MINUTES=8; the model assembled, .whl and .data carried):
#
#   regenerate   the self-distillation data (seeded; other draws than the first run since
#                the sampler change of 2026-12-03, docs/TRAINING.md)
#   train        from the shipped weights (--init-from), a step count that fills TRAIN_MINUTES
#   calibrate    `dspark calibrate`: the sampled and the greedy STS fits, the reliability plot
#   evaluate     tau per source at T = 0 and 1 on the held-out eval slices (K = 7)
#   profile      the cost table the new weights and calibration need (the old table's
#                fingerprint names the old ones, so the engine would refuse it)
#   bench        plain decoding, fixed K = 7 and the drafting policy with that table, interleaved
#
# A device call returns after at most 10 minutes, so start it detached and poll:
#
#   setsid nohup bash bench/retrain_default_drafter.sh > /root/keep/retrain.log 2>&1 &
#
# Each training stage resumes, so running it again after an interruption continues. Results
# (the drafter, calibration, eval, table, bench) under RESULTS; "all done" is its last line.
set -u
source bench/device_setup.sh
WORK=${WORK:-/root/keep/runs/dspark}
RESULTS=${RESULTS:-/root/keep/results}
PROMPTS=${PROMPTS_DIR:-.data}
mkdir -p "$RESULTS"
# INIT_FROM: the weights to start from; DATA_DIR: another run's regenerated data; TOTAL_STEPS:
# a fixed step count (0: fill TRAIN_MINUTES at the speed of the warm-up's last steps)
TRAIN=(python3 -m dspark.cli train --work-dir "$WORK" --prompts-dir "$PROMPTS" --no-progress
       --init-from "${INIT_FROM:-dspark/drafters/smollm2_135m_instruct}"
       ${DATA_DIR:+--data-dir "$DATA_DIR"})
DRAFTER=$WORK/drafter
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }

stamp regenerate
"${TRAIN[@]}" --stage regenerate --max-num-seqs 512 --max-minutes 60 || exit 1
stamp train
"${TRAIN[@]}" --stage train --train-minutes "${TRAIN_MINUTES:-8}" \
  --total-steps "${TOTAL_STEPS:-0}" --max-minutes 60 || exit 1
stamp calibrate
[ -f "$RESULTS/calibrate.txt" ] || python3 -m dspark.cli calibrate --drafter "$DRAFTER" \
  --prompts-dir "$PROMPTS" --no-progress --plot "$RESULTS/reliability.png" 2>&1 \
  | grep -v "^INFO" > "$RESULTS/calibrate.txt"
tail -22 "$RESULTS/calibrate.txt"
stamp evaluate
"${TRAIN[@]}" --stage evaluate --max-minutes 60 2>&1 | grep -v "^INFO"
stamp profile
SPEC="\"method\": \"dspark\", \"model\": \"$DRAFTER\""
[ -f "$RESULTS/cost_table.json" ] || python3 -m dspark.cli profile --speculative-config "{$SPEC}" \
  --out "$RESULTS/cost_table.json" 2>&1 | grep -v "^INFO"
stamp bench
ARMS="{\"plain\": null, \"k7\": {$SPEC, \"scheduling\": false},
  \"scheduled\": {$SPEC, \"cost_table\": \"$RESULTS/cost_table.json\"}}"
python3 -m dspark.cli bench --prompts-dir "$PROMPTS" --concurrency "${LEVELS:-1,16,64,256}" \
  --output-len 256 --repeats "${REPEATS:-1}" --arms "$ARMS" --out "$RESULTS/bench_arms.json" \
  2>&1 | grep -v "^INFO" > "$RESULTS/bench_arms.txt"
tail -12 "$RESULTS/bench_arms.txt"
cp "$WORK/log.json" "$WORK/eval.json" "$WORK/train/train.json" "$RESULTS/" 2>/dev/null
stamp all done
