#!/usr/bin/env bash
# Two revisions' server CPU per request, alternated (bench/serve_request_cost.sh in each): the
# development VM's speed drifts by more than most server changes save, so only pairs run back to
# back say anything. Each revision runs from its own git worktree beside this checkout (so that
# ../shared/data resolves as it does here), imported through PYTHONPATH; the worktrees are
# removed at the end.
#
#   bash bench/serve_request_cost_ab.sh OLD_REV NEW_REV [ROUNDS] [NUM_REQUESTS]
#   bash bench/serve_request_cost_ab.sh HEAD~1 HEAD 3 3000
#
# A revision may be WORKTREE for the working tree as it is (uncommitted changes included).
# Build the small model once first: python3 bench/serve_overhead.py (see serve_request_cost.sh).
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,12p "$0"; exit 2; }
OLD=$1 NEW=$2 ROUNDS=${3:-3} N=${4:-3000}
ROOT=$(git rev-parse --show-toplevel)
PARENT=$(dirname "$ROOT")
TREES=()

tree_dir() {  # where revision $1 is checked out
  if [ "$1" = WORKTREE ]; then echo "$ROOT"; else
    echo "$PARENT/.serve_ab_$(git -C "$ROOT" rev-parse --short "$1")"; fi
}

cleanup() {
  for dir in "${TREES[@]}"; do git -C "$ROOT" worktree remove --force "$dir"; done
  git -C "$ROOT" worktree prune
}
trap cleanup EXIT

OLD_DIR=$(tree_dir "$OLD")
NEW_DIR=$(tree_dir "$NEW")
for rev in "$OLD" "$NEW"; do
  dir=$(tree_dir "$rev")
  if [ "$rev" != WORKTREE ] && [ ! -d "$dir" ]; then
    git -C "$ROOT" worktree add -q --detach -f "$dir" "$rev"
    TREES+=("$dir")
  fi
done
echo "# bash bench/serve_request_cost_ab.sh $OLD $NEW $ROUNDS $N: old $OLD ($OLD_DIR), new $NEW ($NEW_DIR), $(date -u +%F)"
for _ in $(seq "$ROUNDS"); do
  for side in old new; do
    dir=$OLD_DIR; [ "$side" = new ] && dir=$NEW_DIR
    printf '%s: ' "$side"
    (cd "$dir" && PYTHONPATH="$dir" bash "$ROOT/bench/serve_request_cost.sh" "$N" | tail -1)
  done
done
