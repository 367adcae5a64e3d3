"""Fixed-K speculation when requests end together vs apart: 64 greedy requests of 256 tokens,
K = 7 with the shipped drafter, once with one prompt 64 times (every request ends at the same
step) and once with 64 different gsm8k prompts (they end at different steps). Prints tok/s and
the runner's counters: eager speculative steps (a plain row among windows) and steps that could
not be launched ahead.

    python bench/requests_ending_apart.py --prompts-dir <shared data> [--prompt "..."] \
        [--plain] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dspark import LLM, SamplingParams


def run(prompts: list[str], repeats: int = 2, speculation: bool = True) -> dict:
    spec = {"method": "dspark", "scheduling": False} if speculation else None
    llm = LLM("default", speculative_config=spec, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    rates = []
    for _ in range(repeats):  # the first warms up
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(len(prompts) * 256 / (time.perf_counter() - t0))
    m = llm.get_metrics()
    return {"tok_s": rates, "mean_acceptance_length": m.get("mean_acceptance_length"),
            "runner": dict(llm.engine.runner.stats)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts-dir", type=Path, required=True)
    parser.add_argument("--prompt", default="Tell me about the history of Rome.")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--plain", action="store_true", help="also plain decoding, same prompts")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(args.prompts_dir / "gsm8k_train.jsonl")]
    apart = [next(v for v in r.values() if isinstance(v, str)) for r in rows[: args.n]]
    results = {}
    for name, prompts in (("together", [args.prompt] * args.n), ("apart", apart)):
        results[name] = run(prompts)
        print(name, json.dumps(results[name]))
        if args.plain:
            results[f"{name}_plain"] = run(prompts, speculation=False)
            print(f"{name}_plain", json.dumps(results[f"{name}_plain"]))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
