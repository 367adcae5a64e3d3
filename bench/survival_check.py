"""Predicted vs realised survival of the default drafter on held-out prompts (any device).

    python bench/survival_check.py --prompts 8 --tokens 96 --device cpu

Greedy decoding with the shipped drafter (full blocks, K = 7); prints per drafted position the
mean calibrated survival the engine predicted (greedy STS section for greedy requests) next to
the fraction of blocks whose drafts 1..k were all accepted, and their sums (expected vs
realised accepted drafts per block).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dspark import LLM, SamplingParams
from dspark.benchmarks.prompts import SOURCES, default_prompts_dir, load_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompts-dir", type=Path, default=None)
    args = parser.parse_args()
    conversations = load_prompts(args.prompts_dir or default_prompts_dir(), SOURCES, 0, "eval")
    dtype = "float32" if args.device == "cpu" else "auto"
    llm = LLM("default", dtype=dtype, device=args.device, max_model_len=1024,
              speculative_config={"method": "dspark"})  # fmt: skip
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.apply_chat_template(c)[-512:]}
               for c in conversations[: args.prompts]]  # fmt: skip
    params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    m = llm.get_metrics()
    n = m["num_survival_windows"]
    predicted = [p / n for p in m["predicted_survival_per_pos"]]
    realised = [r / n for r in m["realised_survival_per_pos"]]
    print(f"{n} full blocks, acceptance length {m['mean_acceptance_length']:.2f}, "
          f"{time.perf_counter() - start:.0f} s")  # fmt: skip
    print("position " + " ".join(f"{k + 1:>6}" for k in range(len(predicted))) + "    sum")
    print("predicted" + " ".join(f"{p:>6.3f}" for p in predicted) + f" {sum(predicted):>6.3f}")
    print("realised " + " ".join(f"{r:>6.3f}" for r in realised) + f" {sum(realised):>6.3f}")


if __name__ == "__main__":
    main()
