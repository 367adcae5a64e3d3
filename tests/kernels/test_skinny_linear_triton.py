"""The skinny linear kernels (a prologue fused into a GEMM over T <= 16 rows) against their
PyTorch references, and the model's skinny decode path against the torch backend.

On the CPU (Triton's interpreter) the shapes are tiny and the tiles are forced small, so K and
N each span several blocks with a ragged tail: K 72 = 32 + 32 + 8, N 40 = 16 + 16 + 8. On a GPU
the same tests run at SmolLM2-135M's shapes with the default tiles. The interpreter rounds
float32 -> bfloat16 by truncation where GPUs round to nearest even, so each bf16 rounding step
may land one ulp off the reference on the CPU: the CPU bf16 tolerance allows for it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dspark.engine.kv_cache import allocate_kv_caches
from dspark.kernels import skinny_gate_up_silu_triton, skinny_qkv_rotary_triton
from dspark.kernels import skinny_linear_triton as skinny
from dspark.kernels.rmsnorm_triton import fused_add_rmsnorm_ref, rmsnorm_ref
from dspark.kernels.silu_mul_triton import silu_and_mul_ref
from dspark.kernels.skinny_gemm_triton import (
    PROLOGUES,
    LaunchPlan,
    SkinnyConfig,
    arrival_counters,
    default_config,
    launch_plan,
)
from dspark.layers.attention_metadata import AttentionMetadata
from dspark.models.llama import build_model
from dspark.models.model_config import ModelConfig
from tests.tiny_models import _llama_config, save_random_model

EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16]
# prologue -> (N, K) of its SmolLM2 projection: qkv, qkv (first layer), o_proj, down_proj
GPU_SHAPES = {"add_rmsnorm": (960, 576), "rmsnorm": (960, 576), "none": (576, 576),
              "silu_mul": (576, 1536)}  # fmt: skip
CPU_SHAPE = (40, 72)


def tolerance(dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    if dtype == torch.float32:  # only the order of float32 additions differs
        return {"rtol": 1e-4, "atol": 1e-4}
    # outputs are O(1): one bf16 ulp there is 2^-7; truncation on the CPU may add one per step
    return {"rtol": 1.6e-2, "atol": 4e-2 if device.type == "cpu" else 1.6e-2}


def shape_and_configs(prologue: str, device: torch.device, T: int = 3) -> tuple[int, int, list]:
    """(N, K, configs): on the CPU small tiles with and without split-K; on a GPU the defaults
    and other tiles. With one row also tl.dot on it (it runs the GEMV by default)."""
    if device.type == "cpu":
        n, k = CPU_SHAPE
        configs = [SkinnyConfig(block_n=16, block_k=32, split_k=s) for s in (1, 3)]
    else:
        n, k = GPU_SHAPES[prologue]
        configs = [None, SkinnyConfig(block_n=32, block_k=128, split_k=2)]
    if T == 1:
        configs.append(SkinnyConfig(block_n=16, block_k=32, split_k=2, use_gemv=False))
    return n, k, configs


def operands(T: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(T * 1000 + n)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g, device=device)).to(dtype)

    wide = randn(T, 2 * k + 24)  # [T, 2K + 24]: x rows with a row stride wider than K
    return {
        "x": wide[:, 8 : 8 + k],  # [T, K], strided rows
        "gate_up": wide[:, 8 : 8 + 2 * k],  # [T, 2K], strided rows
        "residual": randn(T, k),  # [T, K]
        "norm_weight": (1 + randn(k, scale=0.2).float()).to(dtype),  # [K]
        "weight": randn(n, k, scale=k**-0.5),  # [N, K]: outputs of order 1
        "bias": randn(n),  # [N]
    }


def run(prologue: str, ops: dict, bias: torch.Tensor | None, config: SkinnyConfig | None):
    """(kernel outputs, reference outputs) as tuples."""
    w = ops["weight"]
    if prologue == "none":
        return (skinny.skinny_linear(ops["x"], w, bias, config),), (
            skinny.skinny_linear_ref(ops["x"], w, bias),
        )
    if prologue == "rmsnorm":
        args = (ops["x"], ops["norm_weight"], EPS, w, bias)
        return (skinny.skinny_rmsnorm_linear(*args, config),), (skinny.rmsnorm_linear_ref(*args),)
    if prologue == "add_rmsnorm":
        args = (ops["x"], ops["residual"], ops["norm_weight"], EPS, w, bias)
        return skinny.skinny_add_rmsnorm_linear(*args, config), skinny.add_rmsnorm_linear_ref(*args)
    return (skinny.skinny_silu_mul_linear(ops["gate_up"], w, bias, config),), (
        skinny.silu_mul_linear_ref(ops["gate_up"], w, bias),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,has_bias", [(1, False), (3, True), (16, True)])
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_matches_reference(
    device: torch.device, prologue: str, T: int, has_bias: bool, dtype: torch.dtype
):
    n, k, configs = shape_and_configs(prologue, device, T)
    ops = operands(T, n, k, dtype, device)
    bias = ops["bias"] if has_bias else None
    residual_before = ops["residual"].clone()
    for config in configs:
        got, expected = run(prologue, ops, bias, config)
        for g, e in zip(got, expected, strict=True):  # y [T, N] (and the new residual [T, K])
            assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, e.shape, g.dtype)
            torch.testing.assert_close(g, e, **tolerance(dtype, device), msg=str(config))
    assert torch.equal(ops["residual"], residual_before)  # the new residual is a new tensor


def unfused_prologue(prologue: str, ops: dict) -> torch.Tensor:  # [T, K], the GEMM's input
    if prologue == "none":
        return ops["x"]
    if prologue == "rmsnorm":
        return rmsnorm_ref(ops["x"], ops["norm_weight"], EPS)
    if prologue == "add_rmsnorm":
        return fused_add_rmsnorm_ref(ops["x"], ops["residual"], ops["norm_weight"], EPS)[0]
    return silu_and_mul_ref(ops["gate_up"])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])  # the GEMV and tl.dot
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_rounds_like_the_unfused_path_on_gpu(prologue: str, T: int):
    # Against the unfused prologue's bf16 output multiplied in float32 and rounded once: only
    # the order of float32 additions differs, so nearly every bf16 output is bit-identical. A
    # rounding step skipped or added in the prologue would move far more of them. (Not on the
    # CPU: the interpreter rounds by truncation.)
    device = torch.device("cuda")
    n, k, _ = shape_and_configs(prologue, device)
    ops = operands(T, n, k, torch.bfloat16, device)
    w, bias = ops["weight"], ops["bias"]
    (got, *_), _ = run(prologue, ops, bias, None)
    gemm_input = unfused_prologue(prologue, ops)  # [T, K] bf16
    expected = F.linear(gemm_input.float(), w.float(), bias.float()).to(torch.bfloat16)
    assert (got == expected).float().mean().item() > 0.99


def test_new_residual_is_the_rounded_sum(device: torch.device):
    # x + residual rounded once to bf16, bit for bit: to nearest even on a GPU, by truncation
    # (the low 16 bits of the float32 sum dropped) in the CPU interpreter
    n, k, configs = shape_and_configs("add_rmsnorm", device)
    ops = operands(3, n, k, torch.bfloat16, device)
    x, residual = ops["x"], ops["residual"]
    total = x.float() + residual.float()  # [T, K], exact
    if device.type == "cuda":
        expected = total.to(torch.bfloat16)
    else:
        expected = (total.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    for config in configs:
        _, new_residual = skinny.skinny_add_rmsnorm_linear(
            x, residual, ops["norm_weight"], EPS, ops["weight"], None, config
        )
        assert torch.equal(new_residual, expected)


def test_split_k_resets_its_counters_and_repeats(device: torch.device):
    # Every launch leaves the arrival counters at zero, so the next (e.g. a graph replay) sees
    # a clean start and gives the same, deterministic result.
    n, k, configs = shape_and_configs("silu_mul", device)
    config = configs[1]
    assert config.split_k > 1
    ops = operands(5, n, k, torch.float32, device)
    first = skinny.skinny_silu_mul_linear(ops["gate_up"], ops["weight"], ops["bias"], config)
    counters = arrival_counters(device, 1)
    assert not counters.any()
    second = skinny.skinny_silu_mul_linear(ops["gate_up"], ops["weight"], ops["bias"], config)
    assert torch.equal(first, second) and not counters.any()


def test_no_rows(device: torch.device):
    x = torch.empty(0, 32, device=device)
    w = torch.randn(16, 32, device=device)
    assert skinny.skinny_linear(x, w).shape == (0, 16)
    y, new_residual = skinny.skinny_add_rmsnorm_linear(x, x, torch.ones(32, device=device), EPS, w)
    assert y.shape == (0, 16) and new_residual.shape == (0, 32)


def test_bad_config_and_too_many_rows(device: torch.device):
    x, w = torch.randn(2, 32, device=device), torch.randn(16, 32, device=device)
    with pytest.raises(ValueError, match="block_n 24"):
        skinny.skinny_linear(x, w, config=SkinnyConfig(block_n=24))
    with pytest.raises(ValueError, match="split_k 0"):
        skinny.skinny_linear(x, w, config=SkinnyConfig(split_k=0))
    with pytest.raises(AssertionError, match="at most 16"):
        skinny.skinny_linear(torch.randn(17, 32, device=device), w)


def test_default_config_fills_an_h200():
    # the docstring's numbers: programs = cdiv(N, 16) column blocks x K splits
    assert default_config(3072, 576) == SkinnyConfig(block_n=16, block_k=64, split_k=1)
    assert default_config(960, 576).split_k == 3
    assert default_config(576, 1536) == SkinnyConfig(block_n=16, block_k=128, split_k=4)
    assert default_config(40, 72).block_k == 128  # no power of two >= 16 divides 72


def test_launch_plan_has_no_empty_split():
    # the launch_plan docstring: K 576 in parts of 192 (3 splits, not 4); K 1536 in 4 of 384
    config = SkinnyConfig(block_k=64, split_k=4)
    assert launch_plan(config, 1, 576) == LaunchPlan(1, False, 3, 192)
    assert launch_plan(replace(config, block_k=128), 5, 1536) == LaunchPlan(16, True, 4, 384)


# -- the model's skinny path -----------------------------------------------------------------

PAGE_SIZE = 4
BLOCK_TABLE = [[1, 2, 3], [4, 5, 0], [6, 7, 8]]  # pages of requests 0, 1, 2 (0: scratch, unused)


def step_metadata(
    num_cached: list[int], q_lens: list[int], device: torch.device
) -> tuple[AttentionMetadata, torch.Tensor]:  # the step's metadata, positions [T]
    """Request r (of the first len(q_lens)) appends q_lens[r] tokens after its num_cached[r].

    num_cached [7, 5, 9], q_lens [1, 1, 1] (a decode batch), PAGE_SIZE 4:
      positions:     [7, 5, 9]
      slot_mapping:  [2*4 + 3, 5*4 + 1, 8*4 + 1] = [11, 21, 33]   (page BLOCK_TABLE[r][pos // 4])
    """
    positions = [c + j for c, q in zip(num_cached, q_lens, strict=True) for j in range(q)]
    owners = [r for r, q in enumerate(q_lens) for _ in range(q)]
    slots = [BLOCK_TABLE[r][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
             for r, p in zip(owners, positions, strict=True)]  # fmt: skip
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    seq_lens = [c + q for c, q in zip(num_cached, q_lens, strict=True)]
    attn = AttentionMetadata(
        cu_num_tokens=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, device=device),
        block_table=torch.tensor(BLOCK_TABLE[: len(q_lens)], dtype=torch.int32, device=device),
        cu_num_tokens_cpu=tuple(cu),
        seq_lens_cpu=tuple(seq_lens),
    )
    return attn, torch.tensor(positions, device=device)


PREFILL_LENS = [7, 5, 9]  # 21 tokens: more than 16, the unfused path
# a decoder layer's skinny launches: norm + qkv + rotary + store, o_proj, norm + gate_up + silu,
# down
LAYER_LAUNCHES = ["qkv_rotary", "none", "gate_up_silu", "none"]


def prefill_then_decode(model, kv: list[torch.Tensor], device: torch.device) -> tuple:
    """A ragged prefill of 3 requests, one decode token each (T 3: the skinny path with
    tl.dot), then one more for request 0 alone (T 1: the GEMV). Returns the tensors to compare:
    every step's logits, the first decode's taps and the KV caches."""
    ids = torch.randint(0, 128, (25,), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        attn, positions = step_metadata([0, 0, 0], PREFILL_LENS, device)
        last_rows = torch.tensor([6, 11, 20], device=device)
        prefill = model(ids[:21], positions, attn, kv, last_rows)
        attn, positions = step_metadata(PREFILL_LENS, [1, 1, 1], device)
        decode = model(ids[21:24], positions, attn, kv, None, (0, 1))
        attn, positions = step_metadata([8], [1], device)  # request 0 alone
        single = model(ids[24:], positions, attn, kv)
    taps = (decode.hidden_states[0], decode.hidden_states[1])
    return (prefill.logits, decode.logits, single.logits, *taps, *kv)


def record_skinny_launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Wraps the skinny entry points: each call appends its name (the prologue for
    skinny_linear's) to the returned list, then runs as before."""
    launches = []
    launch, qkv_rotary = skinny._launch, skinny_qkv_rotary_triton.skinny_qkv_rotary
    gate_up_silu = skinny_gate_up_silu_triton.skinny_gate_up_silu
    monkeypatch.setattr(skinny, "_launch", lambda *a: launches.append(a[0]) or launch(*a))
    monkeypatch.setattr(skinny_qkv_rotary_triton, "skinny_qkv_rotary",
                        lambda *a: launches.append("qkv_rotary") or qkv_rotary(*a))  # fmt: skip
    monkeypatch.setattr(skinny_gate_up_silu_triton, "skinny_gate_up_silu",
                        lambda *a: launches.append("gate_up_silu") or gate_up_silu(*a))  # fmt: skip
    return launches


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: a qkv bias
def test_skinny_model_matches_torch_backend(tmp_path, device, monkeypatch, arch: str):
    # fp32, so only the order of float32 additions differs: tight tolerance
    monkeypatch.setenv("DSPARK_SKINNY", "1")  # the skinny path is opt-in
    hf_config = _llama_config(128, arch, num_attention_heads=6, num_key_value_heads=2,
                              hidden_size=96, intermediate_size=80)  # fmt: skip
    save_random_model(tmp_path, hf_config)
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    assert config.attention_bias == (arch == "qwen2")
    weights = load_file(tmp_path / "model.safetensors")
    launches = record_skinny_launches(monkeypatch)
    outputs = {}
    for backend in ("torch", "triton"):
        model = build_model(config, weights, torch.float32, device, backend)
        kv = allocate_kv_caches(config, 9, PAGE_SIZE, torch.float32, device)
        outputs[backend] = prefill_then_decode(model, kv, device)
    for got, want in zip(outputs["triton"], outputs["torch"], strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # the skinny kernels ran in the triton backend's two decode steps only, four per layer
    assert launches == LAYER_LAUNCHES * config.num_layers * 2
