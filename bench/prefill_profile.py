"""What a prefill costs: wall time against GPU-busy time, per step token budget.

    python bench/prefill_profile.py --model /tmp/rs --budgets 2048,8192 --requests 64

Prefill steps run eagerly (CUDA graphs cover decode steps only), so a step's host work is one
Python dispatch per op per layer however many tokens it carries. For each budget
(max_num_batched_tokens) one engine prefills `--requests` prompts of `--prompt-len` tokens,
each asking for one token, `--repeats` times after a warm-up round: the wall time from adding
them to the last one finishing (the time to first token of the whole batch), the engine steps
it took, and in one profiled round the GPU-busy time and kernel count. Reports medians.
--cprofile N prints the N host functions with the most own time over one more round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dspark import LLM, SamplingParams


def _prefill_round(llm: LLM, tag: str, requests: int, prompt_len: int) -> tuple[float, int]:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(requests):
        prompt = [100 + (7 * i + j) % 5000 for j in range(prompt_len)]
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    return time.perf_counter() - start, steps


def _gpu_busy_us(llm: LLM, requests: int, prompt_len: int) -> tuple[float, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _prefill_round(llm, "prof", requests, prompt_len)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time_total for e in kernels), len(kernels)


def _print_host_profile(llm: LLM, requests: int, prompt_len: int, top: int) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(_prefill_round, llm, "cprof", requests, prompt_len)
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--budgets", default="2048,8192")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="prefill_profile.json")
    parser.add_argument("--cprofile", type=int, default=0)
    args = parser.parse_args()
    rows = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        llm = LLM(args.model, dtype="bfloat16", device="cuda", max_num_seqs=args.requests,
                  max_num_batched_tokens=budget, max_model_len=4096,
                  kv_cache_memory_gb=4.0)  # fmt: skip
        _prefill_round(llm, "warm", args.requests, args.prompt_len)
        runs = [
            _prefill_round(llm, f"r{r}", args.requests, args.prompt_len)
            for r in range(args.repeats)
        ]
        busy_us, kernels = _gpu_busy_us(llm, args.requests, args.prompt_len)
        if args.cprofile:
            _print_host_profile(llm, args.requests, args.prompt_len, args.cprofile)
        wall_s = statistics.median(w for w, _ in runs)
        rows.append({
            "budget": budget, "requests": args.requests, "prompt_len": args.prompt_len,
            "wall_ms": wall_s * 1e3, "steps": runs[0][1], "gpu_busy_ms": busy_us / 1e3,
            "kernels": kernels,
            "prefill_tokens_per_s": args.requests * args.prompt_len / wall_s,
        })  # fmt: skip
        del llm
        torch.cuda.empty_cache()
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
              "model": args.model, "rows": rows}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'budget':>7} {'steps':>5} {'wall ms':>8} {'GPU busy ms':>11} {'kernels':>7} "
          f"{'prefill tok/s':>13}")  # fmt: skip
    for r in rows:
        print(f"{r['budget']:7d} {r['steps']:5d} {r['wall_ms']:8.2f} {r['gpu_busy_ms']:11.2f} "
              f"{r['kernels']:7d} {r['prefill_tokens_per_s']:13.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
