"""Print each arm's steps by path and eager fallbacks per level from a `dspark bench` JSON.

python bench/arm_steps.py bench/results/.../bench_arms_waves.json
"""

import json
import sys

for path in sys.argv[1:]:
    d = json.load(open(path))
    for arm, x in d["arms"].items():
        for level in x["levels"]:
            s = level.get("speculation") or {}
            c, tps = level["concurrency"], level["output_tokens_per_s"]
            print(f"{arm:>12} C={c:<4} {tps:>9.0f} tok/s"
                  f"  tau {s.get('mean_acceptance_length') or 0:.2f}  steps {s.get('steps', {})}"
                  f"  fallbacks {s.get('fallbacks', {})}")  # fmt: skip
