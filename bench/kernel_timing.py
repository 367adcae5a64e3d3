"""Kernel micro-benchmarks at SmolLM2-135M's shapes (the GEMV at Qwen3-8B's too): each Triton
kernel against the code it replaces. (Not named kernels.py: a script's folder comes first on
sys.path, and transformers imports the Hugging Face `kernels` package where it is installed.)

    python bench/kernel_timing.py attention --out kernels_attention.json
    python bench/kernel_timing.py fused-ops --out kernels_fused_ops.json
    python bench/kernel_timing.py attention --smoke --out smoke.json   # CPU, interpreter, tiny

attention  ragged paged attention (9 heads, 3 kv heads, head_dim 64, bf16, page size 16): the
           Triton kernel against the PyTorch reference, and against torch SDPA on a dense
           (unpaged) KV layout as a rough ceiling. Decode batches of 1, 16, 64 and 256
           requests at contexts 512 and 2048, and one 2048-token prefill chunk. Times are
           triton.testing.do_bench medians in ms.
fused-ops  the fused elementwise kernels (RMSNorm, residual add + RMSNorm, rotary on the fused
           qkv, SiLU-and-mul; hidden 576, intermediate 1536) against the eager PyTorch code
           they replace, bf16, T in {1, 64, 256, 2048} tokens. Times are medians in ms:
           triton.testing.do_bench for plain launches (at small T launch-bound: the eager
           column then pays the host cost of every op it is made of) and do_bench_cudagraph
           for the same calls replayed from a CUDA graph (GPU time alone, as the captured
           decode step sees it). GB/s: the bytes the op must move over the graph time.

gemv       the one-to-eight-row GEMV (kernels/gemv_triton.py) against F.linear (cuBLAS) at the
           projections of SmolLM2-135M and Qwen3-8B (bf16), T in {1, 2, 4, 8} rows, each
           replayed from a CUDA graph over enough copies of the weight (a layer stack's chain)
           that L2 holds none of them; GB/s is the weight bytes over that time, beside the
           device's measured copy bandwidth (bytes read + written by a device-to-device copy,
           as bench/real_target_shapes.py measures it), so a projection's fraction of its
           bandwidth floor reads off directly.

    python bench/kernel_timing.py gemv --out kernels_gemv.json

gemv-configs  the one-row GEMV's tiles (kernels/gemv_triton.py GemvConfig: columns a program,
           the K block of its unrolled walk, warps) swept at Qwen3-8B's projections, each
           config timed as `gemv` times it, beside cuBLAS and the default config: which tiles,
           if any, read a large weight faster than cuBLAS.

    python bench/kernel_timing.py gemv-configs --out kernels_gemv_configs.json

--smoke times one call with a wall clock instead (there is no CUDA timer) on tiny shapes in
float32 on the CPU interpreter, so its numbers mean nothing: it only proves the script runs end
to end.
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
import torch.nn.functional as F

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536
Q_SIZE, KV_SIZE = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
EPS, ROPE_THETA, PAGE_SIZE = 1e-5, 100000.0, 16

Thunk = Callable[[], object]


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


def max_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got.float() - expected.float()).abs().max().item()  # sync: bench only


# ---- attention ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionCase:
    name: str
    batch: int
    q_len: int  # query tokens per request
    context: int  # KV length per request, this step's tokens included


@dataclass
class AttentionRow:
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


def attention_cases(smoke: bool) -> list[AttentionCase]:
    if smoke:
        return [AttentionCase("decode", 1, 1, 40), AttentionCase("decode", 3, 1, 24),
                AttentionCase("prefill", 1, 24, 24)]  # fmt: skip
    decode = [AttentionCase("decode", b, 1, c) for c in (512, 2048) for b in (1, 16, 64, 256)]
    return decode + [AttentionCase("prefill", 1, 2048, 2048)]


def paged_inputs(case: AttentionCase, dtype: torch.dtype, device: torch.device):
    """Every request owns cdiv(context, PAGE_SIZE) pages, shuffled over the cache."""
    metadata_cls = importlib.import_module("dspark.attention_metadata").AttentionMetadata
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


def dense_sdpa(case: AttentionCase, dtype: torch.dtype, device: torch.device) -> Thunk:
    """The same attention on contiguous [B, heads, S, hd] tensors: no page lookups at all."""
    q = torch.randn(case.batch, NUM_HEADS, case.q_len, HEAD_DIM, device=device).to(dtype)
    kv_shape = (case.batch, NUM_KV_HEADS, case.context, HEAD_DIM)
    k = torch.randn(kv_shape, device=device).to(dtype)
    v = torch.randn(kv_shape, device=device).to(dtype)
    # prefill: q_len == context, plain causal; decode: the one query sees every key
    causal = case.q_len > 1
    assert not causal or case.q_len == case.context, "dense ceiling covers fresh prefill only"
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def bench_attention(
    case: AttentionCase, dtype: torch.dtype, device: torch.device, smoke: bool
) -> AttentionRow:
    # Imported late on purpose: --smoke sets TRITON_INTERPRET, which Triton reads when the
    # kernels are decorated, that is when their module is first imported.
    ref_attn = importlib.import_module("dspark.kernels.paged_attention_ref").paged_attention_ref
    triton_mod = importlib.import_module("dspark.kernels.paged_attention_triton")
    triton_attn = triton_mod.paged_attention_triton
    q, kv_cache, attn = paged_inputs(case, dtype, device)
    launch = triton_mod.launch_config(q, NUM_KV_HEADS, attn, num_kv_splits=None)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    err = triton_attn(q, kv_cache, attn, scale).float() - ref_attn(q, kv_cache, attn, scale)
    triton_ms = time_ms(lambda: triton_attn(q, kv_cache, attn, scale, out=out), smoke)
    kv_bytes = 2 * case.batch * case.context * NUM_KV_HEADS * HEAD_DIM * kv_cache.element_size()
    return AttentionRow(
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


def attention(dtype: torch.dtype, device: torch.device, smoke: bool) -> tuple[list, dict]:
    rows = [bench_attention(c, dtype, device, smoke) for c in attention_cases(smoke)]
    head = f"{'case':8} {'batch':>5} {'q_len':>5} {'ctx':>5} {'triton':>9} {'ref':>9}"
    print(head + f" {'sdpa':>9} {'vs ref':>7} {'GB/s':>7} {'err':>8} {'splits':>6}   (ms)")
    for r in rows:
        print(
            f"{r.case:8} {r.batch:5d} {r.q_len:5d} {r.context:5d} {r.triton_ms:9.4f}"
            f" {r.ref_ms:9.4f} {r.sdpa_dense_ms:9.4f} {r.ref_ms / r.triton_ms:6.1f}x"
            f" {r.triton_kv_gbps:7.1f} {r.max_abs_err:8.1e} {r.launch['num_splits']:6d}"
        )
    shapes = {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
              "page_size": PAGE_SIZE}  # fmt: skip
    return rows, shapes


# ---- fused elementwise ops ----------------------------------------------------------------


@dataclass
class OpRow:
    op: str
    num_tokens: int
    triton_ms: float
    eager_ms: float
    triton_graph_ms: float | None  # replayed from a CUDA graph: no launch overhead; None: smoke
    eager_graph_ms: float | None
    triton_gbps: float  # bytes the op must read and write / triton graph (else plain) time
    max_abs_err: float  # triton vs eager on the same inputs


@dataclass(frozen=True)
class OpCase:
    fused: Thunk
    eager: Thunk
    error: Callable[[], float]  # max |fused - eager|, on fresh copies where the op is in place
    num_bytes: int


def load_op_kernels() -> dict[str, ModuleType]:
    # Imported late on purpose: --smoke sets TRITON_INTERPRET (see bench_attention).
    names = ("rmsnorm_triton", "rotary_triton", "silu_mul_triton")
    return {n: importlib.import_module(f"dspark.kernels.{n}") for n in names}


def rmsnorm_case(
    kernels: dict[str, ModuleType], T: int, dtype: torch.dtype, device: torch.device
) -> OpCase:
    mod = kernels["rmsnorm_triton"]
    x = torch.randn(T, HIDDEN, device=device).to(dtype)  # [T, d]
    w = (1 + 0.1 * torch.randn(HIDDEN, device=device)).to(dtype)  # [d]
    fused, eager = (lambda: mod.rmsnorm(x, w, EPS)), (lambda: mod.rmsnorm_ref(x, w, EPS))
    return OpCase(fused, eager, lambda: max_err(fused(), eager()), 2 * x.numel() * x.element_size())


def add_rmsnorm_case(
    kernels: dict[str, ModuleType], T: int, dtype: torch.dtype, device: torch.device
) -> OpCase:
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

    return OpCase(fused, eager, error, 4 * x.numel() * x.element_size())


def rotary_case(
    kernels: dict[str, ModuleType], T: int, dtype: torch.dtype, device: torch.device
) -> OpCase:
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

    return OpCase(fused, eager, error, 2 * T * (Q_SIZE + KV_SIZE) * qkv.element_size())


def silu_case(
    kernels: dict[str, ModuleType], T: int, dtype: torch.dtype, device: torch.device
) -> OpCase:
    mod = kernels["silu_mul_triton"]
    gate_up = torch.randn(T, 2 * INTER, device=device).to(dtype)  # [T, 2I]
    fused, eager = (lambda: mod.silu_and_mul(gate_up)), (lambda: mod.silu_and_mul_ref(gate_up))
    return OpCase(
        fused, eager, lambda: max_err(fused(), eager()), 3 * T * INTER * gate_up.element_size()
    )


OPS = {
    "rmsnorm": rmsnorm_case,
    "add_rmsnorm": add_rmsnorm_case,
    "rotary_qkv": rotary_case,
    "silu_and_mul": silu_case,
}


def bench_op(op: str, T: int, dtype: torch.dtype, device: torch.device, smoke: bool) -> OpRow:
    case = OPS[op](load_op_kernels(), T, dtype, device)
    err = case.error()  # before timing: the in-place rotary drifts its buffer while timed
    triton_ms, triton_graph_ms = time_ms(case.fused, smoke), graph_ms(case.fused, smoke)
    gpu_ms = triton_ms if triton_graph_ms is None else triton_graph_ms
    return OpRow(
        op=op,
        num_tokens=T,
        triton_ms=triton_ms,
        eager_ms=time_ms(case.eager, smoke),
        triton_graph_ms=triton_graph_ms,
        eager_graph_ms=graph_ms(case.eager, smoke),
        triton_gbps=case.num_bytes / (gpu_ms * 1e-3) / 1e9,
        max_abs_err=err,
    )


def fused_ops(dtype: torch.dtype, device: torch.device, smoke: bool) -> tuple[list, dict]:
    token_counts = (1, 3) if smoke else (1, 64, 256, 2048)
    rows = [bench_op(op, T, dtype, device, smoke) for op in OPS for T in token_counts]

    def ms(value: float | None) -> str:
        return f"{'-':>9}" if value is None else f"{value:9.4f}"

    head = f"{'op':13} {'T':>5} {'triton':>9} {'eager':>9} {'vs eager':>8}"
    print(head + f" {'graph tri':>9} {'graph eag':>9} {'GB/s':>7} {'err':>8}  (ms)")
    for r in rows:
        print(
            f"{r.op:13} {r.num_tokens:5d} {r.triton_ms:9.4f} {r.eager_ms:9.4f}"
            f" {r.eager_ms / r.triton_ms:7.1f}x {ms(r.triton_graph_ms)} {ms(r.eager_graph_ms)}"
            f" {r.triton_gbps:7.1f} {r.max_abs_err:8.1e}"
        )
    shapes = {"hidden_size": HIDDEN, "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS,
              "head_dim": HEAD_DIM, "intermediate_size": INTER}  # fmt: skip
    return rows, shapes


# ---- GEMV ---------------------------------------------------------------------------------

# (name, N, K) of each projection: nn.Linear's [out, in]
GEMV_SHAPES = {
    "smollm2-135m": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576),
                     ("down", 576, 1536)],
    "qwen3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096),
                 ("down", 4096, 12288), ("lm_head", 151936, 4096)],
}  # fmt: skip
L2_DEFEAT_BYTES = 512 << 20  # weight copies per chain: at least this many bytes, at least 2


@dataclass
class GemvRow:
    model: str
    proj: str
    n: int
    k: int
    num_tokens: int
    triton_us: float | None  # per call, replayed from a CUDA graph; None: smoke
    cublas_us: float | None
    triton_gbps: float | None  # weight bytes / time
    cublas_gbps: float | None
    max_abs_err: float


def bench_gemv_case(model: str, proj: str, n: int, k: int, T: int, dtype: torch.dtype,
                    device: torch.device, smoke: bool) -> GemvRow:  # fmt: skip
    from dspark.kernels.gemv_triton import gemv

    weight_bytes = n * k * torch.finfo(dtype).bits // 8
    copies = 1 if smoke else max(2, -(-L2_DEFEAT_BYTES // weight_bytes))
    weights = [torch.randn(n, k, dtype=dtype, device=device) * k**-0.5 for _ in range(copies)]
    x = torch.randn(T, k, dtype=dtype, device=device)
    out = torch.empty(T, n, dtype=dtype, device=device)
    err = max_err(gemv(x, weights[0], out=out), F.linear(x, weights[0]))

    def triton_chain() -> None:
        for w in weights:
            gemv(x, w, out=out)

    def cublas_chain() -> None:
        for w in weights:
            torch.mm(x, w.t(), out=out)

    if smoke:
        return GemvRow(model, proj, n, k, T, None, None, None, None, err)
    t_us = graph_ms(triton_chain, smoke) * 1e3 / copies
    c_us = graph_ms(cublas_chain, smoke) * 1e3 / copies
    return GemvRow(model, proj, n, k, T, t_us, c_us, weight_bytes / t_us / 1e3,
                   weight_bytes / c_us / 1e3, err)  # fmt: skip


def gemv_bench(dtype: torch.dtype, device: torch.device, smoke: bool) -> tuple[list, dict]:
    shapes = {"smollm2-135m": [("qkv", 24, 16)]} if smoke else GEMV_SHAPES
    token_counts = (1, 2) if smoke else (1, 2, 4, 8)
    rows = [bench_gemv_case(model, proj, n, k, T, dtype, device, smoke)
            for model, projections in shapes.items() for proj, n, k in projections
            for T in token_counts]  # fmt: skip
    bandwidth = None
    if not smoke:  # bytes read + written by a large copy, as real_target_shapes.py's floors
        from real_target_shapes import copy_bandwidth_gbs

        bandwidth = copy_bandwidth_gbs(device.type)
    if bandwidth is not None:
        print(f"copy bandwidth (read + written): {bandwidth:.0f} GB/s")
    print(f"{'model':13} {'proj':8} {'T':>2} {'triton us':>10} {'cuBLAS us':>10} "
          f"{'tri GB/s':>9} {'cuB GB/s':>9} {'tri/floor':>9} {'err':>8}")  # fmt: skip
    for r in rows:
        if r.triton_us is None:
            print(f"{r.model:13} {r.proj:8} {r.num_tokens:2d} (smoke) err {r.max_abs_err:.1e}")
            continue
        print(f"{r.model:13} {r.proj:8} {r.num_tokens:2d} {r.triton_us:10.1f} {r.cublas_us:10.1f}"
              f" {r.triton_gbps:9.0f} {r.cublas_gbps:9.0f}"
              f" {r.triton_gbps / bandwidth:9.2f} {r.max_abs_err:8.1e}")  # fmt: skip
    return rows, {"projections": shapes, "copy_gbps": bandwidth}


@dataclass
class GemvConfigRow:
    proj: str
    n: int
    k: int
    block_n: int | None  # None: cuBLAS
    block_k: int | None
    num_warps: int | None
    us: float | None  # per call, replayed from a CUDA graph; None: smoke
    gbps: float | None
    max_abs_err: float


# the default at Qwen3-8B's K (2 columns, K blocks of 1,024, 2 warps), then wider tiles
GEMV_SWEEP = [(2, 1024, 2)]
GEMV_SWEEP += [(bn, bk, w) for bn in (4, 8, 16) for bk in (512, 1024) for w in (4, 8)]


def gemv_configs(dtype: torch.dtype, device: torch.device, smoke: bool) -> tuple[list, dict]:
    from dspark.kernels.gemv_triton import default_config

    shapes = [("qkv", 24, 16)] if smoke else GEMV_SHAPES["qwen3-8b"][:4]
    sweep = GEMV_SWEEP[:2] if smoke else GEMV_SWEEP
    rows = []
    for proj, n, k in shapes:
        swept = _sweep_shape(proj, n, k, sweep, dtype, device, smoke)
        rows += swept
        if smoke:
            continue
        cublas, tiles = swept[0], swept[1:]
        best = min(tiles, key=lambda r: r.us)
        d = default_config(n, k)
        default = next(r for r in tiles if (r.block_n, r.block_k, r.num_warps) == (
            d.block_n, d.block_k, d.num_warps))  # fmt: skip
        print(f"{proj:8} cuBLAS {cublas.us:7.1f} us ({cublas.gbps:5.0f} GB/s)  best "
              f"({best.block_n}, {best.block_k}, {best.num_warps}) {best.us:7.1f} us "
              f"({best.gbps:5.0f} GB/s)  default {default.us:7.1f} us")  # fmt: skip
    return rows, {"projections": shapes, "sweep": sweep}


def _sweep_shape(proj: str, n: int, k: int, sweep: list, dtype: torch.dtype,
                 device: torch.device, smoke: bool) -> list[GemvConfigRow]:  # fmt: skip
    """cuBLAS's row, then one row per tile config, for one projection at one token row."""
    import triton

    from dspark.kernels.gemv_triton import GemvConfig, gemv

    weight_bytes = n * k * torch.finfo(dtype).bits // 8
    copies = 1 if smoke else max(2, -(-L2_DEFEAT_BYTES // weight_bytes))
    weights = [torch.randn(n, k, dtype=dtype, device=device) * k**-0.5 for _ in range(copies)]
    x = torch.randn(1, k, dtype=dtype, device=device)
    out = torch.empty(1, n, dtype=dtype, device=device)
    expected = F.linear(x, weights[0])

    def timed(one) -> tuple[float | None, float | None]:  # one(w): a call on one weight copy
        def chain() -> None:
            for w in weights:
                one(w)

        if smoke:
            chain()
            return None, None
        us = graph_ms(chain, smoke) * 1e3 / copies
        return us, weight_bytes / us / 1e3

    us, gbps = timed(lambda w: torch.mm(x, w.t(), out=out))
    rows = [GemvConfigRow(proj, n, k, None, None, None, us, gbps, 0.0)]
    for bn, bk, warps in sweep:
        cfg = GemvConfig(bn, min(bk, triton.next_power_of_2(k)), warps)
        err = max_err(gemv(x, weights[0], out=out, config=cfg), expected)
        us, gbps = timed(lambda w, cfg=cfg: gemv(x, w, out=out, config=cfg))
        rows.append(GemvConfigRow(proj, n, k, bn, cfg.block_k, warps, us, gbps, err))
    return rows


BENCHMARKS = {"attention": attention, "fused-ops": fused_ops, "gemv": gemv_bench,
              "gemv-configs": gemv_configs}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("which", choices=sorted(BENCHMARKS), help="which kernels")
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device (or --smoke for the CPU interpreter)")
        device, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    rows, shapes = BENCHMARKS[args.which](dtype, device, args.smoke)
    with open(args.out, "w") as f:
        json.dump({**environment(device, dtype, args.smoke, shapes),
                   "rows": [asdict(r) for r in rows]}, f)  # fmt: skip
    print(f"wrote {args.out}")


def environment(device: torch.device, dtype: torch.dtype, smoke: bool, shapes: dict) -> dict:
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    return {
        "device": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype),
        "smoke": smoke,
        "timer": "wall clock, one call" if smoke else "triton.testing.do_bench median",
        "shapes": shapes,
    }


if __name__ == "__main__":
    main()
