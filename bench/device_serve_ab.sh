#!/usr/bin/env bash
# Serving arms side by side in one device call: the offline engine first (a closed loop of the
# same requests: C in flight, 4 C in all, `--waves 4`), then one `dspark serve` per arm, each
# loaded by `dspark bench serve` at every level (C streamed requests in flight, 4 C requests,
# the same first 4 C prompts; 256 tokens, ignore_eos). Results and a table under $OUT.
#
#   MODEL=/tmp/rs PROMPTS_DIR=.dsm LEVELS=1,64,256 bash bench/device_serve_ab.sh \
#     "interval1|--stream-interval 1" "interval8|--stream-interval 8"
#
# MIN_REQUESTS (e.g. 16): a level's requests are 4 C, at least this many, in both engines (at
# C = 1 four requests give the drafting policy little evidence: docs/PERFORMANCE.md, 29th look).
# Each served level runs one untimed wave of C requests first (SERVE_WARMUP=0 skips it), then
# SERVE_REPEATS (1) timed runs: the table gives their median (the upper one of an even count).
# MODEL defaults to the default model; PROMPTS_DIR to .data; an arm is "NAME|serve arguments",
# whose leading VAR=value words are set in that server's environment ("burst32|DSPARK_BURST_REQUESTS=32"),
# except TREE=DIR: that server runs an earlier tree's package, unpacked there by `unpack_before
# TARBALL` (bench/device_setup.sh): "before|TREE=/tmp/before --speculative-config {...}", and
# CLIENT=FLAG: that arm's load generator gets FLAG ("nopre|CLIENT=--no-preconnect").
# An arm whose words set DSPARK_POLICY_TRACE=DIR (a fresh directory) traces its engine's drafting
# policy step by step: $OUT gets policy_trace_NAME.txt (bench/policy_trace.py) and the trace
# itself, packed (policy_trace_NAME.tgz); every level and repeat of the arm is in one file.
# SPREAD (e.g. 0.5): seeded lengths in 256 * [1 - S, 1 + S], the same in both engines, so requests
# end at different steps instead of a whole level's at once (unset: every request 256 tokens).
# OFFLINE_ARMS (a `dspark bench --arms` object) gives the offline engines: a served arm is
# compared with the offline arm of its own name, else with the first one; without it, one
# offline arm of the default engine. Of each server's log only its last stats lines (steps
# and the share that ran eagerly among them), warnings and errors are kept
# (serve_NAME_log.txt): the files that come back are few (past 8 files, those logs and the
# traces' summaries are packed into serve_logs.tgz).
#
# ENGINE_CPUS, SERVER_CPUS, CLIENT_CPUS (taskset lists, e.g. "0,1"): pin the server's children
# (the engine process, all its threads, and any API workers), the server process and the load
# generator to those CPUs; unset, the scheduler places them.
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
python3 -c "import fastapi, uvicorn, httpx" || exit 1
# the serve extra's HTTP parser (uvicorn falls back to h11, pure Python, without it)
python3 -c "import httptools" 2> /dev/null \
  || echo "httptools is missing: the servers parse HTTP with h11 (carry its cp312 wheel in .whl)"
# a drafting policy needs a table for this GPU: measured first if none is shipped or saved
[ "${MODEL:-default}" = default ] && ensure_cost_table > "$OUT/cost_table.txt" 2>&1
LEVELS=${LEVELS:-1,64,256}
MODEL=${MODEL:-default}
rm -f /tmp/serve_*_c*.json /tmp/cpu_*_c*.txt  # an earlier call's on this machine
COMMON=(--prompts-dir "${PROMPTS_DIR:-.data}" --sources "${SOURCES:-gsm8k,alpaca,vicuna}"
        --output-len 256 ${SPREAD:+--output-len-spread "$SPREAD"})

# A throwaway run first (WARMUP=0 skips it): the first engine process of a device call ran
# 20-30% slower at C = 256 than later ones in the same call (docs/PERFORMANCE.md, fourteenth
# look), which made the offline reference, measured first, too low
if [ "${WARMUP:-1}" = 1 ]; then
  python3 -m dspark.cli bench --model "$MODEL" "${COMMON[@]}" --concurrency 256 --waves 1 \
    --no-plot --out /tmp/warmup.json > /dev/null 2>&1
fi
# three repeats, their median: a speculative engine's first run of a level can be much slower
# than its next ones (docs/PERFORMANCE.md, sixteenth look)
${ENGINE_CPUS:+taskset -c "$ENGINE_CPUS"} python3 -m dspark.cli bench --model "$MODEL" \
  "${COMMON[@]}" --concurrency "$LEVELS" --waves 4 --repeats "${OFFLINE_REPEATS:-3}" \
  ${MIN_REQUESTS:+--min-requests "$MIN_REQUESTS"} \
  ${OFFLINE_ARMS:+--arms "$OFFLINE_ARMS"} --no-plot --out "$OUT/offline.json" > /dev/null 2>&1 \
  || echo "offline bench failed"

# cpu_s PID...: the CPU seconds (user + system) these processes have used so far
cpu_s() {
  local ticks=0 pid
  for pid in "$@"; do
    ticks=$((ticks + $(awk '{print $14 + $15}' "/proc/$pid/stat" 2> /dev/null || echo 0)))
  done
  awk "BEGIN {print $ticks / $(getconf CLK_TCK)}"
}
minus() { awk "BEGIN {print $1 - $2}"; }

port=8200
for arm in "$@"; do
  name=${arm%%|*}
  read -r -a extra <<< "${arm#*|}"
  arm_env=()  # leading VAR=value words: the server's environment (e.g. DSPARK_BURST_REQUESTS=32)
  tree=$PWD  # TREE=DIR among them: the server runs that tree's package (unpack_before's)
  client_args=()  # CLIENT=--flag among them: that arm's load generator gets the flag
  while [ ${#extra[@]} -gt 0 ] && [[ ${extra[0]} =~ ^[A-Z_][A-Z0-9_]*= ]]; do
    case ${extra[0]} in
      TREE=*) tree=${extra[0]#TREE=} ;;
      CLIENT=*) client_args+=("${extra[0]#CLIENT=}") ;;
      *) arm_env+=("${extra[0]}") ;;
    esac
    extra=("${extra[@]:1}")
  done
  port=$((port + 1))
  log=/tmp/serve_${name}.log
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree exec ${SERVER_CPUS:+taskset -c "$SERVER_CPUS"} \
    env "${arm_env[@]}" python3 -m dspark.cli serve "$MODEL" --port "$port" \
    --max-num-seqs 256 --disable-access-log "${extra[@]}") > "$log" 2>&1 &
  pid=$!
  wait_healthy "$port" "$pid" || echo "server $name did not come up"
  engine_pids=$(pgrep -P "$pid" | tr '\n' ' ')
  if [ -n "${ENGINE_CPUS:-}" ]; then
    for p in $engine_pids; do taskset -a -p -c "$ENGINE_CPUS" "$p" > /dev/null; done
  fi
  for c in ${LEVELS//,/ }; do
    n=$((4 * c)); [ "$n" -lt "${MIN_REQUESTS:-0}" ] && n=$MIN_REQUESTS
    if [ "${SERVE_WARMUP:-1}" = 1 ]; then  # one untimed wave first (the slow first run above)
      timeout 60 python3 -m dspark.cli bench serve --base-url "http://127.0.0.1:$port" \
        "${COMMON[@]}" --concurrency "$c" --num-prompts "$c" --no-plot \
        --out "/tmp/serve_${name}_c${c}_warm.json" > /dev/null 2>&1
    fi
    for r in $(seq "${SERVE_REPEATS:-1}"); do  # the first repeat's CPU seconds are the table's
      out=/tmp/serve_${name}_c$c.json; [ "$r" = 1 ] || out=/tmp/serve_${name}_c${c}_r$r.json
      server0=$(cpu_s "$pid") engine0=$(cpu_s $engine_pids) start=$(date +%s.%N)
      TIMEFORMAT="%U %S"  # bash's `time`: the client's user and system CPU seconds
      { time ${CLIENT_CPUS:+taskset -c "$CLIENT_CPUS"} timeout 120 python3 -m dspark.cli bench serve --base-url "http://127.0.0.1:$port" \
        "${COMMON[@]}" --concurrency "$c" --num-prompts "$n" --no-plot "${client_args[@]}" \
        --out "$out" > /dev/null 2>&1 ; } 2> "/tmp/client_cpu.txt"
      # the level's wall, and the CPU seconds of the server, its children (the engine process
      # and any API workers of --api-server-count) and the client
      [ "$r" = 1 ] && echo "$(minus "$(date +%s.%N)" "$start") $(minus "$(cpu_s "$pid")" "$server0")" \
        "$(minus "$(cpu_s $engine_pids)" "$engine0")" \
        "$(awk '{print $1 + $2}' /tmp/client_cpu.txt)" > "/tmp/cpu_${name}_c$c.txt"
    done
  done
  kill -TERM "$pid" 2> /dev/null
  wait "$pid"
  # an arm with DSPARK_POLICY_TRACE=DIR among its words: its engine's trace, summarised and
  # packed (`python3 bench/policy_trace.py FILE` again here for more)
  for word in "${arm_env[@]}"; do
    [[ $word == DSPARK_POLICY_TRACE=* ]] || continue
    trace_dir=${word#DSPARK_POLICY_TRACE=}
    for f in "$trace_dir"/*.jsonl; do
      [ -f "$f" ] && python3 bench/policy_trace.py "$f" > "$OUT/policy_trace_${name}.txt" 2>&1
    done
    tar czf "$OUT/policy_trace_${name}.tgz" -C "$trace_dir" . 2> /dev/null
  done
  { grep "dspark stats" "$log" | tail -6
    grep -E "engine loop:|output sender|engine pipe, read" "$log"
    grep -v "clean_up_tokenization" "$log" | grep -E -A8 "WARNING|ERROR|Traceback" | head -80
  } > "$OUT/serve_${name}_log.txt"
done

python3 - "$OUT" "$LEVELS" "$@" <<'PY'
import json, os, sys
out, levels, arms = sys.argv[1], [int(c) for c in sys.argv[2].split(",")], sys.argv[3:]
names = [a.split("|")[0] for a in arms]
try:
    results = json.load(open(f"{out}/offline.json"))
    sweeps = results.get("arms") or {"dspark": results["dspark"]}
except (OSError, KeyError):
    sweeps = {}
offline_arms = {arm: {lv["concurrency"]: lv for lv in sweep["levels"]} for arm, sweep in sweeps.items()}
first = next(iter(offline_arms.values()), {})
table = {"levels": levels, "offline": offline_arms, "served": {}}
rows = [f"{'C':>5} {'arm':>12} {'offline':>9} {'served':>9} {'ratio':>6} {'TTFT p50':>9} {'TPOT p50':>9} {'ITL p50':>8} {'ok':>9}"
        f" {'wall s':>6} {'CPU s: server':>13} {'children':>8} {'client':>6}"]
for name in names:
    for c in levels:
        path = f"/tmp/serve_{name}_c{c}.json"
        s = json.load(open(path))["levels"][0]["summary"] if os.path.exists(path) else None
        table["served"][f"{name}/{c}"] = s
        # SERVE_REPEATS: the level's median throughput over its repeats, each one kept
        runs = [json.load(open(p))["levels"][0]["summary"]["output_tokens_per_s"]
                for p in [path, *(f"/tmp/serve_{name}_c{c}_r{r}.json" for r in range(2, 100))]
                if os.path.exists(p)]
        if s is not None:
            s["output_tokens_per_s_runs"] = runs
            s["output_tokens_per_s"] = sorted(runs)[len(runs) // 2]  # the upper median
        off = offline_arms.get(name, first).get(c, {}).get("output_tokens_per_s", float("nan"))
        if s is None:
            rows.append(f"{c:>5} {name:>12} {off:>9.0f} {'-':>9}")
            continue
        tps = s["output_tokens_per_s"]
        try:  # the level's wall and the CPU seconds each process used in it
            wall, *cpu = open(f"/tmp/cpu_{name}_c{c}.txt").read().split()
            s["cpu_s"] = dict(zip(("server", "children", "client"), map(float, cpu)))
            cpu_cols = f" {float(wall):>6.2f} {float(cpu[0]):>13.2f} {float(cpu[1]):>8.2f} {float(cpu[2]):>6.2f}"
        except (OSError, ValueError, IndexError):
            cpu_cols = ""
        rows.append(f"{c:>5} {name:>12} {off:>9.0f} {tps:>9.0f} {tps / off:>6.2f} "
                    f"{s['ttft_ms']['median'] or 0:>9.1f} {s['tpot_ms']['median'] or 0:>9.2f} "
                    f"{s['itl_ms']['median'] or 0:>8.1f} {s['num_completed']:>4}/{s['num_requests']:<4}{cpu_cols}"
                    + (f"  runs {' '.join(f'{t:.0f}' for t in runs)}" if len(runs) > 1 else ""))
json.dump(table, open(f"{out}/serve_ab.json", "w"), indent=1)
open(f"{out}/serve_ab.txt", "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
PY

# At most 8 files come back from a device call. Past that, the servers' logs and the traces'
# summaries travel in one archive (serve_logs.tgz; `tar xzf` it), so none is left behind.
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
  packed=$(cd "$OUT" && ls serve_*_log.txt policy_trace_*.txt 2> /dev/null)
  [ -n "$packed" ] && tar czf "$OUT/serve_logs.tgz" -C "$OUT" $packed \
    && (cd "$OUT" && rm -f $packed)
  ls "$OUT" | wc -l | xargs -I{} echo "{} files in $OUT (the logs and trace summaries in serve_logs.tgz)"
fi
