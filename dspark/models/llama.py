"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2): the target model.

One forward runs any ragged mix of prefill chunks, decode tokens and verify windows. It returns
logits only for the rows asked for (`logits_indices`) and, on request, the residual stream after
chosen decoder layers (the DSpark drafter's context features).

With the triton backend and DSPARK_SKINNY=1, a step of at most SKINNY_MAX_ROWS (16) tokens runs
the skinny decoder layers (dspark/kernels/skinny_*_triton.py): the norms fused into the qkv and
gate_up projections, rotary and the K/V store into qkv's epilogue, the SiLU-and-mul into
gate_up's: 4 launches per layer besides attention, not 8. The token count is known on the host
from the input's shape (and fixed inside a CUDA graph), so the whole step takes one path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.layers.attention import Attention
from dspark.layers.attention_metadata import AttentionMetadata
from dspark.layers.linear import Linear
from dspark.layers.norm import RMSNorm
from dspark.layers.rotary import RotaryEmbedding, rope_inv_freq
from dspark.models.model_config import ModelConfig


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [N, vocab] float32, one row per logits index; None: lm_head=False
    hidden_states: dict[int, torch.Tensor]  # layer -> [T, d], output of that decoder layer
    final_hidden: torch.Tensor | None = None  # [N, d] after the final norm, with lm_head=False


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, use_triton: bool) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False,
                                   use_triton)  # fmt: skip
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, use_triton)
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, d] -> [T, d]
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.use_triton:
            from dspark.kernels.silu_mul_triton import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual add is deferred into the next norm (one fused kernel):
    takes (x, residual) with the stream = x + residual, returns the same pair after the block.
    `skinny` (triton backend, T <= 16) runs the same block in the fused skinny kernels.
    """

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: str) -> None:
        super().__init__()
        use_triton = backend == "triton"
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, use_triton)
        self.self_attn = Attention(config, rotary, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, use_triton)
        self.mlp = MLP(config, use_triton)

    def forward(
        self,
        x: torch.Tensor,  # [T, d]
        residual: torch.Tensor | None,  # [T, d]; None in the first layer (stream = x)
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        skinny: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if skinny:
            return self._skinny_forward(x, residual, positions, kv_cache, attn)
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        x = self.self_attn(h, positions, kv_cache, attn)
        h, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(h), residual

    def _skinny_forward(
        self,
        x: torch.Tensor,  # [T, d], T <= 16
        residual: torch.Tensor | None,  # [T, d]
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # launches: [add_rmsnorm + qkv + rotary + KV store], attention, [o_proj],
        # [add_rmsnorm + gate_up + silu_mul], [down]
        from dspark.kernels.skinny_gate_up_silu_triton import skinny_gate_up_silu
        from dspark.kernels.skinny_linear_triton import skinny_linear

        attn_layer, mlp, norm = self.self_attn, self.mlp, self.post_attention_layernorm
        q, residual = self._skinny_qkv(x, residual, positions, kv_cache, attn)  # [T, q_size]
        o = attn_layer.attend_stored(q, kv_cache, attn)  # [T, q_size]
        x = skinny_linear(o, attn_layer.o_proj.weight)  # [T, d]
        act, residual = skinny_gate_up_silu(x, residual, norm.weight, norm.eps,
                                            mlp.gate_up_proj.weight)  # fmt: skip
        return skinny_linear(act, mlp.down_proj.weight), residual  # [T, d], [T, d]

    def _skinny_qkv(
        self,
        x: torch.Tensor,  # [T, d]
        residual: torch.Tensor | None,  # [T, d]; None in the first layer (stream = x)
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # rotated q [T, q_size], the stream [T, d]
        from dspark.kernels.skinny_qkv_rotary_triton import skinny_qkv_rotary

        norm, a = self.input_layernorm, self.self_attn
        q, new_residual = skinny_qkv_rotary(
            x, residual, norm.weight, norm.eps, a.qkv_proj.weight, a.qkv_proj.bias, positions,
            a.rotary.inv_freq, a.num_heads, a.num_kv_heads, kv_cache, attn.slot_mapping,
        )  # fmt: skip
        return q, x if residual is None else new_residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, attention_backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary, attention_backend) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, attention_backend == "triton")
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Off unless DSPARK_SKINNY=1: on the H200 (bench/kernels_skinny.py, docs/PERFORMANCE.md)
        # the skinny kernels do not yet beat cuBLAS + the separate small kernels.
        self.use_skinny = attention_backend == "triton" and os.environ.get("DSPARK_SKINNY") == "1"

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_pages, page_size, nkv, hd]
        logits_indices: torch.Tensor | None = None,  # [N] rows of T to score; None: all
        hidden_layers: tuple[int, ...] = (),
        lm_head: bool = True,  # False: final_hidden instead of logits (drafter training)
    ) -> ModelOutput:
        x = self.embed_tokens(input_ids)  # [T, d]
        residual = None
        hidden_states = {}
        skinny = self._is_skinny(input_ids.shape[0])
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, kv_caches[i], attn, skinny)
            if i in hidden_layers:
                hidden_states[i] = x + residual  # the stream after layer i
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]  # [N, d]
        h, _ = self.norm(x, residual)
        if not lm_head:
            return ModelOutput(None, hidden_states, final_hidden=h)
        logits = self.lm_head(h).float()  # [N, vocab]
        return ModelOutput(logits, hidden_states)

    def _is_skinny(self, num_tokens: int) -> bool:
        if not self.use_skinny:
            return False
        from dspark.kernels.skinny_gemm_triton import SKINNY_MAX_ROWS

        return num_tokens <= SKINNY_MAX_ROWS

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up. Every parameter must be covered."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, w in _fuse(weights, self.config).items():
            key = name.removeprefix("model.")
            if key not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {self.config.architecture}"
                )
            if params[key].shape != w.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(w.shape)}, "
                    f"expected {tuple(params[key].shape)}"
                )
            params[key].copy_(w)
            loaded.add(key)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:5]}")


def _fuse(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    out = dict(weights)
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            names = [f"{p}self_attn.{n}_proj.{kind}" for n in "qkv"]
            if all(n in out for n in names):
                out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat([out.pop(n) for n in names])
        gate_up = [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
        if all(n in out for n in gate_up):
            out[f"{p}mlp.gate_up_proj.weight"] = torch.cat([out.pop(n) for n in gate_up])
    return out


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str = "torch",
) -> LlamaForCausalLM:
    """Instantiate without random init (meta device), then fill from the checkpoint."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attention_backend)
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives every module its own fresh parameter
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(weights)
    model.to(dtype)
    # to_empty left the (shared) rotary buffer unset and .to(dtype) would round it: refill in fp32.
    model.layers[0].self_attn.rotary.inv_freq = rope_inv_freq(config).to(device)
    return model.eval().requires_grad_(False)
