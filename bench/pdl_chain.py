"""The decode GEMV (dspark/kernels/gemv_triton.py) in a chain of dependent launches, against
cuBLAS, with and without programmatic dependent launch (PDL), over tile configs.

A decode step at batch 1 is ~260 dependent launches of a few microseconds each (docs/
PERFORMANCE.md, the fourth look). This script replays one CUDA graph of `--layers` x 4 GEMVs
shaped like SmolLM2's decoder layer (qkv 576 -> 960, o_proj 576 -> 576, gate_up 576 -> 3072,
down 1536 -> 576), each reading its own weights (so W comes from HBM, as in the model) and the
previous one's output (so the chain is serial), and also chains of one shape alone (to choose
a config per shape). Variants:

    cublas          F.linear (what the model runs at more rows than the GEMV takes)
    gemv            the GEMV, plain launches (DSPARK_PDL=0)
    gemv_pdl        the GEMV launched with PDL (its L2 prefetch of W before the wait)

    python bench/pdl_chain.py --out pdl_chain.json                      # on the GPU
    python bench/pdl_chain.py --rows 1,8 --block-n 1,2,4 --block-k 64,128,256 --num-warps 2,4
    TRITON_INTERPRET=1 python bench/pdl_chain.py --smoke   # CPU: the chain runs, nothing timed

Prints microseconds per GEMV (median replay time / GEMVs in the chain) and writes the rows as
JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

import torch
import torch.nn.functional as F
import triton

from dspark.kernels.gemv_triton import GemvConfig, default_config, gemv

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYER = ["qkv", "o_proj", "gate_up", "down"]


def build_chain(names: list[str], layers: int, rows: int, device, dtype):
    """(name, W) pairs and two [rows, 3072] buffers: GEMV i reads the first K columns of one
    and writes the first N of the other, so each reads the one before it (a serial chain, in
    which any shape may follow any other)."""
    torch.manual_seed(0)
    chain = []
    bufs = [torch.randn(rows, 3072, device=device, dtype=dtype) for _ in range(2)]
    for _ in range(layers):
        for name in names:
            n, k = SHAPES[name]
            chain.append((name, torch.randn(n, k, device=device, dtype=dtype) / k**0.5))
    return chain, bufs


def run_chain(chain, bufs, variant: str, configs: dict[str, GemvConfig | None]) -> torch.Tensor:
    if variant == "cublas" and bufs[0].shape[0] > 1:
        # Several rows: a column slice of a buffer is strided and mm's out= would add a copy,
        # so F.linear reads a view of the output before it (valid in the layer's order, where
        # each K <= the N before it) and writes a new tensor, as in the model.
        x = bufs[0]
        for _, w in chain:
            x = F.linear(x[:, : w.shape[1]], w)
        return x
    for i, (name, w) in enumerate(chain):
        (n, k), src, dst = w.shape, bufs[i % 2], bufs[(i + 1) % 2]
        if variant == "cublas":  # one row: the column slices are contiguous
            torch.mm(src[:, :k], w.t(), out=dst[:, :n])
        else:
            gemv(src[:, :k], w, out=dst[:, :n], config=configs.get(name))
    return bufs[len(chain) % 2][:, : chain[-1][1].shape[0]]


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


def measure(names, layers, rows, variant, configs, replays) -> float:
    chain, bufs = build_chain(names, layers, rows, "cuda", torch.bfloat16)
    os.environ["DSPARK_PDL"] = "1" if variant == "gemv_pdl" else "0"
    us = time_graph(lambda: run_chain(chain, bufs, variant, configs), replays)
    return us / len(chain)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--rows", default="1")
    ap.add_argument("--block-n", default="1,2,4,8")
    ap.add_argument("--block-k", default="64,128,256")
    ap.add_argument("--num-warps", default="2,4")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter: the chain runs")
    args = ap.parse_args()

    if args.smoke:
        chain, bufs = build_chain(LAYER, 1, 1, "cpu", torch.float32)
        start = [b.clone() for b in bufs]
        ref = run_chain(chain, bufs, "cublas", {}).clone()
        bufs[0].copy_(start[0]), bufs[1].copy_(start[1])
        torch.testing.assert_close(run_chain(chain, bufs, "gemv", {}), ref, rtol=1e-4, atol=1e-4)
        print("smoke: the GEMV chain equals the F.linear chain")
        return

    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    sizes = itertools.product(ints(args.block_n), ints(args.block_k), ints(args.num_warps))
    grid = [GemvConfig(bn, bk, nw) for bn, bk, nw in sizes]
    rows_out = []

    def record(kind, shape, rows, variant, config, us):
        config_dict = None if config is None else vars(config)
        rows_out.append({"chain": kind, "shape": shape, "rows": rows, "variant": variant,
                         "config": config_dict, "us_per_gemv": us})  # fmt: skip
        cfg = (
            "default"
            if config is None
            else f"n{config.block_n} k{config.block_k} w{config.num_warps}"
        )
        print(f"{kind:<6} {shape:<8} T={rows} {variant:<9} {cfg:<16} {us:6.2f} us")

    for rows in ints(args.rows):
        best = {}
        for name in LAYER:  # one shape alone: the config sweep
            if rows == 1:  # several rows: cuBLAS only in the layer's chain (run_chain)
                us = measure([name], 120, rows, "cublas", {}, args.replays)
                record("shape", name, rows, "cublas", None, us)
            results = []
            for cfg in [None, *grid]:
                for variant in ("gemv", "gemv_pdl") if cfg is None else ("gemv_pdl",):
                    try:
                        us = measure([name], 120, rows, variant, {name: cfg}, args.replays)
                    except (
                        Exception
                    ) as e:  # a config the compiler refuses (registers, shared memory)
                        print(name, cfg, "failed:", repr(e)[:200])
                        continue
                    record("shape", name, rows, variant, cfg, us)
                    if variant == "gemv_pdl":
                        n, k = SHAPES[name]
                        results.append((us, cfg or default_config(n, k)))
            best[name] = min(results, key=lambda r: r[0])[1]
        for variant, configs in (
            ("cublas", {}),
            ("gemv", {}),
            ("gemv_pdl", {}),
            ("gemv_pdl", best),
        ):
            us = measure(LAYER, args.layers, rows, variant, configs, args.replays)
            record(
                "layer", "+".join(LAYER), rows, variant, configs.get("qkv") if configs else None, us
            )
        print(f"T={rows} best per shape:", {k: vars(v) for k, v in best.items()})
        rows_out.append({"rows": rows, "best": {k: vars(v) for k, v in best.items()}})
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__, "layers": args.layers, "shapes": SHAPES}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
