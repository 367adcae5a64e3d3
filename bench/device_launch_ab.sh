#!/usr/bin/env bash
# The nineteenth look's launch cuts, timed on the GPU in one call: the drafter's context upkeep
# folded into one kernel (DSPARK_FOLDED_CONTEXT) and greedy verification in one kernel
# (DSPARK_FUSED_VERIFY), against the old paths, arms interleaved.
#
#   MODEL=/tmp/rs DRAFTER=/tmp/rd bash bench/device_launch_ab.sh profile   # cost-table cells
#   MODEL=/tmp/rs DRAFTER=/tmp/rd bash bench/device_launch_ab.sh steps     # draft / target split
#   MODEL=/tmp/rs DRAFTER=/tmp/rd bash bench/device_launch_ab.sh sampled   # fused sampled slot
#
# profile: `dspark profile` at BATCH (default 1,4,64): new and old twice, the fold alone once,
# printed side by side by bench/compare_cost_tables.py.
# sampled: the same profile, default against DSPARK_FUSED_SAMPLED_DRAFT=1 DSPARK_FUSED_SAMPLE=1
# (the fused sampled Markov slot and plain sampler), each twice.
# steps: bench/spec_step_profile.py at K = 7 for new and old (needs DRAFTER, a directory).
# MODEL defaults to the default model, DRAFTER (profile only) to the shipped drafter. Results
# under $OUT/launch_ab.
set -u
source bench/device_setup.sh
dir=$OUT/launch_ab
mkdir -p "$dir"
MODEL=${MODEL:-default}
SC="{\"method\": \"dspark\"${DRAFTER:+, \"model\": \"$DRAFTER\"}}"
OLD=(DSPARK_FOLDED_CONTEXT=0 DSPARK_FUSED_VERIFY=0)

profile() {  # profile NAME [ENV...]
  local name=$1; shift
  env "$@" python3 -m dspark.cli profile --model "$MODEL" --batch "${BATCH:-1,4,64}" \
    --steps 20 --rounds 3 --speculative-config "$SC" --out "$dir/$name.json" \
    > "$dir/$name.txt" 2>&1 || tail -5 "$dir/$name.txt"
}

steps() {  # steps NAME [ENV...]
  local name=$1; shift
  env "$@" python3 bench/spec_step_profile.py --model "$MODEL" \
    --drafter "${DRAFTER:?steps needs DRAFTER}" --k 7 --batch "${BATCH:-1,4,64}" \
    --out "$dir/$name.json" > "$dir/$name.txt" 2>&1 || tail -5 "$dir/$name.txt"
}

case "${1:-profile}" in
  profile)
    profile new_1
    profile old_1 "${OLD[@]}"
    profile fold_only_1 DSPARK_FUSED_VERIFY=0
    profile old_2 "${OLD[@]}"
    profile new_2
    python3 bench/compare_cost_tables.py old="$dir/old_1.json" new="$dir/new_1.json" \
      fold_only="$dir/fold_only_1.json" old2="$dir/old_2.json" new2="$dir/new_2.json" \
      | tee "$dir/profile_ab.txt"
    ;;
  sampled)  # the fused sampled Markov slot and sampler (off by default) against the default
    FUSED=(DSPARK_FUSED_SAMPLED_DRAFT=1 DSPARK_FUSED_SAMPLE=1)
    profile base_1
    profile fused_1 "${FUSED[@]}"
    profile base_2
    profile fused_2 "${FUSED[@]}"
    python3 bench/compare_cost_tables.py base="$dir/base_1.json" fused="$dir/fused_1.json" \
      base2="$dir/base_2.json" fused2="$dir/fused_2.json" | tee "$dir/sampled_ab.txt"
    ;;
  steps)
    steps steps_new
    steps steps_old "${OLD[@]}"
    tail -n 12 "$dir/steps_new.txt" "$dir/steps_old.txt"
    ;;
  *) echo "usage: device_launch_ab.sh profile|sampled|steps" >&2; exit 2 ;;
esac
