# Source it: `source bench/wait_healthy.sh` (bench/device_setup.sh does).
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
