"""Greedy generation of the default model on the CPU and on CUDA, compared token for token.

    python bench/greedy_devices.py --out greedy_devices.json

Runs fp32 on both devices (must match exactly) and bf16 on CUDA (may diverge after a near-tie:
then the logit margin of the fp32 model at the first divergence is reported).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import torch

from dspark import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the ocean.",
    "Explain recursion to a five-year-old.",
    "Give me three tips for learning Python.",
]


def _generate(device: str, dtype: str, max_tokens: int):
    llm = LLM("default", dtype=dtype, device=device, kv_cache_memory_gb=0.5)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return llm, [o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs], seconds


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def _margin(llm: LLM, prompt: list[int], tokens: list[int], at: int) -> float:
    """Top-1 minus top-2 logit of the fp32 model at output position `at`."""
    from tests.helpers import full_logits

    logits = full_logits(llm.engine.model, prompt + tokens[:at]).logits[-1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="greedy_devices.json")
    args = parser.parse_args()
    cpu_llm, prompts, cpu, cpu_s = _generate("cpu", "float32", args.max_tokens)
    _, _, cuda32, cuda32_s = _generate("cuda", "float32", args.max_tokens)
    _, _, cuda16, cuda16_s = _generate("cuda", "bfloat16", args.max_tokens)
    rows = []
    for i in range(len(PROMPTS)):
        div = _first_divergence(cpu[i], cuda16[i])
        rows.append(
            {
                "prompt": PROMPTS[i],
                "fp32_cuda_equals_cpu": cuda32[i] == cpu[i],
                "bf16_first_divergence": div,
                "fp32_margin_at_bf16_divergence": None
                if div is None
                else _margin(cpu_llm, prompts[i], cpu[i], div),
                "cpu_tokens": cpu[i],
            }
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "host": platform.node(),
        "max_tokens": args.max_tokens,
        "seconds": {"cpu_fp32": cpu_s, "cuda_fp32": cuda32_s, "cuda_bf16": cuda16_s},
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'prompt':42} fp32 cuda==cpu  bf16 first divergence (fp32 margin)")
    for r in rows:
        margin = r["fp32_margin_at_bf16_divergence"]
        extra = "none" if margin is None else f"{r['bf16_first_divergence']} ({margin:.3f})"
        print(f"{r['prompt'][:42]:42} {str(r['fp32_cuda_equals_cpu']):14} {extra}")


if __name__ == "__main__":
    main()
