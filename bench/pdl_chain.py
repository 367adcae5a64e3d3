"""Does programmatic dependent launch (PDL) shorten a chain of latency-bound kernels?

A decode step at batch 1 is ~260 dependent launches of a few microseconds each (docs/
PERFORMANCE.md, the fourth look); most of each is the launch and the first memory round trip,
not the bytes moved. With PDL (Hopper), kernel n+1 is launched while kernel n still runs, and
waits at `griddepcontrol.wait` only before it reads n's output; what it does before the wait
(here: prefetching its weight rows into L2) overlaps n.

This script replays one CUDA graph of `--layers` x 4 GEMVs shaped like SmolLM2's decoder layer
(qkv 576 -> 960, o_proj 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576), each reading its
own weights (so W comes from HBM, as in the model), at T = 1 token row, in four variants:

    cublas      F.linear (what the model runs today)
    triton      this file's GEMV, plain launches
    pdl         the same GEMV launched with PDL, waiting before it reads x
    pdl_l2      pdl, and each program prefetches its W rows into L2 before the wait

    python bench/pdl_chain.py --out pdl_chain.json        # on the GPU
    TRITON_INTERPRET=1 python bench/pdl_chain.py --smoke   # CPU: the GEMV is right, nothing timed

Prints microseconds per GEMV (median replay time / GEMVs in the chain) and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of one decoder layer


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, L2_PREFETCH: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if L2_PREFETCH:
        # one address per 128-byte line of this program's W rows: rows x (K / 64) lines
        lines = tl.arange(0, BLOCK_K // 64) * 64
        addr = w_ptr + cols[:, None] * K + lines[None, :]
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [addr], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()  # everything above ran while the kernel before still did
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def gemv(x, w, out, *, pdl: bool, l2: bool, block_n: int, block_k: int, num_warps: int):
    N, K = w.shape
    extra = {"launch_pdl": True} if pdl else {}
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, w, out, N=N, K=K, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, L2_PREFETCH=l2,
        num_warps=num_warps, **extra,
    )  # fmt: skip


def build_chain(layers: int, device, dtype):
    """Per layer four (x, W, out) triples; each GEMV reads the previous one's output (its first K
    values), so the chain is serial like the model's."""
    torch.manual_seed(0)
    bufs = []
    x = torch.randn(1, 1536, device=device, dtype=dtype)
    for _ in range(layers):
        for n, k in SHAPES:
            w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
            out = torch.empty(1, max(n, 1536), device=device, dtype=dtype)
            bufs.append((x, w, out))
            x = out
    return bufs


def run_chain(bufs, variant: str, block_n: int, block_k: int, num_warps: int):
    for x, w, out in bufs:
        n, k = w.shape
        if variant == "cublas":
            out[:, :n] = F.linear(x[:, :k], w)
        else:
            gemv(x, w, out, pdl=variant.startswith("pdl"), l2=variant == "pdl_l2",
                 block_n=block_n, block_k=block_k, num_warps=num_warps)  # fmt: skip


def time_graph(fn, replays: int) -> float:
    """Median microseconds of one replay of fn captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--block-n", default="4,8,16")
    ap.add_argument("--block-k", type=int, default=256)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter: check the GEMV, time nothing")
    args = ap.parse_args()

    if args.smoke:
        bufs = build_chain(1, "cpu", torch.float32)
        for x, w, out in bufs:
            n, k = w.shape
            gemv(x, w, out, pdl=False, l2=False, block_n=8, block_k=256, num_warps=4)
            torch.testing.assert_close(out[:, :n], F.linear(x[:, :k], w), rtol=1e-4, atol=1e-4)
        print("smoke: GEMV equals F.linear")
        return

    dtype, dev = torch.bfloat16, torch.device("cuda")
    bufs = build_chain(args.layers, dev, dtype)
    ref = None
    rows = []
    for block_n in [int(b) for b in args.block_n.split(",")]:
        for variant in ("cublas", "triton", "pdl", "pdl_l2"):
            if variant == "cublas" and rows and any(r["variant"] == "cublas" for r in rows):
                continue
            fn = lambda: run_chain(bufs, variant, block_n, args.block_k, args.num_warps)  # noqa: E731
            try:
                us = time_graph(fn, args.replays)
            except Exception as e:  # report and go on: a variant the toolchain cannot build
                rows.append({"variant": variant, "block_n": block_n, "error": repr(e)[:300]})
                print(variant, block_n, "failed:", repr(e)[:300])
                continue
            final = bufs[-1][2].float().clone()
            if ref is None and variant == "cublas":
                ref = final
            err = None if ref is None else (final - ref).abs().max().item()
            per = us / len(bufs)
            rows.append({"variant": variant, "block_n": 0 if variant == "cublas" else block_n,
                         "chain_us": us, "us_per_gemv": per, "max_abs_diff_vs_cublas": err})  # fmt: skip
    print(f"{'variant':<8} {'block_n':>7} {'chain us':>9} {'us/GEMV':>8} {'diff':>9}")
    for r in rows:
        if "error" in r:
            continue
        print(f"{r['variant']:<8} {r['block_n']:>7} {r['chain_us']:>9.1f} {r['us_per_gemv']:>8.2f}"
              f" {r['max_abs_diff_vs_cublas'] or 0:>9.3g}")  # fmt: skip
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__, "layers": args.layers, "shapes": SHAPES}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
