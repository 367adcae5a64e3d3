"""Rotary position embedding (HF "rotate half" layout) with default, linear and llama3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from dspark.models.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], float32, after the checkpoint's rope scaling; on the
    CPU whatever the default device (build_model builds under the meta device, where arange goes
    through torch._refs, whose first use imports torch._dynamo: ~4 s of a CPU start)."""
    dim = config.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu")
    inv_freq = 1.0 / (config.rope_theta ** (steps / dim))
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif config.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between
    # interpolated smoothly.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(is_mid, mid, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, nh, hd]; k [T, nkv, hd]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, hd]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
