"""Seconds per drafter training step, reference loss against the chunked one, side by side.

    python bench/train_step_profile.py --model /tmp/rs --steps 20 --out train_step.json

The default recipe's step (32 sequences x 64 anchors x K = 7, bf16 autocast) on synthetic
sequences: random token ids, 100 prompt + 300 response tokens (the step's cost does not depend
on the tokens, only on the shapes). Two trainers with the same initial drafter, one per loss
path (TrainConfig.chunk_slots 0: drafter_losses over materialised logits; the default:
vocab_loss.py), alternate step by step after 3 warm-up steps each; medians of CUDA-synchronised
wall times, peak memory per path, and the loss of both paths on one batch (they must agree).
--kernels N then profiles 3 chunked steps and prints the N CUDA kernels with the most time,
and the step's CPU-side time outside them (where a step waits on the host).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from dspark.models.llama import build_model
from dspark.models.loader import checkpoint_hash, load_checkpoint, resolve_model
from dspark.train.anchors import Sequence
from dspark.train.trainer import TrainConfig, Trainer, build_drafter


def _synthetic(n: int, vocab: int, prompt: int, response: int, seed: int) -> list[Sequence]:
    rng = random.Random(seed)
    return [Sequence([rng.randrange(vocab) for _ in range(prompt + response)], prompt)
            for _ in range(n)]  # fmt: skip


def _timed_step(trainer: Trainer) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    trainer.train_step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="train_step_profile.json")
    parser.add_argument("--kernels", type=int, default=0)
    args = parser.parse_args()
    source = resolve_model(args.model)
    config, weights = load_checkpoint(source)
    target = build_model(config, weights, torch.bfloat16, torch.device("cuda"), "triton")
    seqs = _synthetic(256, config.vocab_size, 100, 300, seed=0)
    arms = {"reference": 0, "chunked": TrainConfig.chunk_slots}
    trainers = {}
    for name, chunk in arms.items():
        cfg = TrainConfig(total_steps=10_000, chunk_slots=chunk)
        trainers[name] = Trainer(target, build_drafter(target, checkpoint_hash(source), cfg),
                                 seqs, cfg)  # fmt: skip
    trainers["chunked"].drafter.load_state_dict(trainers["reference"].drafter.state_dict())
    with torch.no_grad():
        gen = lambda: torch.Generator().manual_seed(1)  # noqa: E731
        losses = {n: float(t.losses(seqs[:32], gen()).total) for n, t in trainers.items()}
    times: dict[str, list[float]] = {n: [] for n in arms}
    peak: dict[str, int] = {}
    for trainer in trainers.values():
        for _ in range(3):
            _timed_step(trainer)
    for _ in range(args.steps):
        for name, trainer in trainers.items():
            torch.cuda.reset_peak_memory_stats()
            times[name].append(_timed_step(trainer))
            peak[name] = max(peak.get(name, 0), torch.cuda.max_memory_allocated())
    rows = {n: {"step_s_median": statistics.median(t), "step_s_min": min(t),
                "peak_gb": peak[n] / 2**30, "loss_same_batch": losses[n]}
            for n, t in times.items()}  # fmt: skip
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
              "model": args.model, "steps": args.steps, "rows": rows}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'loss path':>10} {'s/step':>8} {'min':>8} {'peak GB':>8} {'loss':>9}")
    for n, r in rows.items():
        print(f"{n:>10} {r['step_s_median']:8.4f} {r['step_s_min']:8.4f} {r['peak_gb']:8.2f} "
              f"{r['loss_same_batch']:9.4f}")  # fmt: skip
    ratio = rows["reference"]["step_s_median"] / rows["chunked"]["step_s_median"]
    print(f"reference / chunked: {ratio:.2f}x")
    if args.kernels:
        _print_kernels(trainers["chunked"], args.kernels)


def _print_kernels(trainer: Trainer, top: int, steps: int = 3) -> None:
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.train_step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.name].append(evt.device_time_total / 1e3)
    busy = sum(sum(v) for v in per_kernel.values()) / steps
    print(f"profiled step: {wall_ms:.1f} ms wall, {busy:.1f} ms GPU busy, "
          f"{sum(len(v) for v in per_kernel.values()) / steps:.0f} kernels")  # fmt: skip
    for name, times in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(times) / steps:8.2f} ms  x{len(times) / steps:5.0f}  {name[:90]}")


if __name__ == "__main__":
    main()
