"""One engine step on the GPU, taken apart: a plain decode step, or a fixed-K speculative one.

    python bench/step_profile.py plain --model M --batch 1,64 --out step_profile.json
    python bench/step_profile.py spec --model M --drafter D --k 1,3,5,7 --batch 1,16,64,256 \\
        --out spec_step_profile.json

Either way `batch` greedy requests (prompt --prompt-len tokens, ignore_eos) are decoded to a
steady state, then measured.

plain  For each batch size: time --steps engine steps (median period) and profile as many with
       torch.profiler. Reports kernels per step, GPU-busy time per step, the gap (step wall
       minus busy), the top kernels, and the floors: weight + KV bytes over the measured copy
       bandwidth and FLOPs over the measured bf16 matmul rate.
spec   For each K and batch size G, speculation at fixed K, measured on the live buffers of a
       steady step:
         step_us     engine.step() wall time (median), host work included: a user's step cost
         graph_us    replay of the captured speculative step (draft + target + context + verify)
         draft_us    the drafting part alone (block forward, Markov loop, draft scatter)
         target_us   the target forward over G * (K + 1) tokens with the tap layers, captured
         rest_us     graph_us - draft_us - target_us: context append + rejection sampling
       and, with speculation off, the plain decode step (decode_step_us, decode_graph_us), and
       the plain step of the speculative engine with drafting off (spec_plain_step_us,
       spec_plain_graph_us: the decode graph that also appends the drafter's context, what the
       drafting policy runs at high load). With a random drafter nothing is accepted: these are
       costs, and acceptance comes from a trained one. break_even_tau = graph_us /
       decode_graph_us: the mean tokens per window (acceptance length) at which the speculative
       step pays for itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import defaultdict

import torch

from dspark import LLM, SamplingParams


def cuda_time_us(fn, reps: int = 20) -> float:
    """fn's median GPU time in us over `reps` calls, after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def steady(llm: LLM, batch: int, prompt_len: int, max_tokens: int, settle: int) -> None:
    """Start `batch` requests, prefill them and take `settle` more steps."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [100 + (i + j) % 1000 for j in range(prompt_len)]
        engine.add_request(f"b{batch}-{i}", prompt, params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(settle):
        engine.step()


def step_periods_us(llm: LLM, steps: int) -> list[float]:
    # No synchronisation inside the loop: a step call returns once the previous (async
    # scheduling) or its own (sync) step is read back, so the time between calls is the
    # steady-state step period, host work included.
    stamps = [time.perf_counter()]
    for _ in range(steps):
        llm.engine.step()
        stamps.append(time.perf_counter())
    return [(b - a) * 1e6 for a, b in zip(stamps, stamps[1:], strict=False)]


# ---- plain ---------------------------------------------------------------------------------


def measure_ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (read + write) and a large bf16 matmul rate."""
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    copy_s = cuda_time_us(lambda: y.copy_(x), reps=10) / 1e6
    mm_s = cuda_time_us(lambda: a @ b, reps=10) / 1e6
    return {"copy_bytes_per_s": 2 * x.numel() / copy_s, "bf16_flops_per_s": 2 * 8192**3 / mm_s}


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
    # the bytes a decode step reads: not the input embedding's table, of which it gathers a
    # row a token, unless the LM head reads it (tied)
    embedding = model.embed_tokens.weight
    untied = model.lm_head.weight.data_ptr() != embedding.data_ptr()
    weight_bytes = (params - (embedding.numel() if untied else 0)) * 2
    cfg = model.config
    kv_bytes = batch * context * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    flops = 2 * params * batch + 4 * batch * context * cfg.num_layers * cfg.num_heads * cfg.head_dim
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "memory_floor_us": (weight_bytes + kv_bytes) / ceilings["copy_bytes_per_s"] * 1e6,
        "compute_floor_us": flops / ceilings["bf16_flops_per_s"] * 1e6,
    }


def plain(args: argparse.Namespace) -> None:
    ceilings = measure_ceilings()
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
               "model": args.model,
               "ceilings": ceilings, "batches": []}  # fmt: skip
    for batch in [int(b) for b in args.batch.split(",")]:
        llm = LLM(args.model, dtype="bfloat16", device="cuda", max_num_seqs=max(batch, 1),
                  max_model_len=4096, kv_cache_memory_gb=8.0)  # fmt: skip
        steady(llm, batch, args.prompt_len, max_tokens=4096 - args.prompt_len - 8, settle=5)
        step_s = statistics.median(step_periods_us(llm, args.steps)) / 1e6
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
        gc.collect()  # (the engine's graphs hold its memory until collected)
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


# ---- spec ----------------------------------------------------------------------------------


def _captured(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _steady_step_us(llm: LLM, batch: int, prompt_len: int, steps: int) -> float:
    """Start `batch` requests, decode until steady, return the median step period (us)."""
    steady(llm, batch, prompt_len, max_tokens=2048, settle=3)
    return statistics.median(step_periods_us(llm, steps))


def _breakdown(runner, g: int) -> tuple[float, float, float]:
    """Whole captured step, drafting alone, target forward alone (us), on the live buffers."""
    from dspark.runner.spec_graphs import window_layout
    from dspark.spec.spec_buffers import GREEDY

    spec, b = runner.spec, runner.buffers
    graph_us = cuda_time_us(lambda: runner.spec_runner.graphs.replay(g, GREEDY))
    st = spec.buffers.sampling(g, GREEDY)
    draft = _captured(lambda: spec.draft(g, st, b.input_ids, b.block_table[:g]))
    layout = window_layout(g, spec.num_verify + 1)
    target = _captured(lambda: runner._run_model(layout, spec.taps))
    return graph_us, cuda_time_us(draft.replay), cuda_time_us(target.replay)


@torch.inference_mode()
def profile_spec(llm: LLM, batches: list[int], prompt_len: int, steps: int) -> list[dict]:
    from dspark.benchmarks.profile import drain

    runner = llm.engine.runner
    K = runner.spec.num_verify
    rows = []
    for g in batches:
        step_us = _steady_step_us(llm, g, prompt_len, steps)
        stats = dict(runner.stats)
        graph_us, draft_us, target_us = _breakdown(runner, g)
        rows.append({
            "k": K, "batch": g, "step_us": step_us, "graph_us": graph_us, "draft_us": draft_us,
            "target_us": target_us, "rest_us": graph_us - draft_us - target_us,
            "runner_stats": stats,
        })  # fmt: skip
        drain(llm)
        print(
            f"K={K} G={g}: step {step_us:.0f} us, graph {graph_us:.0f} = draft {draft_us:.0f}"
            f" + target {target_us:.0f} + rest {graph_us - draft_us - target_us:.0f}"
        )
    return rows


@torch.inference_mode()
def profile_decode(llm: LLM, batches: list[int], prompt_len: int, steps: int) -> list[dict]:
    from dspark.benchmarks.profile import drain

    runner = llm.engine.runner
    rows = []
    for g in batches:
        step_us = _steady_step_us(llm, g, prompt_len, steps)
        graph_us = cuda_time_us(lambda g=g: runner.stager.graphs.replay(g))
        rows.append({"batch": g, "decode_step_us": step_us, "decode_graph_us": graph_us})
        drain(llm)
        print(f"decode G={g}: step {step_us:.0f} us, graph {graph_us:.0f} us")
    return rows


def spec(args: argparse.Namespace) -> None:
    batches = [int(x) for x in args.batch.split(",")]
    common = dict(dtype="bfloat16", device="cuda", max_num_seqs=max(batches),
                  max_model_len=4096, kv_cache_memory_gb=8.0,
                  max_num_batched_tokens=max(2048, 8 * max(batches)))  # fmt: skip
    plain_llm = LLM(args.model, **common)
    decode = {r["batch"]: r for r in profile_decode(plain_llm, batches, args.prompt_len,
                                                    args.steps)}  # fmt: skip
    del plain_llm
    gc.collect()
    torch.cuda.empty_cache()
    results = []
    for k in [int(x) for x in args.k.split(",")]:
        spec_cfg = {
            "method": "dspark",
            "model": args.drafter,
            "num_speculative_tokens": k,
            "scheduling": False,
        }  # (fixed K: no policy turns drafting back on)
        llm = LLM(args.model, speculative_config=spec_cfg, **common)
        llm.engine.scheduler.drafting = False
        spec_plain = {}
        for r in profile_decode(llm, batches, args.prompt_len, args.steps):
            spec_plain[r["batch"]] = {"spec_plain_step_us": r["decode_step_us"],
                                      "spec_plain_graph_us": r["decode_graph_us"]}  # fmt: skip
        llm.engine.scheduler.drafting = True
        for row in profile_spec(llm, batches, args.prompt_len, args.steps):
            row.update(decode[row["batch"]])
            row.update(spec_plain[row["batch"]])
            row["break_even_tau"] = row["graph_us"] / row["decode_graph_us"]
            results.append(row)
        del llm
        gc.collect()  # (the engine's graphs hold its memory until collected)
        torch.cuda.empty_cache()
        out = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
               "model": args.model, "drafter": args.drafter, "rows": results}  # fmt: skip
        with open(args.out, "w") as f:  # after every K: a run cut short keeps what it measured
            json.dump(out, f, indent=1)
    print(f"{'K':>2} {'G':>4} {'step':>7} {'graph':>7} {'draft':>7} {'target':>7} {'rest':>6} "
          f"{'decode':>7} {'tau*':>5} {'dec step':>8} {'off step':>8} "
          f"{'off graph':>9}")  # fmt: skip
    for r in results:
        print(f"{r['k']:>2} {r['batch']:>4} {r['step_us']:>7.0f} {r['graph_us']:>7.0f} "
              f"{r['draft_us']:>7.0f} {r['target_us']:>7.0f} {r['rest_us']:>6.0f} "
              f"{r['decode_graph_us']:>7.0f} {r['break_even_tau']:>5.2f} "
              f"{r['decode_step_us']:>8.0f} {r['spec_plain_step_us']:>8.0f} "
              f"{r['spec_plain_graph_us']:>9.0f}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("plain", help="a plain decode step: kernels, busy time, gap, floors")
    p.add_argument("--model", default="default")
    p.add_argument("--batch", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default="step_profile.json")
    p.set_defaults(func=plain)
    s = sub.add_parser("spec", help="a fixed-K speculative step: drafting, target, the rest")
    s.add_argument("--model", default="default")
    s.add_argument("--drafter", required=True)
    s.add_argument("--k", default="1,3,5,7")
    s.add_argument("--batch", default="1,16,64,256")
    s.add_argument("--prompt-len", type=int, default=128)
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--out", default="spec_step_profile.json")
    s.set_defaults(func=spec)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
