"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3): the target model.

Qwen3 differs only inside attention: per-head q/k RMSNorm before rotary (layers/attention.py).

One forward runs any ragged mix of prefill chunks, decode tokens and verify windows. It returns
logits only for the rows asked for (`logits_indices`) and, on request, the residual stream after
chosen decoder layers (the DSpark drafter's context features).

Those streams cost no launch of their own: the stream after layer i is the new residual that
layer i + 1's input norm computes (x + residual), so that norm writes it straight into its
column slice of one [T, m d] features tensor (the drafter's input, taps side by side). Only a
tap at the last layer, whose sum the final norm takes after the logits rows are picked, is one
add of its own.

With the triton backend on a GPU, a step of one token row runs the decoder layer's projections
in the GEMV kernel (layers/linear.py, kernels/gemv_triton.py). The token count is known on the
host from the input's shape (and fixed inside a CUDA graph), so the whole step takes one path.
(Folding the norms and SiLU-and-mul into the GEMV as prologues, 5 launches a layer instead of
8, made a batch-1 step slower on the H200: 698 against 670 us.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.attention_metadata import AttentionMetadata
from dspark.distributed.parallel_state import TensorParallel
from dspark.layers.attention import Attention
from dspark.layers.linear import Linear
from dspark.layers.norm import RMSNorm
from dspark.layers.parallel_linear import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from dspark.layers.rotary import RotaryEmbedding, rope_inv_freq
from dspark.models.model_config import ModelConfig
from dspark.models.sharding import shard_config, shard_weights


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [N, vocab] float32, one row per logits index; None: lm_head=False
    hidden_states: dict[int, torch.Tensor]  # layer -> [T, d], output of that decoder layer
    features: torch.Tensor | None = None  # [T, m d] those m streams side by side, in the
    #   order hidden_layers named them (hidden_states holds views of it)
    final_hidden: torch.Tensor | None = None  # [N, d] after the final norm, with lm_head=False


def row_linear(
    in_features: int, out_features: int, use_triton: bool, tp: TensorParallel | None
) -> Linear:
    """A row-parallel projection under tensor parallelism, a plain one otherwise."""
    if tp is None:
        return Linear(in_features, out_features, False, use_triton)
    return RowParallelLinear(in_features, out_features, use_triton, tp)


class MLP(nn.Module):
    """With tensor parallelism `config` is the rank's shard's (I / tp rows): gate/up are
    column-parallel, down row-parallel with its all-reduce (layers/parallel_linear.py)."""

    def __init__(
        self, config: ModelConfig, use_triton: bool, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False,
                                   use_triton)  # fmt: skip
        self.down_proj = row_linear(config.intermediate_size, config.hidden_size, use_triton, tp)
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
    """

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        backend: str,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        use_triton = backend == "triton"
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, use_triton)
        self.self_attn = Attention(config, rotary, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, use_triton)
        self.mlp = MLP(config, use_triton, tp)

    def forward(
        self,
        x: torch.Tensor,  # [T, d]
        residual: torch.Tensor | None,  # [T, d]; None in the first layer (stream = x)
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        stream_out: torch.Tensor | None = None,  # [T, d]: also write the entering stream here
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            assert stream_out is None, "the first layer's entering stream is the embedding"
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual, residual_out=stream_out)
        x = self.self_attn(h, positions, kv_cache, attn)
        h, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """With tensor parallelism (`tp`), `self.config` is this rank's shard's (models/sharding.py:
    its heads and MLP rows), `checkpoint_config` the whole model's; the embedding and head hold
    the rank's vocabulary rows, and the logits come out whole on every rank."""

    def __init__(
        self,
        config: ModelConfig,
        attention_backend: str = "torch",
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.checkpoint_config = config
        config = self.config = shard_config(config, tp.size) if tp is not None else config
        self.tp = tp
        d, vocab = config.hidden_size, config.vocab_size
        if tp is None:
            # (a given weight skips the random init: on build_model's meta device normal_ goes
            # through torch._refs, whose first use imports torch._dynamo, ~4 s of a CPU start)
            self.embed_tokens = nn.Embedding(vocab, d, _weight=torch.empty(vocab, d))
            self.lm_head = nn.Linear(d, vocab, bias=False)
        else:
            self.embed_tokens = VocabParallelEmbedding(vocab, d, tp)
            self.lm_head = ParallelLMHead(vocab, d, tp)
        rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary, attention_backend, tp) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(d, config.rms_norm_eps, attention_backend == "triton")
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_pages, page_size, nkv, hd]
        logits_indices: torch.Tensor | None = None,  # [N] rows of T to score; None: all
        hidden_layers: tuple[int, ...] = (),
        lm_head: bool = True,  # False: final_hidden instead of logits (drafter training)
        logits_out: torch.Tensor | None = None,  # [>= N, vocab] float32: logits go to its rows
    ) -> ModelOutput:
        x = self.embed_tokens(input_ids)  # [T, d]
        features, hidden_states = self._tap_buffers(x, hidden_layers)
        residual = None
        for i, layer in enumerate(self.layers):
            # layer i's input norm writes the stream after layer i - 1 (None: not a tap)
            stream_out = hidden_states.get(i - 1)
            x, residual = layer(x, residual, positions, kv_caches[i], attn, stream_out)
        last = len(self.layers) - 1
        if last in hidden_states:  # no input norm after the last layer
            torch.add(x, residual, out=hidden_states[last])
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]  # [N, d]
        h, _ = self.norm(x, residual)
        if not lm_head:
            return ModelOutput(None, hidden_states, features, final_hidden=h)
        logits = self.lm_head(h)  # [N, vocab]
        if logits_out is None:
            logits = logits.float()
        else:  # (a captured graph set's one output buffer: runner/cuda_graph.py)
            logits = logits_out[: logits.shape[0]].copy_(logits)
        return ModelOutput(logits, hidden_states, features)

    def _tap_buffers(
        self, x: torch.Tensor, hidden_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """The features tensor [T, m d] for these taps and each tap's [T, d] column slice."""
        if not hidden_layers:
            return None, {}
        assert len(set(hidden_layers)) == len(hidden_layers), hidden_layers
        assert all(0 <= i < len(self.layers) for i in hidden_layers), hidden_layers
        T, d = x.shape
        features = x.new_empty(T, len(hidden_layers) * d)
        return features, {i: features[:, j * d : (j + 1) * d] for j, i in enumerate(hidden_layers)}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named (name, tensor) pairs in, one at a time: q/k/v and gate/up go straight
        into their rows of the fused projections, cast to the parameter's dtype on the way.
        Every parameter must be covered."""
        params = dict(self.named_parameters(remove_duplicate=False))
        fused = _fused_rows(self.config)
        loaded: set[tuple[str, int]] = set()  # (parameter, part): part 0 unless fused
        for name, w in weights:
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied: the embedding is the head
            key, part, rows = _place(name.removeprefix("model."), fused)
            if key not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {self.config.architecture}"
                )
            target = params[key] if rows is None else params[key][rows[0] : rows[1]]
            if target.shape != w.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(w.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(w)
            loaded.add((key, part))
        if self.config.tie_word_embeddings:
            loaded.add(("lm_head.weight", 0))
        missing = [
            k for k in params
            if any((k, part) not in loaded for part in range(_num_parts(k, fused)))
        ]  # fmt: skip
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:5]}")


# HF's separate projection -> (our fused one, its part); the rows of each part follow from the
# config (_fused_rows): qkv_proj stacks [q; k; v], gate_up_proj [gate; up]
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _fused_rows(config: ModelConfig) -> dict[str, list[tuple[int, int]]]:
    """Fused projection -> the [start, end) rows of each part.

    q_size 8, kv_size 4:  qkv_proj [(0, 8), (8, 12), (12, 16)]
    """
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    return {
        "qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
        "gate_up_proj": [(0, inter), (inter, 2 * inter)],
    }


def _place(
    key: str, fused: dict[str, list[tuple[int, int]]]
) -> tuple[str, int, tuple[int, int] | None]:
    """A checkpoint name (without "model.") -> (our parameter, part, its rows; None: whole)."""
    parts = key.split(".")
    if len(parts) >= 2 and parts[-2] in FUSED:
        ours, part = FUSED[parts[-2]]
        return ".".join([*parts[:-2], ours, parts[-1]]), part, fused[ours][part]
    return key, 0, None


def _num_parts(key: str, fused: dict[str, list[tuple[int, int]]]) -> int:
    parts = key.split(".")
    return len(fused[parts[-2]]) if len(parts) >= 2 and parts[-2] in fused else 1


def build_model(
    config: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str = "torch",
    tp: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """Instantiate without random init (meta device) directly in `dtype` on `device`, then copy
    the checkpoint's tensors in one at a time (shard by shard for safetensors): no float32 or
    host copy of the whole model is ever made. With `tp`, this rank's shard of it."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attention_backend, tp).to(dtype)
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives every module its own fresh parameter
        model.lm_head.weight = model.embed_tokens.weight
    items = weights.items()
    model.load_weights(shard_weights(items, config, tp.rank, tp.size) if tp else items)
    # to_empty left the (shared) rotary buffer unset, in dtype: refill it in float32
    model.layers[0].self_attn.rotary.inv_freq = rope_inv_freq(config).to(device)
    return model.eval().requires_grad_(False)
