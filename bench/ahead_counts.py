"""How a speculative engine's drafting steps launch ahead, counted on the CPU (no GPU needed).

    python bench/ahead_counts.py [--requests 4] [--max-tokens 64] [--concurrency 1] [--mixed-ahead]

Runs the default model and its drafter greedily (fixed K = 7, fp32 on the CPU) with windows
laid out K + 1 wide, as CUDA graphs lay them out, so drafting steps launch behind the step in
flight as on the GPU. Prints get_metrics()'s `async_spec_steps` (steps launched ahead, the
reasons the others were not, windows deferred and windows shortened on the device) and the
step counts. The counts do not depend on the device; what a synchronous step costs does, and
only the GPU measures that. --mixed-ahead lays admissions out as the GPU's captured mixed steps
do (a tail of at most 4 rows and 256 tokens after the windows) and turns speculative_config's
"mixed_steps_ahead" on.
"""

from __future__ import annotations

import argparse
import json
import time

from dspark import LLM, SamplingParams
from dspark.runner.mixed_layout import max_tail_rows

PROMPTS = [
    "What is 17 times 23?",
    "Write a haiku about rain.",
    "Name three prime numbers.",
    "Explain gravity briefly.",
    "List the planets of the solar system.",
    "How do bees make honey?",
    "Translate 'good morning' into French.",
    "What is the capital of Australia?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--mixed-ahead", action="store_true")
    args = ap.parse_args()
    spec = {"method": "dspark", "scheduling": False, "mixed_steps_ahead": args.mixed_ahead}
    llm = LLM(dtype="float32", device="cpu", max_num_seqs=args.concurrency,
              speculative_config=spec)  # fmt: skip
    spec_runner = llm.engine.runner.spec_runner
    spec_runner.uniform_windows = True  # (what graphs turn on)
    if args.mixed_ahead:  # (what captured mixed steps set)
        spec_runner.max_tail_tokens = 256
        llm.engine.scheduler.mixed_limits = (max_tail_rows(256), 256)
    prompts = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
               for i in range(args.requests)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.chat(prompts, params, use_tqdm=False)
    m = llm.get_metrics()
    print(f"{args.requests} requests x {args.max_tokens} tokens, {args.concurrency} in flight, "
          f"{time.perf_counter() - start:.0f} s on the CPU, acceptance length "
          f"{m['mean_acceptance_length']:.2f}")  # fmt: skip
    print("async_spec_steps", json.dumps(m["async_spec_steps"]))
    print("steps", json.dumps({k: v for k, v in m["steps"].items() if v}))


if __name__ == "__main__":
    main()
