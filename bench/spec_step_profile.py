"""Step time of fixed-K speculation on the GPU, split into drafting and verifying.

    python bench/spec_step_profile.py --model M --drafter D --k 1,3,5,7 --batch 1,16,64,256 \
        --out spec_step_profile.json

For each K and batch size G: G greedy requests (prompt 128 tokens, ignore_eos) are decoded to a
steady state with speculation at fixed K, then measured on the live buffers of a steady step:
  step_us     engine.step() wall time (median), host work included: what a user's step costs
  graph_us    replay of the captured speculative step (draft + target + context + verify)
  draft_us    the drafting part alone (block forward, Markov loop, draft scatter), captured
  target_us   the target forward over G * (K + 1) tokens with the tap layers, captured
  rest_us     graph_us - draft_us - target_us: context append + rejection sampling
and, with speculation off, the plain decode step (decode_step_us, decode_graph_us), and the
plain step of the speculative engine with drafting off (spec_plain_step_us, spec_plain_graph_us:
the decode graph that also appends the drafter's context, what the drafting policy runs at high
load). With a
random drafter nothing is accepted: these are costs, and acceptance comes from a trained one.
break_even_tau = graph_us / decode_graph_us: the mean tokens per window (acceptance length)
at which the speculative step pays for itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dspark import LLM, SamplingParams
from dspark.benchmarks.profile import drain
from dspark.runner.spec_graphs import window_layout
from dspark.spec.spec_buffers import GREEDY


def _cuda_time_us(fn, reps: int = 20) -> float:
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


def _captured(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _steady(llm: LLM, batch: int, prompt_len: int, steps: int) -> float:
    """Start `batch` requests, decode until steady, return the median step wall time (us)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2048, ignore_eos=True)
    for i in range(batch):
        prompt = [100 + (i + j) % 1000 for j in range(prompt_len)]
        engine.add_request(f"b{batch}-{i}", prompt, params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):
        engine.step()
    # no synchronisation inside the loop: under async scheduling a step call returns once the
    # previous step is read back, so the time between calls is the steady-state step period
    stamps = [time.perf_counter()]
    for _ in range(steps):
        engine.step()
        stamps.append(time.perf_counter())
    return statistics.median((b - a) * 1e6 for a, b in zip(stamps, stamps[1:], strict=False))


def _breakdown(runner, g: int) -> tuple[float, float, float]:
    """Whole captured step, drafting alone, target forward alone (us), on the live buffers."""
    spec, b = runner.spec, runner.buffers
    graph_us = _cuda_time_us(lambda: runner.spec_runner.graphs.replay(g, GREEDY))
    st = spec.buffers.sampling(g, GREEDY)
    draft = _captured(lambda: spec.draft(g, st, b.input_ids, b.block_table[:g]))
    layout = window_layout(g, spec.num_verify + 1)
    target = _captured(lambda: runner._run_model(layout, spec.taps))
    return graph_us, _cuda_time_us(draft.replay), _cuda_time_us(target.replay)


@torch.inference_mode()
def profile_spec(llm: LLM, batches: list[int], prompt_len: int, steps: int) -> list[dict]:
    runner = llm.engine.runner
    K = runner.spec.num_verify
    rows = []
    for g in batches:
        step_us = _steady(llm, g, prompt_len, steps)
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
    runner = llm.engine.runner
    rows = []
    for g in batches:
        step_us = _steady(llm, g, prompt_len, steps)
        graph_us = _cuda_time_us(lambda g=g: runner.stager.graphs.replay(g))
        rows.append({"batch": g, "decode_step_us": step_us, "decode_graph_us": graph_us})
        drain(llm)
        print(f"decode G={g}: step {step_us:.0f} us, graph {graph_us:.0f} us")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--k", default="1,3,5,7")
    parser.add_argument("--batch", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="spec_step_profile.json")
    args = parser.parse_args()
    batches = [int(x) for x in args.batch.split(",")]
    common = dict(dtype="bfloat16", device="cuda", max_num_seqs=max(batches),
                  max_model_len=4096, kv_cache_memory_gb=8.0,
                  max_num_batched_tokens=max(2048, 8 * max(batches)))  # fmt: skip
    plain = LLM(args.model, **common)
    decode = {r["batch"]: r for r in profile_decode(plain, batches, args.prompt_len, args.steps)}
    del plain
    torch.cuda.empty_cache()
    results = []
    for k in [int(x) for x in args.k.split(",")]:
        spec_cfg = {"method": "dspark", "model": args.drafter, "num_speculative_tokens": k}
        llm = LLM(args.model, speculative_config=spec_cfg, **common)
        llm.engine.scheduler.drafting = False  # (no cost table: nothing turns it back on)
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


if __name__ == "__main__":
    main()
