"""Where a steady fixed-K speculative step's period goes: GPU busy vs idle, and the host's work.

    python bench/spec_step_trace.py --model M --drafter D --batch 1,16 --out-dir DIR

For each batch size G: G greedy requests (prompt 128 tokens, ignore_eos) reach steady drafting
steps (launched ahead), then
  period_us      engine.step() period, median of --steps (host work included)
  gpu_busy_us    kernels + copies per step (torch.profiler, CUDA activity), and their count
  gpu_idle_us    period - busy: the GPU waiting for the host
  host_top       the host's own time per step by function (cProfile over --steps, top 20)
and a Chrome trace of 5 steps (DIR/trace_G.json, CPU and CUDA) to read the gaps from.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from dspark import LLM, SamplingParams


def _steady(
    llm: LLM, batch: int, prompt_len: int = 128, temperature: float = 0.0, prefix: str = "t"
) -> None:
    engine = llm.engine
    room = engine.config.max_model_len - prompt_len  # (3,000 tokens where the model allows)
    # final_only, as `dspark bench` and LLM.generate ask: a cumulative output a step for every
    # request (the text and the token list so far) was most of a step's host work at 256
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=min(3000, room),
                            ignore_eos=True, output_kind="final_only")  # fmt: skip
    for i in range(batch):
        prompt = [100 + (i + j) % 1000 for j in range(prompt_len)]
        engine.add_request(f"{prefix}{i}", prompt, params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(10):
        engine.step()


def _period_us(llm: LLM, steps: int) -> float:
    stamps = [time.perf_counter()]
    for _ in range(steps):
        llm.engine.step()
        stamps.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False)) * 1e6


def _gpu_busy(llm: LLM, steps: int, trace: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.engine.step()
        torch.cuda.synchronize()
    busy, count, memcpy = 0.0, 0, 0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            busy += evt.device_time_total
            count += 1
            memcpy += "Memcpy" in evt.name
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as short:
        for _ in range(5):
            llm.engine.step()
        torch.cuda.synchronize()
    short.export_chrome_trace(str(trace))
    return {"gpu_busy_us": busy / steps, "gpu_ops_per_step": count / steps,
            "memcpy_per_step": memcpy / steps}  # fmt: skip


def _host_top(llm: LLM, steps: int, top: int = 20) -> list[dict]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        llm.engine.step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line}:{name}", "calls_per_step": nc / steps,
             "own_us_per_step": tt / steps * 1e6, "cum_us_per_step": ct / steps * 1e6}
            for (f, line, name), (_, nc, tt, ct, _) in rows]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for g in (int(x) for x in args.batch.split(",")):
        llm = LLM(args.model, max_num_seqs=max(g, 8),
                  speculative_config={"model": args.drafter, "scheduling": False})  # fmt: skip
        _steady(llm, g)
        row = {"batch": g, "period_us": _period_us(llm, args.steps)}
        row.update(_gpu_busy(llm, args.steps, args.out_dir / f"trace_{g}.json"))
        row["gpu_idle_us"] = row["period_us"] - row["gpu_busy_us"]
        row["host_top"] = _host_top(llm, args.steps)
        row["runner_stats"] = dict(llm.engine.runner.stats)
        rows.append(row)
        print(f"G={g}: period {row['period_us']:.0f} us, GPU busy {row['gpu_busy_us']:.0f} us "
              f"({row['gpu_ops_per_step']:.0f} ops, {row['memcpy_per_step']:.0f} copies), "
              f"idle {row['gpu_idle_us']:.0f} us")  # fmt: skip
        for h in row["host_top"][:12]:
            print(f"    {h['own_us_per_step']:8.1f} us own {h['cum_us_per_step']:8.1f} cum "
                  f"x{h['calls_per_step']:.1f}  {h['function']}")  # fmt: skip
        del llm
        torch.cuda.empty_cache()
    (args.out_dir / "spec_step_trace.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
