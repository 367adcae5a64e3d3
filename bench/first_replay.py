"""Is a CUDA graph's first replay slower than its next ones? Times three replays of every graph
the engine captures, right after its capture, on the inputs it was captured with.

    python bench/first_replay.py --model /tmp/rs --drafter /tmp/rd [--max-num-seqs 256]

A graph's first launch uploads the executable graph to the device unless it was uploaded
before (cudaGraphUpload); the engine's live steps pay that at each graph's first use, in a
fresh server's first wave. Measured on an H100 (docs/PERFORMANCE.md, thirty-sixth look): about
0.4 ms a graph, 33 ms over a 256-seat engine's graphs, against ~0.45 s that a replay of each at
start-up would add; so the engine does not replay them there. Each replay is timed on the host,
from the launch to a synchronize (the upload and the GPU's work together).
Prints, per kind of graph (decode, sampled decode, speculative), the median of each replay's
time and of the first's excess over the third, then the summed excess: what a fresh engine's
first steps pay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import dspark.runner.cuda_graph as cuda_graph
import dspark.runner.sampled_decode_graphs as sampled_decode_graphs
import dspark.runner.spec_graphs as spec_graphs

TIMES: dict[str, list[list[float]]] = {"decode": [], "sampled decode": [], "speculative": []}


def timed_captured(kind: str, captured):
    """`captured`, then three replays timed one by one (each to a synchronize)."""

    def wrapper(run, args, pool, stream):
        graph, output = captured(run, args, pool, stream)
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        TIMES[kind].append(times)
        return graph, output

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--drafter", help="the drafter directory (default: the model's own)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--out")
    args = parser.parse_args()
    original = cuda_graph.captured
    cuda_graph.captured = timed_captured("decode", original)
    sampled_decode_graphs.captured = timed_captured("sampled decode", original)
    spec_graphs.captured = timed_captured("speculative", original)
    from dspark import LLM

    spec = {"method": "dspark", **({"model": args.drafter} if args.drafter else {})}
    LLM(args.model, max_num_seqs=args.max_num_seqs, speculative_config=spec)
    summary = {}
    for kind, runs in TIMES.items():
        if not runs:
            continue
        excess = [r[0] - r[2] for r in runs]
        summary[kind] = {
            "graphs": len(runs),
            "median_ms": [round(statistics.median(r[i] for r in runs), 3) for i in range(3)],
            "median_excess_ms": round(statistics.median(excess), 3),
            "max_excess_ms": round(max(excess), 3),
            "summed_excess_ms": round(sum(excess), 1),
        }
    print(f"{'graphs':>14} {'count':>6} {'1st ms':>8} {'2nd ms':>8} {'3rd ms':>8} "
          f"{'excess':>8} {'max':>8} {'summed':>8}")  # fmt: skip
    for kind, s in summary.items():
        print(f"{kind:>14} {s['graphs']:>6} {s['median_ms'][0]:>8.3f} {s['median_ms'][1]:>8.3f} "
              f"{s['median_ms'][2]:>8.3f} {s['median_excess_ms']:>8.3f} "
              f"{s['max_excess_ms']:>8.3f} {s['summed_excess_ms']:>8.1f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "times_ms": TIMES}, f)


if __name__ == "__main__":
    main()
