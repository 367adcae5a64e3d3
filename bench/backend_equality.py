"""Greedy tokens of the GPU fast path (triton kernels, CUDA graphs, async scheduling) against
the PyTorch reference backend run eagerly on the same GPU, in fp32.

    python bench/backend_equality.py --model M --batch 1,3,16 --tokens 64

Prints, per batch size, how many requests match token for token and where the first mismatch
is (fp32 GEMM accumulation orders differ between the paths, so a near-tie can flip a token).
"""

from __future__ import annotations

import argparse
import json

from dspark import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch", default="1,3,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    common = dict(dtype="float32", device="cuda", max_model_len=1024, kv_cache_memory_gb=2.0)
    fast = LLM(args.model, **common)
    ref = LLM(args.model, attention_backend="torch", use_cuda_graphs=False,
              async_scheduling=False, **common)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        prompts = [[100 + 37 * i + j for j in range(5 + 11 * i)] for i in range(b)]
        got = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
        first = [next((k for k, (x, y) in enumerate(zip(g, w, strict=True)) if x != y), None)
                 for g, w in zip(got, want, strict=True)]  # fmt: skip
        rows.append({"batch": b, "equal": sum(f is None for f in first), "first_mismatch": first})
        print(f"batch {b}: {rows[-1]['equal']}/{b} equal; first mismatches {first}")
    print("runner stats:", dict(fast.engine.runner.stats))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
