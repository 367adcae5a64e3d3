"""Where drafting's time goes on the GPU, kernel by kernel (the block is drafted in full every
drafting step, so its cost is what speculation must beat under load).

    python bench/draft_profile.py --model M --drafter D --batch 64,256 --out draft_profile.json

For each batch size G: G greedy requests (prompt 128 tokens, ignore_eos) reach steady drafting
steps; then on the live buffers: the captured drafting part alone (block forward, Markov loop,
confidences, draft scatter) timed by CUDA events (median of 50 replays), and the same part run
eagerly under torch.profiler, its CUDA kernels grouped by name (total us per draft, launches).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from bench.spec_step_profile import _captured, _cuda_time_us, _steady
from dspark import LLM
from dspark.spec.profile import drain
from dspark.spec.spec_buffers import GREEDY


@torch.inference_mode()
def profile_draft(llm: LLM, g: int, reps: int = 10) -> dict:
    runner = llm.engine.runner
    spec, b = runner.spec, runner.buffers
    _steady(llm, g, 128, 10)
    st = spec.buffers.sampling(g, GREEDY)

    def draft():
        spec.draft(g, st, b.input_ids, b.block_table[:g])

    graph_us = _cuda_time_us(_captured(draft).replay, reps=50)
    draft()
    torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            draft()
        torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name[:90]]
            k[0] += e.device_time / reps
            k[1] += 1 / reps
    drain(llm)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {
        "batch": g,
        "draft_graph_us": graph_us,
        "kernel_us": sum(v[0] for v in kernels.values()),
        "launches": sum(v[1] for v in kernels.values()),
        "kernels": [{"name": n, "us": v[0], "launches": v[1]} for n, v in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--batch", default="64,256")
    parser.add_argument("--out", default="draft_profile.json")
    args = parser.parse_args()
    batches = [int(x) for x in args.batch.split(",")]
    llm = LLM(args.model, max_num_seqs=max(batches),
              speculative_config={"method": "dspark", "model": args.drafter})  # fmt: skip
    rows = [profile_draft(llm, g) for g in batches]
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(f"G={r['batch']}: captured draft {r['draft_graph_us']:.0f} us; kernels "
              f"{r['kernel_us']:.0f} us in {r['launches']:.0f} launches")  # fmt: skip
        for k in r["kernels"][:12]:
            print(f"  {k['us']:8.1f} us  x{k['launches']:4.0f}  {k['name']}")


if __name__ == "__main__":
    main()
