"""Per-step breakdown of decoding: kernels per step, time per kernel, gaps, and the floor.

    python bench/step_profile.py --batch 1,64 --out step_profile.json

For each batch size: start `batch` greedy requests, let them reach steady decoding, then time
`--steps` engine steps with CUDA events (median) and profile the same number with
torch.profiler. Reports kernels per step, GPU-busy time per step, the gap (step wall minus
busy), the top kernels, and the floors: weight + KV bytes over the measured copy bandwidth and
FLOPs over the measured bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from dspark import LLM, SamplingParams


def measure_ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (read + write) and a large bf16 matmul rate."""
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def timed(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    copy_s = timed(lambda: y.copy_(x))
    mm_s = timed(lambda: a @ b)
    return {"copy_bytes_per_s": 2 * x.numel() / copy_s, "bf16_flops_per_s": 2 * 8192**3 / mm_s}


def _decode_until_steady(llm: LLM, batch: int, prompt_len: int) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4096 - prompt_len - 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{i}", [100 + (i + j) % 1000 for j in range(prompt_len)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(5):
        engine.step()


def _timed_steps(llm: LLM, steps: int) -> list[float]:
    # No synchronisation inside the loop: a step call returns once the previous (async
    # scheduling) or its own (sync) step is read back, so the time between calls is the
    # steady-state step period, host work included.
    stamps = [time.perf_counter()]
    for _ in range(steps):
        llm.engine.step()
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def _profiled_steps(llm: LLM, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.engine.step()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(list)
    spans = []
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.name].append(evt.device_time_total)
            spans.append((evt.time_range.start, evt.time_range.end))
    kernels = sum(len(v) for v in per_kernel.values()) / steps
    top = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {
        "kernels_per_step": kernels,
        # With PDL a kernel starts before the one ahead ends, so kernel times overlap: busy is
        # the union of their spans, and the sum of their durations is reported beside it.
        "gpu_busy_us_per_step": _union_us(spans) / steps,
        "kernel_us_sum_per_step": sum(sum(v) for v in per_kernel.values()) / steps,
        "top_kernels": [
            {"name": n[:90], "calls_per_step": len(v) / steps, "us_per_step": sum(v) / steps}
            for n, v in top
        ],
    }


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) spans: [(0, 3), (2, 5), (7, 8)] -> 6."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _floors(llm: LLM, batch: int, context: int, ceilings: dict[str, float]) -> dict:
    model = llm.engine.model
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = params * 2
    cfg = model.config
    kv_bytes = batch * context * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    flops = 2 * params * batch + 4 * batch * context * cfg.num_layers * cfg.num_heads * cfg.head_dim
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "memory_floor_us": (weight_bytes + kv_bytes) / ceilings["copy_bytes_per_s"] * 1e6,
        "compute_floor_us": flops / ceilings["bf16_flops_per_s"] * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default="step_profile.json")
    args = parser.parse_args()
    ceilings = measure_ceilings()
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
               "model": args.model,
               "ceilings": ceilings, "batches": []}  # fmt: skip
    for batch in [int(b) for b in args.batch.split(",")]:
        llm = LLM(args.model, dtype="bfloat16", device="cuda", max_num_seqs=max(batch, 1),
                  max_model_len=4096, kv_cache_memory_gb=8.0)  # fmt: skip
        _decode_until_steady(llm, batch, args.prompt_len)
        step_s = statistics.median(_timed_steps(llm, args.steps))
        prof = _profiled_steps(llm, args.steps)
        context = args.prompt_len + 5 + args.steps
        floors = _floors(llm, batch, context, ceilings)
        row = {"batch": batch, "step_us": step_s * 1e6, "tokens_per_s": batch / step_s,
               "gap_us_per_step": step_s * 1e6 - prof["gpu_busy_us_per_step"],
               "runner_stats": dict(llm.engine.runner.stats), **prof, **floors}  # fmt: skip
        row["fraction_of_floor"] = (
            max(floors["memory_floor_us"], floors["compute_floor_us"]) / (row["step_us"])
        )
        results["batches"].append(row)
        del llm
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'batch':>5} {'step us':>9} {'tok/s':>9} {'kernels':>8} {'busy us':>9} {'gap us':>8} "
          f"{'floor us':>9} {'of floor':>8}")  # fmt: skip
    for r in results["batches"]:
        floor = max(r["memory_floor_us"], r["compute_floor_us"])
        print(
            f"{r['batch']:>5} {r['step_us']:>9.1f} {r['tokens_per_s']:>9.0f} "
            f"{r['kernels_per_step']:>8.0f} {r['gpu_busy_us_per_step']:>9.1f} "
            f"{r['gap_us_per_step']:>8.1f} {floor:>9.1f} {r['fraction_of_floor']:>8.1%}"
        )
    for r in results["batches"]:
        print(f"batch {r['batch']} top kernels (us/step):")
        for k in r["top_kernels"][:6]:
            print(f"   {k['us_per_step']:8.1f} x{k['calls_per_step']:5.0f}  {k['name'][:70]}")


if __name__ == "__main__":
    main()
