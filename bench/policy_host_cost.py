"""Host cost of the drafting policy per engine step (the scheduling overhead issue 6 bounds).

    python bench/policy_host_cost.py --batch 1,16,64,256 --out policy_host_cost.json

With the shipped drafter's H200 cost table and calibration, R running requests whose last
blocks were observed: times decide() (before every step: the O(R) survival sum and the cell
choice) and observe() (after a drafting step: survivals from [R, K] raw confidences and the
recalibration), and a step trace's line after a decision (DSPARK_POLICY_TRACE), medians over
--steps calls in microseconds. The list of running ids is built
per call, as the engine builds it. The policy does no device work: the confidences it reads
come back with the drafting step's one sync. Its share of a step is these figures over the
step times of docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dspark.policy.cost_table import COST_TABLES_DIR, parse_table
from dspark.policy.policy import DraftingPolicy
from dspark.policy.trace import PolicyTrace
from dspark.spec.calibration import load_calibration

DRAFTER = Path(__file__).resolve().parents[1] / "dspark/drafters/smollm2_135m_instruct"


def _median_us(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(times)


class _Request:  # the engine passes [req.request_id for req in scheduler.running]
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


def _measure(r: int, table, temperatures: dict, steps: int, greedy_rows: str = "half") -> dict:
    # as the engine builds it with drafting steps launched ahead (engine/spec_setup.py
    # build_policy): a probe of two steps, each decision a block behind its evidence
    policy = DraftingPolicy(table, temperatures, draft_len=7, probe_steps=2, decision_lag=2)
    ids = [f"req-{i}" for i in range(r)]
    logits = torch.randn(r, 7)
    greedy = [{"all": True, "half": i % 2 == 0, "none": False}[greedy_rows] for i in range(r)]
    accepted, verify_len = [2] * r, [7] * r
    policy.observe(ids, logits, greedy, accepted, verify_len)
    running = [_Request(i) for i in ids]
    decide = _median_us(lambda: policy.decide([q.request_id for q in running]), steps)
    observe = _median_us(lambda: policy.observe(ids, logits, greedy, accepted, verify_len), steps)
    # a step trace's line after the decision (DSPARK_POLICY_TRACE, policy/trace.py)
    with tempfile.TemporaryDirectory() as directory:
        trace = PolicyTrace(policy, Path(directory) / "trace.jsonl")
        scheduler = SimpleNamespace(running=[SimpleNamespace(num_computed_tokens=300,
                                                             num_prompt_tokens=100)] * r,
                                    waiting=[], max_num_seqs=max(r, 1))  # fmt: skip
        stats = {f"counter_{i}": i for i in range(40)}  # (about a runner's stats)
        decision = policy.decide(ids)
        line = _median_us(lambda: trace.decided(decision, ids, scheduler, stats, None, 0.0), steps)
        trace.close()
    return {"batch": r, "decide_us": decide, "observe_us": observe, "trace_line_us": line}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", default="1,16,64,256")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default="policy_host_cost.json")
    parser.add_argument("--greedy", choices=("all", "half", "none"), default="half",
                        help="which rows are greedy (the rest sample)")  # fmt: skip
    args = parser.parse_args()
    table_path = next(iter(sorted((DRAFTER / COST_TABLES_DIR).glob("*.json"))))
    table = parse_table(table_path.read_text())
    temperatures = {g: torch.tensor(load_calibration(DRAFTER, 7, greedy=g)) for g in (False, True)}
    rows = [_measure(r, table, temperatures, args.steps, args.greedy)
            for r in map(int, args.batch.split(","))]  # fmt: skip
    result = {"date": time.strftime("%Y-%m-%d"), "table": table_path.name,
              "greedy": args.greedy, "rows": rows}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'batch':>5} {'decide us':>10} {'observe us':>11} {'trace line us':>14}")
    for row in rows:
        print(f"{row['batch']:5d} {row['decide_us']:10.1f} {row['observe_us']:11.1f} "
              f"{row['trace_line_us']:14.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
