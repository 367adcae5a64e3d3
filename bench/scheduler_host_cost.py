"""Host cost of the scheduler's per-step work at a large decode batch (CPU only, no model).

    python bench/scheduler_host_cost.py --batch 256 --steps 200

B requests decode one token per step: schedule(), advance() and update() are timed per step
with sampled tokens given directly (no forward, no runner), and their median and minimum are
printed in microseconds. At B = 256 these are part of the ~3 ms host step that limits plain
decoding on the H200 (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

from dspark.engine.kv_cache import PageAllocator
from dspark.engine.scheduler import Scheduler
from dspark.step_plan import SampledTokens
from dspark.request import Request
from dspark.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=100)
    args = parser.parse_args()
    b = args.batch
    scheduler = Scheduler(PageAllocator(64 * b), 16, b, 4096, 4096)
    params = SamplingParams(temperature=0, max_tokens=2048, ignore_eos=True)
    for i in range(b):
        scheduler.add(Request(str(i), [1] * args.prompt_len, params, seed=0, eos_token_id=None,
                              arrival_time=0.0))  # fmt: skip

    def sampled(plan):
        return [SampledTokens((5,)) if r.do_sample else None for r in plan.rows]

    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running) or (
        scheduler.waiting
    ):  # prefill everything first
        plan = scheduler.schedule()
        scheduler.advance(plan)
        scheduler.update(plan, sampled(plan))
    times = {"schedule": [], "advance": [], "update": []}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        scheduler.advance(plan)
        t2 = time.perf_counter()
        out = sampled(plan)
        t3 = time.perf_counter()
        scheduler.update(plan, out)
        t4 = time.perf_counter()
        times["schedule"].append(t1 - t0)
        times["advance"].append(t2 - t1)
        times["update"].append(t4 - t3)
    for name, ts in times.items():
        print(f"{name:>9}: median {statistics.median(ts) * 1e6:6.0f} us, "
              f"min {min(ts) * 1e6:6.0f} us at batch {b}")  # fmt: skip


if __name__ == "__main__":
    main()
