"""Paged attention micro-benchmark: the Triton kernel against the PyTorch reference, and against
torch SDPA on a dense (unpaged) KV layout as a rough ceiling.

    python bench/kernels_attention.py --out kernels_attention.json
    python bench/kernels_attention.py --smoke --out smoke.json   # CPU, interpreter, tiny

SmolLM2 shapes (9 heads, 3 kv heads, head_dim 64), bf16, page size 16. Decode batches of 1, 16,
64 and 256 requests at contexts 512 and 2048, and one 2048-token prefill chunk. Times are
triton.testing.do_bench medians in ms; --smoke times one call with a wall clock instead (there is
no CUDA timer), so its numbers mean nothing: it only proves the script runs end to end.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 16


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    q_len: int  # query tokens per request
    context: int  # KV length per request, this step's tokens included


@dataclass
class Row:
    case: str
    batch: int
    q_len: int
    context: int
    triton_ms: float
    ref_ms: float
    sdpa_dense_ms: float
    triton_kv_gbps: float  # K/V bytes the step must read / triton time
    max_abs_err: float  # triton vs reference on the same inputs
    launch: dict  # the Triton kernel's LaunchConfig (tile sizes, KV splits)


def cases(smoke: bool) -> list[Case]:
    if smoke:
        return [Case("decode", 1, 1, 40), Case("decode", 3, 1, 24), Case("prefill", 1, 24, 24)]
    decode = [Case("decode", b, 1, c) for c in (512, 2048) for b in (1, 16, 64, 256)]
    return decode + [Case("prefill", 1, 2048, 2048)]


def load_kernels() -> tuple[object, Callable, type]:
    # Imported late on purpose: --smoke sets TRITON_INTERPRET, which Triton reads when the
    # kernels are decorated, that is when their module is first imported.
    ref = importlib.import_module("dspark.kernels.paged_attention_ref").paged_attention_ref
    mod = importlib.import_module("dspark.kernels.paged_attention_triton")
    meta = importlib.import_module("dspark.attention_metadata").AttentionMetadata
    return mod, ref, meta


def paged_inputs(case: Case, dtype: torch.dtype, device: torch.device, metadata_cls: type):
    """Every request owns cdiv(context, PAGE_SIZE) pages, shuffled over the cache."""
    pages_per_req = -(-case.context // PAGE_SIZE)
    num_pages = case.batch * pages_per_req
    block_table = torch.randperm(num_pages, device=device).view(case.batch, pages_per_req)
    shape = (2, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv_cache = torch.randn(shape, device=device).to(dtype)
    cu = tuple(range(0, case.batch * case.q_len + 1, case.q_len))
    seq_lens = (case.context,) * case.batch
    attn = metadata_cls(
        cu_num_tokens=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(cu[-1], dtype=torch.int64, device=device),
        block_table=block_table.to(torch.int32),
        cu_num_tokens_cpu=cu,
        seq_lens_cpu=seq_lens,
    )
    q = torch.randn(cu[-1], NUM_HEADS, HEAD_DIM, device=device).to(dtype)  # [T, nh, hd]
    return q, kv_cache, attn


def dense_sdpa(case: Case, dtype: torch.dtype, device: torch.device) -> Callable[[], object]:
    """The same attention on contiguous [B, heads, S, hd] tensors: no page lookups at all."""
    q = torch.randn(case.batch, NUM_HEADS, case.q_len, HEAD_DIM, device=device).to(dtype)
    kv_shape = (case.batch, NUM_KV_HEADS, case.context, HEAD_DIM)
    k = torch.randn(kv_shape, device=device).to(dtype)
    v = torch.randn(kv_shape, device=device).to(dtype)
    # prefill: q_len == context, plain causal; decode: the one query sees every key
    causal = case.q_len > 1
    assert not causal or case.q_len == case.context, "dense ceiling covers fresh prefill only"
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def time_ms(fn: Callable[[], object], smoke: bool) -> float:
    if smoke:
        fn()  # warm-up (and, on a GPU, compile)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def bench_case(case: Case, dtype: torch.dtype, device: torch.device, smoke: bool) -> Row:
    triton_mod, ref_attn, metadata_cls = load_kernels()
    triton_attn = triton_mod.paged_attention_triton
    q, kv_cache, attn = paged_inputs(case, dtype, device, metadata_cls)
    launch = triton_mod.launch_config(q, NUM_KV_HEADS, attn, num_kv_splits=None)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    err = triton_attn(q, kv_cache, attn, scale).float() - ref_attn(q, kv_cache, attn, scale)
    triton_ms = time_ms(lambda: triton_attn(q, kv_cache, attn, scale, out=out), smoke)
    kv_bytes = 2 * case.batch * case.context * NUM_KV_HEADS * HEAD_DIM * kv_cache.element_size()
    return Row(
        case=case.name,
        batch=case.batch,
        q_len=case.q_len,
        context=case.context,
        triton_ms=triton_ms,
        ref_ms=time_ms(lambda: ref_attn(q, kv_cache, attn, scale), smoke),
        sdpa_dense_ms=time_ms(dense_sdpa(case, dtype, device), smoke),
        triton_kv_gbps=kv_bytes / (triton_ms * 1e-3) / 1e9,
        max_abs_err=err.abs().max().item(),
        launch=asdict(launch),
    )


def print_table(rows: list[Row]) -> None:
    head = f"{'case':8} {'batch':>5} {'q_len':>5} {'ctx':>5} {'triton':>9} {'ref':>9}"
    print(head + f" {'sdpa':>9} {'vs ref':>7} {'GB/s':>7} {'err':>8} {'splits':>6}   (ms)")
    for r in rows:
        print(
            f"{r.case:8} {r.batch:5d} {r.q_len:5d} {r.context:5d} {r.triton_ms:9.4f}"
            f" {r.ref_ms:9.4f} {r.sdpa_dense_ms:9.4f} {r.ref_ms / r.triton_ms:6.1f}x"
            f" {r.triton_kv_gbps:7.1f} {r.max_abs_err:8.1e} {r.launch['num_splits']:6d}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device (or --smoke for the CPU interpreter)")
        device, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    rows = [bench_case(c, dtype, device, args.smoke) for c in cases(args.smoke)]
    print_table(rows)
    with open(args.out, "w") as f:
        json.dump({**environment(device, dtype, args.smoke), "rows": [asdict(r) for r in rows]}, f)
    print(f"wrote {args.out}")


def environment(device: torch.device, dtype: torch.dtype, smoke: bool) -> dict:
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    shapes = {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM}
    return {
        "device": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype),
        "smoke": smoke,
        "timer": "wall clock, one call" if smoke else "triton.testing.do_bench median",
        "shapes": {**shapes, "page_size": PAGE_SIZE},
    }


if __name__ == "__main__":
    main()
