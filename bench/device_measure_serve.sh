#!/usr/bin/env bash
# One device call (about 4 minutes, the model already assembled, the serve wheels in .whl):
# `dspark bench serve` against one `dspark serve` per arm (plain decoding, speculation with the
# drafting policy), and the offline engine on the same prompts and lengths, side by side. Each
# level C keeps C streamed requests in flight for 4 C requests (at least 8). Results under $OUT;
# a short table last.
#
#   bash .carry/assemble.sh; bash bench/device_measure_serve.sh [COST_TABLE]
set -u
source bench/device_setup.sh
mkdir -p "$OUT"
python3 -c "import fastapi, uvicorn, httpx" || exit 1
LEVELS=${LEVELS:-1,16,64,256}
COST_TABLE=${1:-$OUT/cost_table_h200.json}
[ -f "$COST_TABLE" ] || python3 -m dspark.cli profile --out "$COST_TABLE" 2>&1 | grep -v "^INFO"
POLICY="{\"method\": \"dspark\", \"cost_table\": \"$COST_TABLE\"}"
COMMON=(--prompts-dir "${PROMPTS_DIR:-.data}" --output-len 256)

OFFLINE=${OFFLINE:-$OUT}  # a folder that already holds this session's offline runs skips them
[ -f "$OFFLINE/serve_offline_plain.json" ] || python3 -m dspark.cli bench "${COMMON[@]}" \
  --concurrency "$LEVELS" --no-plot --out "$OFFLINE/serve_offline_plain.json" \
  > "$OFFLINE/serve_offline_plain.txt" 2>&1
[ -f "$OFFLINE/serve_offline_policy.json" ] || python3 -m dspark.cli bench "${COMMON[@]}" \
  --concurrency "$LEVELS" --no-plot --speculative-config "$POLICY" \
  --out "$OFFLINE/serve_offline_policy.json" > "$OFFLINE/serve_offline_policy.txt" 2>&1

serve_arm() {  # NAME PORT [serve args...]: start a server, load it at every level, stop it
  local name=$1 port=$2
  shift 2
  python3 -m dspark.cli serve --port "$port" --max-num-seqs 256 --disable-access-log "$@" \
    > "$OUT/serve_${name}_server.txt" 2>&1 &
  local pid=$!
  wait_healthy "$port" "$pid" 240 || { tail -3 "$OUT/serve_${name}_server.txt"; return 1; }
  for c in ${LEVELS//,/ }; do
    n=$((4 * c)); [ "$n" -lt 8 ] && n=8
    python3 -m dspark.cli bench serve --base-url "http://127.0.0.1:$port" "${COMMON[@]}" \
      --concurrency "$c" --num-prompts "$n" --no-plot --out "$OUT/serve_${name}_c$c.json" \
      >> "$OUT/serve_${name}.txt" 2>&1
  done
  kill -TERM "$pid"
  wait "$pid"
}
serve_arm plain 8100
serve_arm policy 8101 --speculative-config "$POLICY"

python3 - "$OUT" "$LEVELS" "$OFFLINE" <<'PY'
import json, sys
out, levels, offline_dir = sys.argv[1], [int(c) for c in sys.argv[2].split(",")], sys.argv[3]
def offline(name):
    levels = json.load(open(f"{offline_dir}/serve_offline_{name}.json"))["dspark"]["levels"]
    return {lv["concurrency"]: lv["output_tokens_per_s"] for lv in levels}
def served(name, c):
    return json.load(open(f"{out}/serve_{name}_c{c}.json"))["levels"][0]["summary"]["output_tokens_per_s"]
print(f"{'C':>5} {'arm':>7} {'offline':>9} {'served':>9} {'served/offline':>15}")
for name in ("plain", "policy"):
    off = offline(name)
    for c in levels:
        s = served(name, c)
        print(f"{c:>5} {name:>7} {off[c]:>9.0f} {s:>9.0f} {s / off[c]:>15.2f}")
PY
