"""Where a speculative engine step's host time goes: cProfile over a real-prompt batch.

    python bench/spec_host_profile.py --drafter DIR --batch 16 --prompts-dir DIR

Runs the batch once to warm up, then again under cProfile, and prints the runner's counters
and the top functions by own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

from dspark import LLM, SamplingParams
from dspark.benchmarks.prompts import interleave, load_source_texts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--drafter", default=None, help="none: plain decoding")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompts-dir", default=None)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    spec = {"method": "dspark", "model": args.drafter} if args.drafter else None
    llm = LLM(args.model, dtype="bfloat16", speculative_config=spec)
    prompts = interleave(load_source_texts(Path(args.prompts_dir)))[: args.batch]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    plain_wall = time.perf_counter() - t0
    print(f"batch {args.batch} without the profiler: {plain_wall:.3f} s, "
          f"{args.batch * args.tokens / plain_wall:.0f} tok/s")  # fmt: skip
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t0
    print(f"batch {args.batch}: {wall:.3f} s, {args.batch * args.tokens / wall:.0f} tok/s")
    print("runner stats:", dict(llm.engine.runner.stats))
    print("metrics:", llm.get_metrics())
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
