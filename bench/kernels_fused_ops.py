"""Fused elementwise kernels micro-benchmark: each Triton kernel against the eager PyTorch code it
replaces (RMSNorm, residual add + RMSNorm, rotary on the fused qkv, SiLU-and-mul).

    python bench/kernels_fused_ops.py --out kernels_fused_ops.json
    python bench/kernels_fused_ops.py --smoke --out smoke.json   # CPU, interpreter, tiny

SmolLM2-135M shapes (hidden 576, 9 heads, 3 kv heads, head_dim 64, intermediate 1536), bf16,
T in {1, 64, 256, 2048} tokens. Times are medians in ms: triton.testing.do_bench for plain
launches (at small T launch-bound: the eager column then pays the host cost of every op it is
made of) and do_bench_cudagraph for the same calls replayed from a CUDA graph (GPU time alone,
as the captured decode step sees it). GB/s: the bytes the op must move over the graph time.
--smoke times one call with a wall clock instead (there is no CUDA timer) at T in {1, 3} in
float32, so its numbers mean nothing: it only proves the script runs end to end.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import ModuleType

import torch

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536
Q_SIZE, KV_SIZE = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
EPS, ROPE_THETA = 1e-5, 100000.0

Thunk = Callable[[], object]


@dataclass
class Row:
    op: str
    num_tokens: int
    triton_ms: float
    eager_ms: float
    triton_graph_ms: float | None  # replayed from a CUDA graph: no launch overhead; None: smoke
    eager_graph_ms: float | None
    triton_gbps: float  # bytes the op must read and write / triton graph (else plain) time
    max_abs_err: float  # triton vs eager on the same inputs


@dataclass(frozen=True)
class Case:
    fused: Thunk
    eager: Thunk
    error: Callable[[], float]  # max |fused - eager|, on fresh copies where the op is in place
    num_bytes: int


def load_kernels() -> dict[str, ModuleType]:
    # Imported late on purpose: --smoke sets TRITON_INTERPRET, which Triton reads when the
    # kernels are decorated, that is when their module is first imported.
    names = ("rmsnorm_triton", "rotary_triton", "silu_mul_triton")
    return {n: importlib.import_module(f"dspark.kernels.{n}") for n in names}


def max_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got.float() - expected.float()).abs().max().item()  # sync: bench only


def rmsnorm_case(
    kernels: dict[str, ModuleType], T: int, dtype: torch.dtype, device: torch.device
) -> Case:
    mod = kernels["rmsnorm_triton"]
    x = torch.randn(T, HIDDEN, device=device).to(dtype)  # [T, d]
    w = (1 + 0.1 * torch.randn(HIDDEN, device=device)).to(dtype)  # [d]
    fused, eager = (lambda: mod.rmsnorm(x, w, EPS)), (lambda: mod.rmsnorm_ref(x, w, EPS))
    return Case(fused, eager, lambda: max_err(fused(), eager()), 2 * x.numel() * x.element_size())


def add_rmsnorm_case(
    kernels: dict[str, ModuleType], T: int, dtype: torch.dtype, device: torch.device
) -> Case:
    mod = kernels["rmsnorm_triton"]
    x = torch.randn(T, HIDDEN, device=device).to(dtype)  # [T, d], the attention output
    residual = torch.randn(T, HIDDEN, device=device).to(dtype)  # [T, d]
    w = (1 + 0.1 * torch.randn(HIDDEN, device=device)).to(dtype)

    def fused() -> tuple[torch.Tensor, torch.Tensor]:
        return mod.fused_add_rmsnorm(x, residual, w, EPS)

    def eager() -> tuple[torch.Tensor, torch.Tensor]:
        return mod.fused_add_rmsnorm_ref(x, residual, w, EPS)

    def error() -> float:
        return max(max_err(a, b) for a, b in zip(fused(), eager(), strict=True))

    return Case(fused, eager, error, 4 * x.numel() * x.element_size())


def rotary_case(
    kernels: dict[str, ModuleType], T: int, dtype: torch.dtype, device: torch.device
) -> Case:
    mod = kernels["rotary_triton"]
    qkv = torch.randn(T, Q_SIZE + 2 * KV_SIZE, device=device).to(dtype)  # [T, qkv width]
    positions = torch.randint(0, 4096, (T,), device=device)  # [T]
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, device=device) / HEAD_DIM))

    def fused(t: torch.Tensor = qkv) -> None:  # in place; timing keeps rotating one buffer
        mod.rotary_qkv(t, positions, inv_freq, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)

    def eager(t: torch.Tensor = qkv) -> tuple[torch.Tensor, torch.Tensor]:
        q = t[:, :Q_SIZE].unflatten(1, (NUM_HEADS, HEAD_DIM))  # [T, nh, hd]
        k = t[:, Q_SIZE : Q_SIZE + KV_SIZE].unflatten(1, (NUM_KV_HEADS, HEAD_DIM))
        return mod.apply_rotary_ref(q, k, positions, inv_freq)

    def error() -> float:
        fresh = qkv.clone()
        q, k = eager(fresh)
        fused(fresh)
        k_part = fresh[:, Q_SIZE : Q_SIZE + KV_SIZE]
        return max(max_err(fresh[:, :Q_SIZE], q.flatten(1)), max_err(k_part, k.flatten(1)))

    return Case(fused, eager, error, 2 * T * (Q_SIZE + KV_SIZE) * qkv.element_size())


def silu_case(
    kernels: dict[str, ModuleType], T: int, dtype: torch.dtype, device: torch.device
) -> Case:
    mod = kernels["silu_mul_triton"]
    gate_up = torch.randn(T, 2 * INTER, device=device).to(dtype)  # [T, 2I]
    fused, eager = (lambda: mod.silu_and_mul(gate_up)), (lambda: mod.silu_and_mul_ref(gate_up))
    return Case(
        fused, eager, lambda: max_err(fused(), eager()), 3 * T * INTER * gate_up.element_size()
    )


OPS = {
    "rmsnorm": rmsnorm_case,
    "add_rmsnorm": add_rmsnorm_case,
    "rotary_qkv": rotary_case,
    "silu_and_mul": silu_case,
}


def time_ms(fn: Thunk, smoke: bool) -> float:
    if smoke:
        fn()  # warm-up (and, on a GPU, compile)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def graph_ms(fn: Thunk, smoke: bool) -> float | None:
    """GPU time per call with launches replayed from a CUDA graph, as the decode step runs."""
    if smoke:
        return None
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def bench_op(op: str, T: int, dtype: torch.dtype, device: torch.device, smoke: bool) -> Row:
    case = OPS[op](load_kernels(), T, dtype, device)
    err = case.error()  # before timing: the in-place rotary drifts its buffer while timed
    triton_ms, triton_graph_ms = time_ms(case.fused, smoke), graph_ms(case.fused, smoke)
    gpu_ms = triton_ms if triton_graph_ms is None else triton_graph_ms
    return Row(
        op=op,
        num_tokens=T,
        triton_ms=triton_ms,
        eager_ms=time_ms(case.eager, smoke),
        triton_graph_ms=triton_graph_ms,
        eager_graph_ms=graph_ms(case.eager, smoke),
        triton_gbps=case.num_bytes / (gpu_ms * 1e-3) / 1e9,
        max_abs_err=err,
    )


def print_table(rows: list[Row]) -> None:
    head = f"{'op':13} {'T':>5} {'triton':>9} {'eager':>9} {'vs eager':>8}"
    print(head + f" {'graph tri':>9} {'graph eag':>9} {'GB/s':>7} {'err':>8}  (ms)")
    for r in rows:
        print(
            f"{r.op:13} {r.num_tokens:5d} {r.triton_ms:9.4f} {r.eager_ms:9.4f}"
            f" {r.eager_ms / r.triton_ms:7.1f}x {_ms(r.triton_graph_ms)} {_ms(r.eager_graph_ms)}"
            f" {r.triton_gbps:7.1f} {r.max_abs_err:8.1e}"
        )


def _ms(value: float | None) -> str:
    return f"{'-':>9}" if value is None else f"{value:9.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        device, dtype, token_counts = torch.device("cpu"), torch.float32, (1, 3)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device (or --smoke for the CPU interpreter)")
        device, dtype, token_counts = torch.device("cuda"), torch.bfloat16, (1, 64, 256, 2048)
    torch.manual_seed(0)
    rows = [bench_op(op, T, dtype, device, args.smoke) for op in OPS for T in token_counts]
    print_table(rows)
    with open(args.out, "w") as f:
        json.dump({**environment(device, dtype, args.smoke), "rows": [asdict(r) for r in rows]}, f)
    print(f"wrote {args.out}")


def environment(device: torch.device, dtype: torch.dtype, smoke: bool) -> dict:
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    shapes = {"hidden_size": HIDDEN, "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS}
    return {
        "device": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype),
        "smoke": smoke,
        "timer": "wall clock, one call" if smoke else "triton.testing.do_bench median",
        "shapes": {**shapes, "head_dim": HEAD_DIM, "intermediate_size": INTER},
    }


if __name__ == "__main__":
    main()
