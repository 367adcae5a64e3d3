"""Tensor parallelism on one multi-GPU host: TP = 2 against TP = 1 (issue 50's GPU run).

    python bench/tensor_parallel.py --out tp                         # 2 GPUs
    python bench/tensor_parallel.py --out tp_dry --device cpu --shapes tiny \\
        --equality-shapes tiny --prompts 4 --output-len 8 --batches 1,4   # dry run (gloo)

Every arm runs in its own process (rank 0 of its job; TP = 2 spawns rank 1), so one arm's
memory and process group never meet the next one's:

  equality    greedy float32 tokens of --prompts prompts, TP = 2 against TP = 1, plain and with
              the drafting policy. --model: a real checkpoint and dspark bench's held-out
              prompts (its eval split) through its chat template; default: a random Qwen3
              target of --equality-shapes (8b) and random prompt ids, with a random DSpark
              drafter (`random_models.py drafter`). The policy arm of each size first profiles
              its own cost table (a table fingerprints its tensor-parallel size). A mismatch
              is reported with its first position and TP = 1's top-2 logprob gap there (a gap
              near zero is a float near-tie, not a sharding bug).
  throughput  plain decoding output tokens/s of a random bf16 target of --shapes (14b: Qwen3-
              14B's; 8b) at C = --batches, prompts of 128 random ids, 128 output tokens, median of
              3, TP = 1 and TP = 2; then one profiled generate at each C: rank 0's all-reduce
              time per decode step and its share of the step (CUDA: NCCL AllReduce kernels,
              replayed graphs included; CPU: gloo all_reduce ops).

Random weights accept nothing: the policy arm checks losslessness, never speed. Results go to
OUT/results.json and a summary on stdout; the checkpoints are written once under OUT/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from random_models import SHAPES, write_random_drafter, write_target

PROMPT_LEN, OUTPUT_LEN, RUNS = 128, 128, 3
PROFILE_TOKENS = 32  # output tokens of the profiled generate (a short trace)


def _llm(model: str, tp: int, device: str, dtype: str, **kw):
    from dspark import LLM

    return LLM(model, dtype=dtype, device=device, tensor_parallel_size=tp, **kw)


def policy_table(args: argparse.Namespace, out: Path) -> str:
    """Profile a cost table on this size's engine (fixed K pinned) and write it to `out`."""
    from dspark.benchmarks.profile import profile_cost_table

    spec = {"model": args.drafter, "scheduling": False}
    with _llm(args.model, args.tp, args.device, "float32", max_num_seqs=4,
              speculative_config=spec) as llm:  # fmt: skip
        table = profile_cost_table(llm, [1, 2, 4], steps=5, warmup=1, prompt_len=16, rounds=1)
    out.write_text(table.to_json())
    return str(out)


def child_equality(args: argparse.Namespace) -> dict:
    from dspark import SamplingParams

    prompts = json.loads(Path(args.prompts_file).read_text())
    spec = None
    if args.arm == "policy":
        table = policy_table(args, Path(args.out) / f"table_tp{args.tp}.json")
        spec = {"model": args.drafter, "cost_table": table}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            logprobs=2)  # fmt: skip
    with _llm(args.model, args.tp, args.device, "float32", max_num_seqs=16,
              speculative_config=spec) as llm:  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        metrics = llm.get_metrics()
    rows = [{"tokens": o.outputs[0].token_ids,
             "gaps": [_gap(lp) for lp in o.outputs[0].logprobs]} for o in outs]  # fmt: skip
    return {"rows": rows, "scheduling": metrics.get("scheduling"),
            "num_drafts": metrics.get("num_drafts", 0)}  # fmt: skip


def _gap(logprobs: dict) -> float:
    top = sorted(logprobs.values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def child_throughput(args: argparse.Namespace) -> dict:
    from dspark import SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    rows = {}
    with _llm(args.model, args.tp, args.device, "bfloat16", max_num_seqs=max(batches),
              max_model_len=PROMPT_LEN + OUTPUT_LEN + 16) as llm:  # fmt: skip
        for b in batches:
            prompts = torch.randint(0, vocab - 8, (b, PROMPT_LEN), generator=g).tolist()
            params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            llm.generate(prompts, params, use_tqdm=False)  # (warm-up)
            walls = []
            for _ in range(RUNS):
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                walls.append(time.perf_counter() - t)
            rows[b] = {"tok_s": b * args.output_len / statistics.median(walls)}
            if args.tp > 1:
                rows[b] |= all_reduce_share(llm, prompts)
    return rows


def all_reduce_share(llm, prompts: list[list[int]]) -> dict:
    """Rank 0's all-reduce time per step and its share of the profiled generate's wall time."""
    from torch.profiler import ProfilerActivity, profile

    from dspark import SamplingParams

    cuda = torch.cuda.is_available() and llm.engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    params = SamplingParams(temperature=0, max_tokens=PROFILE_TOKENS, ignore_eos=True)
    stats = llm.engine.runner.stats
    steps_before = stats["graph_steps"] + stats["eager_steps"]
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
    steps = stats["graph_steps"] + stats["eager_steps"] - steps_before
    us = 0.0
    for e in prof.key_averages():
        if cuda and "AllReduce" in e.key:
            us += getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
        elif not cuda and "all_reduce" in e.key:
            us += e.cpu_time_total
    return {"all_reduce_ms_per_step": us / 1e3 / steps, "all_reduce_share": us / 1e6 / wall,
            "profiled_steps": steps}  # fmt: skip


def run_child(args: argparse.Namespace, *extra: str) -> dict:
    """This script in a fresh process (--child ...); its last stdout line is a JSON object."""
    argv = [sys.executable, __file__, "--out", str(args.out), "--device", args.device,
            "--output-len", str(args.output_len), "--batches", args.batches, *extra]  # fmt: skip
    out = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def equality_prompts(args: argparse.Namespace, model: str) -> list:
    if not args.model:  # random ids: the random target's tokenizer is word-level
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        g = torch.Generator().manual_seed(1)
        return torch.randint(0, vocab - 8, (args.prompts, 64), generator=g).tolist()
    from dspark.benchmarks.offline_prompts import render
    from dspark.benchmarks.prompts import load_prompts
    from dspark.models.loader import resolve_model
    from dspark.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(model))
    return render(tokenizer, load_prompts(None, split="eval")[: args.prompts], 512)


def compare(one: dict, two: dict) -> dict:
    """Prompts whose tokens match; each mismatch's first position and TP = 1's gap there."""
    mismatches = []
    for i, (a, b) in enumerate(zip(one["rows"], two["rows"], strict=True)):
        if a["tokens"] != b["tokens"]:
            pairs = zip(a["tokens"], b["tokens"], strict=False)  # (lengths may differ)
            pos = next((j for j, (x, y) in enumerate(pairs) if x != y),
                       min(len(a["tokens"]), len(b["tokens"])))  # fmt: skip
            gap = a["gaps"][pos] if pos < len(a["gaps"]) else None
            mismatches.append({"prompt": i, "position": pos, "tp1_top2_gap": gap})
    return {"equal": len(one["rows"]) - len(mismatches), "of": len(one["rows"]),
            "mismatches": mismatches}  # fmt: skip


def equality(args: argparse.Namespace) -> dict:
    if args.model:
        model, drafter = args.model, args.drafter
    else:
        model = str(args.out / f"target_{args.equality_shapes}")
        write_target(Path(model), SHAPES[args.equality_shapes], args.device)
        drafter = args.drafter or str(args.out / f"drafter_{args.equality_shapes}")
    if drafter is None:
        raise SystemExit("--model needs --drafter (a DSpark drafter for it) for the policy arm")
    if not (Path(drafter) / "config.json").is_file():
        write_random_drafter(model, drafter)
    prompts_file = args.out / "equality_prompts.json"
    prompts_file.write_text(json.dumps(equality_prompts(args, model)))
    runs = {}
    for arm in ("plain", "policy"):
        for tp in (1, 2):
            runs[arm, tp] = run_child(args, "--child", "equality", "--arm", arm, "--tp", str(tp),
                                      "--model", model, "--drafter", drafter,
                                      "--prompts-file", str(prompts_file))  # fmt: skip
    result = {arm: compare(runs[arm, 1], runs[arm, 2]) for arm in ("plain", "policy")}
    result["policy_vs_plain_tp2"] = compare(runs["plain", 1], runs["policy", 2])
    result["policy_scheduling"] = {tp: runs["policy", tp]["scheduling"] for tp in (1, 2)}
    result["policy_num_drafts"] = {tp: runs["policy", tp]["num_drafts"] for tp in (1, 2)}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", choices=sorted(SHAPES), default="14b", help="throughput target")
    p.add_argument("--equality-shapes", choices=sorted(SHAPES), default="8b")
    p.add_argument("--model", default=None, help="a real checkpoint for the equality phase")
    p.add_argument("--drafter", default=None, help="its DSpark drafter (default: random)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--skip", default="", help="comma-separated phases to skip")
    p.add_argument("--child", choices=("equality", "throughput"), help=argparse.SUPPRESS)
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--prompts-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        run = child_equality if args.child == "equality" else child_throughput
        print(json.dumps(run(args)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    skip = set(args.skip.split(","))
    if "equality" not in skip:
        results["equality"] = equality(args)
        print("equality", json.dumps(results["equality"]), flush=True)
    if "throughput" not in skip:
        target = args.out / f"target_{args.shapes}"
        write_target(target, SHAPES[args.shapes], args.device)
        results["throughput"] = {
            f"tp{tp}": run_child(
                args, "--child", "throughput", "--tp", str(tp), "--model", str(target)
            )  # fmt: skip
            for tp in (1, 2)
        }
        print("throughput", json.dumps(results["throughput"]), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
