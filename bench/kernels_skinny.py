"""Skinny GEMM micro-benchmark: each fused skinny kernel against the unfused launches it replaces,
and one decoder layer skinny against normal, all replayed from CUDA graphs.

    python bench/kernels_skinny.py --out kernels_skinny.json      # defaults + the layer test
    python bench/kernels_skinny.py --out sweep.json --ops o_proj,down --tokens 1,16 \\
        --block-n 16,32 --block-k 64,128 --split-k 1,2,4,8 --layers 0   # a tile sweep
    python bench/kernels_skinny.py --smoke --out /tmp/smoke.json  # CPU, interpreter, tiny

Every config is compiled for T = 1 (the GEMV), T = 16 and other T (tl.dot; Triton specializes
16), ~1-2 s each: keep a sweep's ops x configs x T small enough for the time you have.

SmolLM2-135M shapes (hidden 576, 9 heads, 3 kv heads, head_dim 64, intermediate 1536), bf16,
T in {1, 2, 4, 8, 16} token rows. Ops, each fused kernel against the sequence it replaces:

    qkv_add_rmsnorm   skinny_add_rmsnorm_linear  vs fused_add_rmsnorm + F.linear   N 960,  K 576
    qkv_rmsnorm       skinny_rmsnorm_linear      vs rmsnorm + F.linear (layer 0)   N 960,  K 576
    o_proj            skinny_linear              vs F.linear                       N 576,  K 576
    gate_up_add_rmsnorm  skinny_add_rmsnorm_linear vs fused_add_rmsnorm + F.linear N 3072, K 576
    down_silu_mul     skinny_silu_mul_linear     vs silu_and_mul + F.linear        N 576,  K 1536
    down              skinny_linear              vs F.linear                       N 576,  K 1536
    gate_up_silu      skinny_gate_up_silu        vs fused_add_rmsnorm + F.linear + silu_and_mul
                      (SiLU in the epilogue; N 1536 output columns of 2 x 1536 weight rows)
    qkv_rotary        skinny_qkv_rotary          vs fused_add_rmsnorm + F.linear + rotary_qkv
                      (rotary + KV store in the epilogue; one program per head, block_n unused)
    qkv_then_rotary   skinny_add_rmsnorm_linear + rotary_qkv (two launches), same baseline

The model's skinny layer runs qkv_rotary (with the rmsnorm prologue in layer 0), o_proj,
gate_up_silu and down; the other ops are the alternatives they were chosen over.

Timing: the calls are captured in one CUDA graph and replayed; a call's time is the replay's
CUDA-event time / calls, median over --replays. Each call reads its own copy of the weights, and
there are enough calls (at least --repeats) that the copies total --cold-mb (128 MB): beyond the
H200's 50 MB L2, so W comes from HBM as in the real decode step, whose 30 layers hold ~200 MB of
weights (--cold-mb 0: --repeats calls on one copy, W resident in L2).

Every op runs with its default config and with each config of the sweep grid (the product of
the --block-n, --block-k, --split-k, --num-warps, --use-gemv lists; "auto" keeps the default's
value; --use-gemv 0 runs T = 1 on tl.dot too). The layer comparison runs --layers decoder
layers (distinct weights, own KV caches, a decode batch of T rows at --context tokens) skinny
and normal, and reports us per layer and kernels per layer (torch.profiler on one eager pass).

--smoke runs tiny shapes on the CPU interpreter with a wall clock and no graph (T in {1, 3},
float32, two configs): its numbers mean nothing, it only proves the script runs end to end.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

EPS = 1e-5
PAGE_SIZE = 16


@dataclass(frozen=True)
class Shapes:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    inter: int

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


SMOLLM2 = Shapes(hidden=576, num_heads=9, num_kv_heads=3, head_dim=64, inter=1536)
TINY = Shapes(hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, inter=48)


@dataclass(frozen=True)
class OpCase:
    fused: Callable  # (weight copy index, SkinnyConfig) -> output tensor(s)
    unfused: Callable  # (weight copy index) -> output tensor(s)
    default: object  # the SkinnyConfig the model uses for this op
    uses_block_n: bool = True  # False: one program per head, block_n is not swept


@dataclass
class Row:
    op: str
    num_tokens: int
    variant: str  # "unfused", "skinny default" or "skinny sweep"
    config: dict | None  # the SkinnyConfig (None for unfused)
    us: float  # per call: graph replay time / calls in it (smoke: one wall-clock call)
    max_abs_err: float  # against the unfused sequence on the same inputs


def kernels() -> dict:
    # Imported late on purpose: --smoke sets TRITON_INTERPRET, which Triton reads when the
    # kernels are decorated, that is when their module is first imported.
    names = ("skinny_gemm_triton", "skinny_linear_triton", "skinny_qkv_rotary_triton",
             "skinny_gate_up_silu_triton", "rmsnorm_triton", "rotary_triton",
             "silu_mul_triton")  # fmt: skip
    return {n: importlib.import_module(f"dspark.kernels.{n}") for n in names}


def op_shape(op: str, s: Shapes) -> tuple[int, int]:  # (N, K) of the op's weight
    return {"qkv_add_rmsnorm": (s.qkv_size, s.hidden), "qkv_rmsnorm": (s.qkv_size, s.hidden),
            "o_proj": (s.hidden, s.hidden), "gate_up_add_rmsnorm": (2 * s.inter, s.hidden),
            "down_silu_mul": (s.hidden, s.inter), "down": (s.hidden, s.inter),
            "gate_up_silu": (2 * s.inter, s.hidden), "qkv_rotary": (s.qkv_size, s.hidden),
            "qkv_then_rotary": (s.qkv_size, s.hidden)}[op]  # fmt: skip


def num_calls(n: int, k: int, args: argparse.Namespace, dtype) -> tuple[int, int]:
    """(calls per graph, weight copies): enough distinct copies to total --cold-mb.
    qkv (960 x 576 bf16, 1.1 MB), --cold-mb 128, --repeats 30: 122 calls on 122 copies."""
    if args.cold_mb == 0:
        return args.repeats, 1
    weight_bytes = n * k * torch.finfo(dtype).bits // 8
    copies = max(args.repeats, -(-args.cold_mb * 2**20 // weight_bytes))
    return copies, copies


def op_case(op: str, s: Shapes, T: int, copies: int, dtype, device) -> OpCase:
    if op.startswith("qkv_") and "rotary" in op:
        return qkv_rotary_case(op, s, T, copies, dtype, device)
    if op == "gate_up_silu":
        return gate_up_silu_case(s, T, copies, dtype, device)
    k = kernels()
    sk, norm, silu = k["skinny_linear_triton"], k["rmsnorm_triton"], k["silu_mul_triton"]
    n, width = op_shape(op, s)
    default = k["skinny_gemm_triton"].default_config(n, width, device.type)
    ws = [randn((n, width), dtype, device, width**-0.5) for _ in range(copies)]  # [N, K] each
    norm_ws = [norm_weight(width, dtype, device) for _ in range(copies)]  # [K] each
    x, residual = randn((T, width), dtype, device), randn((T, width), dtype, device)  # [T, K]
    gate_up = randn((T, 2 * width), dtype, device)  # [T, 2I]
    if op == "qkv_rmsnorm":
        return OpCase(lambda i, c: sk.skinny_rmsnorm_linear(x, norm_ws[i], EPS, ws[i], None, c),
                      lambda i: F.linear(norm.rmsnorm(x, norm_ws[i], EPS), ws[i]),
                      default)  # fmt: skip
    if op in ("o_proj", "down"):
        return OpCase(lambda i, c: sk.skinny_linear(x, ws[i], None, c),
                      lambda i: F.linear(x, ws[i]), default)  # fmt: skip
    if op == "down_silu_mul":
        return OpCase(lambda i, c: sk.skinny_silu_mul_linear(gate_up, ws[i], None, c),
                      lambda i: F.linear(silu.silu_and_mul(gate_up), ws[i]), default)  # fmt: skip

    def fused(i: int, c) -> tuple[torch.Tensor, torch.Tensor]:
        return sk.skinny_add_rmsnorm_linear(x, residual, norm_ws[i], EPS, ws[i], None, c)

    def unfused(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, new_residual = norm.fused_add_rmsnorm(x, residual, norm_ws[i], EPS)
        return F.linear(h, ws[i]), new_residual

    return OpCase(fused, unfused, default)


def qkv_rotary_case(op: str, s: Shapes, T: int, copies: int, dtype, device) -> OpCase:
    """A later layer's qkv: add + norm, projection, rotary, K/V store of T decode rows (slots
    0 .. T-1 of a 1-page cache); outputs (rotated q [T, nh * hd], new residual)."""
    k = kernels()
    sk, fused_qkv = k["skinny_linear_triton"], k["skinny_qkv_rotary_triton"]
    norm, rotary = k["rmsnorm_triton"], k["rotary_triton"]
    n, width, q_size = s.qkv_size, s.hidden, s.num_heads * s.head_dim
    ws = [randn((n, width), dtype, device, width**-0.5) for _ in range(copies)]  # [N, d] each
    norm_ws = [norm_weight(width, dtype, device) for _ in range(copies)]
    x, residual = randn((T, width), dtype, device), randn((T, width), dtype, device)  # [T, d]
    positions = torch.randint(0, 4096, (T,), device=device)
    inv_freq = 1.0 / (1e5 ** (torch.arange(0, s.head_dim, 2, device=device) / s.head_dim))
    kv_cache = torch.zeros(2, 1, PAGE_SIZE, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
    slots = torch.arange(T, device=device)
    heads = (s.num_heads, s.num_kv_heads)

    def rotate(qkv: torch.Tensor, new_residual: torch.Tensor) -> tuple:
        rotary.rotary_qkv(qkv, positions, inv_freq, *heads, s.head_dim, kv_cache, slots)
        return qkv[:, :q_size], new_residual

    def fused(i: int, c) -> tuple[torch.Tensor, torch.Tensor]:
        if op == "qkv_then_rotary":
            return rotate(
                *sk.skinny_add_rmsnorm_linear(x, residual, norm_ws[i], EPS, ws[i], None, c)
            )
        return fused_qkv.skinny_qkv_rotary(x, residual, norm_ws[i], EPS, ws[i], None, positions,
                                           inv_freq, *heads, kv_cache, slots, c)  # fmt: skip

    def unfused(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, new_residual = norm.fused_add_rmsnorm(x, residual, norm_ws[i], EPS)
        return rotate(F.linear(h, ws[i]), new_residual)

    if op == "qkv_then_rotary":
        return OpCase(fused, unfused, k["skinny_gemm_triton"].default_config(n, width, device.type))
    default = fused_qkv.default_qkv_config(n // s.head_dim, width, device.type)
    return OpCase(fused, unfused, default, uses_block_n=False)


def gate_up_silu_case(s: Shapes, T: int, copies: int, dtype, device) -> OpCase:
    """A later layer's MLP input: add + norm, gate_up, SiLU-and-mul; outputs (act [T, I], new
    residual)."""
    k = kernels()
    fused_mlp = k["skinny_gate_up_silu_triton"]
    norm, silu = k["rmsnorm_triton"], k["silu_mul_triton"]
    ws = [randn((2 * s.inter, s.hidden), dtype, device, s.hidden**-0.5) for _ in range(copies)]
    norm_ws = [norm_weight(s.hidden, dtype, device) for _ in range(copies)]
    x, residual = randn((T, s.hidden), dtype, device), randn((T, s.hidden), dtype, device)

    def fused(i: int, c) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_mlp.skinny_gate_up_silu(x, residual, norm_ws[i], EPS, ws[i], None, c)

    def unfused(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, new_residual = norm.fused_add_rmsnorm(x, residual, norm_ws[i], EPS)
        return silu.silu_and_mul(F.linear(h, ws[i])), new_residual

    default = k["skinny_gemm_triton"].default_config(s.inter, s.hidden, device.type)
    return OpCase(fused, unfused, default)


def randn(shape: tuple[int, ...], dtype, device, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(shape, device=device)).to(dtype)


def norm_weight(width: int, dtype, device) -> torch.Tensor:  # [width]
    return (1 + 0.1 * torch.randn(width, device=device)).to(dtype)


OPS = ("qkv_rotary", "qkv_rmsnorm", "o_proj", "gate_up_silu", "down", "qkv_add_rmsnorm",
       "qkv_then_rotary", "gate_up_add_rmsnorm", "down_silu_mul")  # fmt: skip


# -- timing ----------------------------------------------------------------------------------


def graph_us(calls: list[Callable[[], object]], replays: int, smoke: bool) -> float:
    """GPU time per call of `calls` captured in one CUDA graph (median over replays)."""
    if smoke:
        calls[0]()  # warm-up
        start = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - start) * 1e6
    for call in calls:  # compiles, allocates the split-K counters, settles cuBLAS
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(replays + 3):  # 3 warm-up replays
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def max_err(got, expected) -> float:
    pairs = zip(got, expected, strict=True) if isinstance(got, tuple) else [(got, expected)]
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs)  # sync: bench only


def sweep_configs(args: argparse.Namespace, case: OpCase) -> list:
    """The grid of the sweep lists; "auto" keeps the default's value for that field."""
    default = case.default
    fields = ("block_n", "block_k", "split_k", "num_warps", "use_gemv")
    if not case.uses_block_n:  # one program per head: block_n means nothing, keep the default
        fields = fields[1:]
    lists = [getattr(args, f) or [getattr(default, f)] for f in fields]
    configs = [replace(default, **dict(zip(fields, values, strict=True))) for values in
               itertools.product(*lists)]  # fmt: skip
    return [c for c in dict.fromkeys(configs) if c != default]


def bench_op(op: str, T: int, args: argparse.Namespace, s: Shapes, dtype, device) -> list[Row]:
    calls, num_copies = num_calls(*op_shape(op, s), args, dtype)
    case = op_case(op, s, T, num_copies, dtype, device)
    copies = [i % num_copies for i in range(calls)]  # call i reads weight copy copies[i]
    unfused_us = graph_us([partial(case.unfused, c) for c in copies], args.replays, args.smoke)
    rows = [Row(op, T, "unfused", None, unfused_us, 0.0)]
    for variant, config in [("skinny default", case.default)] + [
        ("skinny sweep", c) for c in sweep_configs(args, case)
    ]:
        calls = [partial(case.fused, c, config) for c in copies]
        us = graph_us(calls, args.replays, args.smoke)
        err = max_err(case.fused(0, config), case.unfused(0))
        rows.append(Row(op, T, variant, asdict(config), us, err))
    return rows


# -- one decoder layer, skinny vs normal -----------------------------------------------------


def smollm2_like_config(s: Shapes):
    from dspark.models.model_config import ModelConfig

    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=s.hidden,
        intermediate_size=s.inter, num_layers=30, num_heads=s.num_heads,
        num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, rms_norm_eps=EPS, rope_theta=1e5,
        max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
    )  # fmt: skip


def decode_metadata(T: int, context: int, device: torch.device):
    """T requests decoding one token each at position context - 1; request r owns pages
    r * P + 1 .. (r + 1) * P (P = cdiv(context, PAGE_SIZE)); page 0 is scratch."""
    from dspark.layers.attention_metadata import AttentionMetadata

    pages = -(-context // PAGE_SIZE)
    block_table = 1 + torch.arange(T * pages, device=device).view(T, pages)  # [T, P]
    last = context - 1
    slots = block_table[:, last // PAGE_SIZE].long() * PAGE_SIZE + last % PAGE_SIZE  # [T]
    attn = AttentionMetadata(
        cu_num_tokens=torch.arange(T + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((T,), context, dtype=torch.int32, device=device),
        slot_mapping=slots,
        block_table=block_table.to(torch.int32),
        cu_num_tokens_cpu=tuple(range(T + 1)),
        seq_lens_cpu=(context,) * T,
    )
    return attn, torch.full((T,), last, device=device), 1 + T * pages


def layer_stack(args: argparse.Namespace, s: Shapes, T: int, dtype, device) -> Callable:
    """(skinny) -> the stream after --layers decoder layers, from fixed inputs."""
    from dspark.layers.rotary import RotaryEmbedding, rope_inv_freq
    from dspark.models.llama import DecoderLayer

    config = smollm2_like_config(s)
    with torch.device(device):
        rotary = RotaryEmbedding(config)
        layers = [DecoderLayer(config, rotary, "triton").to(dtype) for _ in range(args.layers)]
    rotary.inv_freq = rope_inv_freq(config).to(device)  # .to(dtype) rounded the shared buffer
    attn, positions, num_pages = decode_metadata(T, args.context, device)
    kv_shape = (2, num_pages, PAGE_SIZE, s.num_kv_heads, s.head_dim)
    kv_caches = [torch.randn(kv_shape, device=device).to(dtype) for _ in layers]
    x0, residual0 = torch.randn(T, s.hidden, device=device).to(dtype), None

    def run(skinny: bool) -> torch.Tensor:  # [T, d]
        x, residual = x0, residual0
        for layer, kv in zip(layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, kv, attn, skinny)
        return x + residual

    return run


def kernels_per_layer(run: Callable, skinny: bool, num_layers: int) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(skinny)
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.device_type == cuda for e in prof.events()) / num_layers


def bench_layers(args: argparse.Namespace, s: Shapes, dtype, device) -> list[dict]:
    rows = []
    for T in args.layer_tokens if args.layers > 0 else []:
        run = layer_stack(args, s, T, dtype, device)
        err = max_err(run(True), run(False))
        for skinny in (False, True):
            us = graph_us([partial(run, skinny)], args.replays, args.smoke)
            rows.append({
                "num_tokens": T, "skinny": skinny, "us_per_layer": us / args.layers,
                "kernels_per_layer": None if args.smoke else
                kernels_per_layer(run, skinny, args.layers),
                "max_abs_err_vs_normal": err,
            })  # fmt: skip
    return rows


# -- report ----------------------------------------------------------------------------------


def summary(rows: list[Row]) -> list[dict]:
    """Per (op, T): the unfused time, the default skinny time, and the best config swept."""
    out = []
    for (op, T), group in itertools.groupby(rows, key=lambda r: (r.op, r.num_tokens)):
        group = list(group)
        unfused = next(r for r in group if r.variant == "unfused")
        default = next(r for r in group if r.variant == "skinny default")
        best = min((r for r in group if r.variant != "unfused"), key=lambda r: r.us)
        out.append({"op": op, "num_tokens": T, "unfused_us": unfused.us, "default_us": default.us,
                    "best_us": best.us, "best_config": best.config,
                    "speedup_default": unfused.us / default.us,
                    "speedup_best": unfused.us / best.us})  # fmt: skip
    return out


def print_report(table: list[dict], layers: list[dict]) -> None:
    print(f"{'op':20} {'T':>3} {'unfused':>8} {'default':>8} {'best':>8} {'x def':>6}"
          f" {'x best':>6}  best config   (us per call)")  # fmt: skip
    for r in table:
        c = r["best_config"]
        tiles = f"n{c['block_n']} k{c['block_k']} s{c['split_k']} w{c['num_warps']}"
        print(f"{r['op']:20} {r['num_tokens']:3d} {r['unfused_us']:8.2f} {r['default_us']:8.2f}"
              f" {r['best_us']:8.2f} {r['speedup_default']:5.2f}x {r['speedup_best']:5.2f}x"
              f"  {tiles} {'gemv' if c['use_gemv'] else 'dot'}")  # fmt: skip
    for r in layers:
        kernels = "-" if r["kernels_per_layer"] is None else f"{r['kernels_per_layer']:.1f}"
        print(f"layer T={r['num_tokens']:<3d} {'skinny' if r['skinny'] else 'normal':6}"
              f" {r['us_per_layer']:8.2f} us/layer  {kernels} kernels/layer"
              f"  err {r['max_abs_err_vs_normal']:.1e}")  # fmt: skip


def int_list(text: str) -> list[int] | None:
    return None if text == "auto" else [int(v) for v in text.split(",")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="where to write the JSON results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + str(OPS))
    p.add_argument("--tokens", type=int_list, default=[1, 2, 4, 8, 16], help="T values")
    for name in ("block-n", "block-k", "split-k", "num-warps", "use-gemv"):
        p.add_argument(f"--{name}", type=int_list, default=None,
                       help="comma-separated sweep values (default: auto)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=30, help="least calls per CUDA graph")
    p.add_argument("--cold-mb", type=int, default=128, help="weight copies' total (0: one)")
    p.add_argument("--replays", type=int, default=50, help="timed graph replays (median)")
    p.add_argument("--layers", type=int, default=30, help="layers in the layer test (0: none)")
    p.add_argument("--layer-tokens", type=int_list, default=[1], help="T of the layer test")
    p.add_argument("--context", type=int, default=512, help="KV tokens per request (layer test)")
    args = p.parse_args()
    if args.smoke:  # tiny and quick: the interpreter runs every call
        args.tokens, args.layer_tokens, args.repeats, args.cold_mb = [1, 3], [1, 3], 1, 0
        args.layers, args.context, args.replays = min(args.layers, 2), 24, 1
        args.block_n, args.split_k = args.block_n or [16], args.split_k or [1, 2]
    return args


def main() -> None:
    args = parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        device, dtype, shapes = torch.device("cpu"), torch.float32, TINY
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device (or --smoke for the CPU interpreter)")
        device, dtype, shapes = torch.device("cuda"), torch.bfloat16, SMOLLM2
    torch.manual_seed(0)
    with torch.inference_mode():
        rows = [r for op in args.ops.split(",") for T in args.tokens
                for r in bench_op(op, T, args, shapes, dtype, device)]  # fmt: skip
        layers = bench_layers(args, shapes, dtype, device)
    table = summary(rows)
    print_report(table, layers)
    result = {**environment(args, device, dtype, shapes), "summary": table, "layers": layers,
              "rows": [asdict(r) for r in rows]}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


def environment(args: argparse.Namespace, device: torch.device, dtype, shapes: Shapes) -> dict:
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    timer = "wall clock, one call" if args.smoke else "CUDA graph of >= --repeats calls, events"
    return {"device": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "dtype": str(dtype), "smoke": args.smoke, "timer": timer, "shapes": asdict(shapes),
            "args": {k: v for k, v in vars(args).items() if k != "out"}}  # fmt: skip


if __name__ == "__main__":
    main()
