"""How often a step of windows holds a window shortened near max_tokens (which, before commit
dee3b56, sent the whole step to the eager path instead of the captured speculative graph).

    python bench/count_short_windows.py --prompts-dir DATA --batch 16 --tokens 256

Runs the default model with its shipped drafter (greedy, ignore_eos) on the benchmark's
held-out-style real prompts and counts, over the steps whose rows are all windows, those where
some window verifies fewer than K drafts. Counting needs no GPU (the CPU gives the same steps).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dspark import LLM, SamplingParams
from dspark.benchmarks.prompts import interleave, load_source_texts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts-dir", required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    llm = LLM(speculative_config={"method": "dspark"}, device=args.device,
              max_num_seqs=args.batch)  # fmt: skip
    engine, K = llm.engine, llm.engine.spec.num_verify
    counts = {"steps": 0, "all_windows": 0, "with_short_window": 0}
    schedule = engine.scheduler.schedule

    def counting_schedule():
        plan = schedule()
        counts["steps"] += 1
        if plan.rows and all(r.num_draft for r in plan.rows):
            counts["all_windows"] += 1
            counts["with_short_window"] += any(r.num_draft < K for r in plan.rows)
        return plan

    engine.scheduler.schedule = counting_schedule
    prompts = interleave(load_source_texts(Path(args.prompts_dir)))[: args.batch]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    share = counts["with_short_window"] / max(1, counts["all_windows"])
    print(f"{counts}: {share:.0%} of all-window steps have a short window "
          f"(acceptance length {llm.get_metrics()['mean_acceptance_length']:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
