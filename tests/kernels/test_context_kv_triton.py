"""The drafter's folded context upkeep (models/folded_context.py, kernels/context_kv_triton.py)
writes the caches that fc, the context norm and each layer's k/v projection and rotary store
write (DSparkDrafter.append_context with the torch backend)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dspark.engine.kv_cache import allocate_kv_caches
from dspark.layers.rotary import rope_inv_freq
from dspark.models.drafter_config import DrafterConfig
from dspark.models.dspark_drafter import DSparkDrafter, target_identity
from dspark.models.llama import build_model
from dspark.models.model_config import ModelConfig
from tests.tiny_models import _llama_config, save_random_model

HASH = "0123456789abcdef"
PAGE, PAGES = 4, 8


def _target(tmp_path, device, arch="llama"):
    hf = _llama_config(96, arch, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                       intermediate_size=64)  # fmt: skip
    save_random_model(tmp_path, hf)
    config = ModelConfig.from_hf_dict(hf.to_dict() | {"architectures": [hf.architectures[0]]})
    return build_model(config, load_file(tmp_path / "model.safetensors"), torch.float32, device)


def _drafter(target, num_layers):
    config = DrafterConfig(target_identity(target, HASH), draft_len=4, target_layers=(0, 1),
                           num_layers=num_layers, markov_rank=8)  # fmt: skip
    torch.manual_seed(0)
    drafter = DSparkDrafter(config, target, HASH)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn_like(p))  # norm weights and biases away from 1 and 0
    return drafter.to(target.embed_tokens.weight.device).eval()


def _upkeep_inputs(device, T=11):
    g = torch.Generator().manual_seed(1)
    features = torch.randn(T, 64, generator=g).to(device)
    positions = torch.randint(0, 60, (T,), generator=g).to(device)
    slots = (torch.randperm(PAGES * PAGE - PAGE, generator=g)[:T] + PAGE).to(device)
    return features, positions, slots


def _caches(target, num_layers, device, order=None):
    """Layer caches as views of one block; `order` places layer l in block slot order[l]."""
    n = 2 * PAGES * PAGE * target.config.num_kv_heads * target.config.head_dim
    shape = (2, PAGES, PAGE, target.config.num_kv_heads, target.config.head_dim)
    order = order or list(range(num_layers))
    block = torch.zeros((max(order) + 1) * n, device=device)
    return [block[o * n : (o + 1) * n].view(shape) for o in order]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: k/v biases
@pytest.mark.parametrize(
    "num_layers, order",
    [(2, None), (3, [2, 1, 0]), (3, [0, 1, 3])],  # even, even and backwards, uneven (3 launches)
)
@torch.no_grad()
def test_folded_upkeep_writes_the_plain_caches(tmp_path, device, arch, num_layers, order):
    target = _target(tmp_path, device, arch)
    drafter = _drafter(target, num_layers)
    features, positions, slots = _upkeep_inputs(device)
    want = allocate_kv_caches(target.config, PAGES, PAGE, torch.float32, device, num_layers)
    drafter.append_context(features, positions, slots, want)  # the torch backend's seven ops
    got = _caches(target, num_layers, device, order)
    drafter.fold_context()(features, positions, slots, got)
    for g, w in zip(got, want, strict=True):
        assert w.abs().sum() > 0
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


@torch.no_grad()
def test_load_folds_the_context_for_the_triton_backend_only(tmp_path, device, set_envs):
    target = _target(tmp_path / "t", device)
    _drafter(target, 2).save(tmp_path / "d")
    load = lambda backend: DSparkDrafter.load(tmp_path / "d", target, HASH, backend)  # noqa: E731
    assert load("torch").folded_context is None
    folded = load("triton")
    assert folded.folded_context is not None
    assert "folded_context.proj.weight" not in folded.state_dict()  # the checkpoint is unchanged
    set_envs(reference_ops=True)
    assert load("triton").folded_context is None
    set_envs(reference_ops=False)
    # through append_context, the folded drafter writes what the plain one does
    features, positions, slots = _upkeep_inputs(device)
    caches = {}
    for name, drafter in (("plain", load("torch")), ("folded", folded)):
        caches[name] = allocate_kv_caches(target.config, PAGES, PAGE, torch.float32, device, 2)
        drafter.append_context(features, positions, slots, caches[name])
    for g, w in zip(caches["folded"], caches["plain"], strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@torch.no_grad()
def test_folded_upkeep_at_smollm2_shapes_in_bf16(tmp_path):
    """The shipped drafter's shapes (d 576, 3 of 64-wide kv heads, four taps, two layers) in
    bfloat16, compiled, one row and a prefill's worth: the fold rounds differently (its
    products are taken in float32 once), so the caches agree to bf16's precision."""
    device = torch.device("cuda")
    hf = _llama_config(512, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                       intermediate_size=128, num_hidden_layers=4)  # fmt: skip
    save_random_model(tmp_path, hf)
    config = ModelConfig.from_hf_dict(hf.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    target = build_model(config, load_file(tmp_path / "model.safetensors"), torch.bfloat16,
                         device, "triton")  # fmt: skip
    dc = DrafterConfig(target_identity(target, HASH), draft_len=7, target_layers=(0, 1, 2, 3),
                       num_layers=2, markov_rank=8)  # fmt: skip
    torch.manual_seed(0)
    drafter = DSparkDrafter(dc, target, HASH).to(device, torch.bfloat16).eval()
    drafter.layers[0].self_attn.rotary.inv_freq = rope_inv_freq(config).to(device)  # as load()
    for T in (1, 300):
        features = torch.randn(T, 4 * 576, device=device, dtype=torch.bfloat16)
        positions = torch.randint(0, 4000, (T,), device=device)
        slots = torch.randperm(64 * 16 - 16, device=device)[:T] + 16
        want = allocate_kv_caches(config, 64, 16, torch.bfloat16, device, 2)
        drafter.append_context(features, positions, slots, want)
        got = allocate_kv_caches(config, 64, 16, torch.bfloat16, device, 2)
        drafter.fold_context()(features, positions, slots, got)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.float(), w.float(), atol=3e-2, rtol=3e-2)
