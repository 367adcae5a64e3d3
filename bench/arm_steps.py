"""Print each arm's steps by path, eager fallbacks, the drafting policy's decisions and its
realised / table cost ratios per level from a `dspark bench` JSON, and per repeat its
throughput with the GPU's SM clock and temperature before and after it (where the bench could
read them: dspark/benchmarks/gpu_state.py), and the cyclic collector's pauses in it.

python bench/arm_steps.py bench/results/.../bench_arms_waves.json
"""

import json
import sys


def clocks(state):
    """ "1980 MHz 41 C" for one reading, "-" where there was none."""
    if not state:
        return "-"
    return f"{state.get('sm_clock_mhz')} MHz {state.get('temperature_c')} C"


def gc_pauses(gc_ms):
    """ ", gc gen0 9.7 / gen2 254.4 ms": the collector's pauses in a repeat, where recorded."""
    if gc_ms is None:
        return ""
    each = " / ".join(f"gen{g} {ms:.1f}" for g, ms in gc_ms.items())
    return f", gc {each} ms" if each else ", gc none"


for path in sys.argv[1:]:
    d = json.load(open(path))
    for arm, x in d["arms"].items():
        for level in x["levels"]:
            s = level.get("speculation") or {}
            c, tps = level["concurrency"], level["output_tokens_per_s"]
            print(f"{arm:>12} C={c:<4} {tps:>9.0f} tok/s"
                  f"  tau {s.get('mean_acceptance_length') or 0:.2f}  steps {s.get('steps', {})}"
                  f"  fallbacks {s.get('fallbacks', {})}")  # fmt: skip
            if s.get("async_spec_steps"):
                print(f"{'':>12} async spec steps {s['async_spec_steps']}")
            if s.get("drafting_policy"):
                print(f"{'':>12} drafting policy {s['drafting_policy']}")
            if s.get("realised_cost_ratios"):
                print(f"{'':>12} realised / table {s['realised_cost_ratios']}")
            states = level.get("gpu_state_runs") or []
            pauses = level.get("gc_ms_runs") or [None] * len(states)  # (older files: none)
            runs = level["output_tokens_per_s_runs"]
            for i, (run, state, gc_ms) in enumerate(zip(runs, states, pauses, strict=False)):
                if state and (state.get("before") or state.get("after")):
                    print(
                        f"{'':>12} repeat {i}: {run:>9.0f} tok/s, GPU "
                        f"{clocks(state.get('before'))} -> {clocks(state.get('after'))}"
                        f"{gc_pauses(gc_ms)}"
                    )
