"""The DSpark drafter network: a parallel backbone conditioned on the target, a Markov head and a
confidence head (docs/SPECULATION.md 2).

Backbone. Context features are the target's residual stream after the tap layers, concatenated
per token and projected `fc: m d -> d`, then RMS-normed. Each drafter layer has its own q/k/v
projections: the context tokens contribute keys/values (k/v projections of the features, RoPE at
their own positions), and the K block slots [anchor, MASK, ..., MASK] at positions
anchor_pos + 0 .. K-1 contribute queries, keys and values. Block queries attend to the whole
context before the anchor and to every block slot (bidirectional), so one forward drafts K.

Paging. Context K/V live in the drafter's own paged cache (the same layout and allocator as the
target's). The block's K/V are written into the slots right after the context, at the block's
positions, and recomputed every step: those slots are overwritten when real context arrives.
One block attention is then plain paged attention with causal=False over seq_len =
anchor_pos + K keys.

Heads. Slot k (0-based) predicts the token at anchor_pos + k + 1. Base logits are the drafter's
final norm followed by the target's frozen LM head. Markov head: bias(prev) = W2 W1[prev], added
to slot k's logits with prev = the token drafted at slot k - 1 (the anchor for slot 0).
Confidence head: c_raw[k] = sigmoid(w . [h[k] ; W1[prev]] + b): it sees the previous token,
never the token it scores.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dspark import envs
from dspark.attention_metadata import AttentionMetadata
from dspark.distributed.parallel_state import TensorParallel
from dspark.layers.attention import Attention
from dspark.layers.norm import RMSNorm
from dspark.layers.rotary import RotaryEmbedding, rope_inv_freq
from dspark.models.deepspec_format import (
    deepspec_dims,
    deepspec_drafter_config,
    deepspec_state_dict,
    is_deepspec,
)
from dspark.models.drafter_config import (  # (re-exported: the drafter's public names)
    CONFIG_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    DrafterConfig,
    TargetIdentity,
    check_identity,
    read_drafter_config,
)
from dspark.models.folded_context import FoldedContext, folded_context_enabled
from dspark.models.llama import MLP, LlamaForCausalLM
from dspark.models.model_config import ModelConfig
from dspark.models.sharding import shard_weights

logger = logging.getLogger(__name__)


def target_identity(model: LlamaForCausalLM, weights_hash: str) -> TargetIdentity:
    """The identity a drafter checkpoint records; `weights_hash` is `checkpoint_hash(source)`."""
    cfg = model.config
    return TargetIdentity(cfg.architecture, cfg.vocab_size, cfg.hidden_size, weights_hash)


class DrafterLayer(nn.Module):
    """Sharded as the target's layers are (`config` the target's shard's, `tp` its group)."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        backend: str,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        use_triton = backend == "triton"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, use_triton)
        self.self_attn = Attention(config, rotary, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, use_triton)
        self.mlp = MLP(config, use_triton, tp)

    def store_context(
        self,
        ctx: torch.Tensor,  # [T, d] projected context features
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T]
    ) -> None:
        """Write the context tokens' keys/values (this layer's own k/v projections)."""
        self.self_attn.store_kv_only(ctx, positions, kv_cache, slot_mapping)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_dense(
        self,
        x: torch.Tensor,  # [B, Q, d] block slots
        positions: torch.Tensor,  # [B, Q]
        ctx: torch.Tensor,  # [B, L, d] projected context features
        ctx_positions: torch.Tensor,  # [B, L]
        mask: torch.Tensor,  # [B, 1, Q, L + Q] bool, True where a query may attend
    ) -> torch.Tensor:  # [B, Q, d]
        """forward() without the paged cache (training): keys/values are [context ; block]."""
        a = self.self_attn
        B, Q, _ = x.shape
        L = ctx.shape[1]
        nh, nkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
        q, kb, vb = a.qkv_proj(self.input_layernorm(x)).split([a.q_size, a.kv_size, a.kv_size], -1)
        w = a.qkv_proj.weight[a.q_size :]
        bias = None if a.qkv_proj.bias is None else a.qkv_proj.bias[a.q_size :]
        kc, vc = F.linear(ctx, w, bias).split([a.kv_size, a.kv_size], dim=-1)  # [B, L, kv]
        q, kb = a.norm_heads(q.reshape(B * Q, nh, hd), kb.reshape(B * Q, nkv, hd))
        q, kb = a.rotary(positions.reshape(-1), q, kb)
        kc = kc.reshape(B * L, nkv, hd)
        _, kc = a.norm_heads(kc[:, :0], kc)
        kc, _ = a.rotary(ctx_positions.reshape(-1), kc, kc)  # context tokens are keys only
        keys = torch.cat([kc.view(B, L, nkv, hd), kb.view(B, Q, nkv, hd)], dim=1)  # [B, S, nkv, hd]
        vals = torch.cat([vc.view(B, L, nkv, hd), vb.view(B, Q, nkv, hd)], dim=1)
        group = nh // nkv
        keys = keys.transpose(1, 2).repeat_interleave(group, dim=1)  # [B, nh, S, hd]
        vals = vals.transpose(1, 2).repeat_interleave(group, dim=1).to(keys.dtype)
        qh = q.view(B, Q, nh, hd).transpose(1, 2).to(keys.dtype)  # [B, nh, Q, hd]
        o = F.scaled_dot_product_attention(qh, keys, vals, attn_mask=mask, scale=a.scale)
        x = x + a.o_proj(o.transpose(1, 2).reshape(B, Q, a.q_size))
        return x + self.mlp(self.post_attention_layernorm(x))


class DSparkDrafter(nn.Module):
    def __init__(
        self,
        config: DrafterConfig,
        target: LlamaForCausalLM,
        target_weights_hash: str,
        backend: str = "torch",
    ) -> None:
        super().__init__()
        tc = target.config
        check_identity(config.target, target_identity(target, target_weights_hash))
        for layer in config.target_layers:
            if not 0 <= layer < tc.num_layers:
                raise ValueError(
                    f"tap layer {layer} is outside the target's 0..{tc.num_layers - 1}"
                )
        self.config = config
        self.target_config = tc
        d = tc.hidden_size
        self.fc = nn.Linear(len(config.target_layers) * d, d, bias=False)
        self.context_norm = RMSNorm(d, tc.rms_norm_eps, backend == "triton")
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        rotary = RotaryEmbedding(tc)
        self.layers = nn.ModuleList(
            DrafterLayer(tc, rotary, backend, target.tp) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(d, tc.rms_norm_eps)
        r = config.markov_rank
        self.markov_in = nn.Embedding(tc.vocab_size, r) if r > 0 else None  # W1: V x r
        self.markov_out = nn.Linear(r, tc.vocab_size, bias=False) if r > 0 else None  # W2
        conf_in = d + r
        self.confidence = nn.Linear(conf_in, 1) if config.use_confidence else None
        # greedy Markov slots in one launch each where the kernel takes the rank
        # (spec/drafting.py); DSPARK_REFERENCE_OPS keeps PyTorch's six
        self.use_triton = backend == "triton" and not envs.ENVS.reference_ops
        # frozen target pieces, held by reference (not parameters of the drafter)
        self._target = [target]
        # the context upkeep in two launches, built by load() for the triton backend
        self.folded_context: FoldedContext | None = None

    @property
    def target(self) -> LlamaForCausalLM:
        return self._target[0]

    # ---- backbone -------------------------------------------------------------------------

    def append_context(
        self,
        features: torch.Tensor,  # [T, m d], target tap outputs concatenated per token
        positions: torch.Tensor,  # [T]
        slot_mapping: torch.Tensor,  # [T] drafter-cache slots of these context tokens
        kv_caches: list[torch.Tensor],
    ) -> None:
        if self.folded_context is not None:
            self.folded_context(features, positions, slot_mapping, kv_caches)
            return
        ctx = self.context_norm(self.fc(features))  # [T, d]
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            layer.store_context(ctx, positions, kv, slot_mapping)

    def block_hidden(
        self,
        anchors: torch.Tensor,  # [R] token ids
        positions: torch.Tensor,  # [R K], anchor_pos + 0 .. K-1 per row
        attn: AttentionMetadata,  # causal=False, K query tokens per row, seq_len anchor_pos + K
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:  # [R, K, d] final hidden states (after the drafter's norm)
        R, K = anchors.shape[0], self.config.draft_len
        assert not attn.causal, "the block attends to itself both ways"
        x = self.mask_embedding.expand(R, K, -1).clone()  # [R, K, d]
        x[:, 0] = self.target.embed_tokens(anchors)
        x = x.reshape(R * K, -1).to(self.fc.weight.dtype)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, kv, attn)
        return self.norm(x).view(R, K, -1)

    def forward_train(
        self,
        features: torch.Tensor,  # [B, L, m d] target tap features at positions 0 .. L-1
        anchors: torch.Tensor,  # [B, A] anchor token ids
        anchor_positions: torch.Tensor,  # [B, A] int64, each >= 0 and < L
    ) -> torch.Tensor:  # [B, A, K, d] final hidden states (after the drafter's norm)
        """The block forward for training: A blocks per sequence at once, dense and differentiable.

        The same computation as append_context + block_hidden, written over padded sequences
        instead of the paged cache: block a of sequence b sees the context keys at positions
        < anchor_positions[b, a] (never its own anchor's feature, which at inference does not
        exist yet) and its own K slots both ways, never another block.

          anchors at positions [3, 5], K = 2, L = 6    keys: ctx 0..5 | blk0 s0 s1 | blk1 s0 s1
          block 0 queries (positions 3, 4):               1 1 1 0 0 0 |  1  1      |  0  0
          block 1 queries (positions 5, 6):               1 1 1 1 1 0 |  0  0      |  1  1

        Padding past a sequence's end is never visible: every anchor is inside the sequence.
        """
        B, A = anchors.shape
        K, L = self.config.draft_len, features.shape[1]
        ctx = self.context_norm(self.fc(features))  # [B, L, d]
        x = self.mask_embedding.expand(B, A, K, -1).clone()  # [B, A, K, d]
        x[:, :, 0] = self.target.embed_tokens(anchors).to(x.dtype)
        x = x.reshape(B, A * K, -1)
        slots = torch.arange(K, device=anchors.device)
        block_pos = (anchor_positions[..., None] + slots).reshape(B, A * K)  # [B, A K]
        query_anchor = anchor_positions.repeat_interleave(K, dim=1)  # [B, A K]
        sees_ctx = torch.arange(L, device=anchors.device) < query_anchor[..., None]  # [B, AK, L]
        block_id = torch.arange(A, device=anchors.device).repeat_interleave(K)  # [A K]
        sees_block = (block_id[:, None] == block_id[None, :]).expand(B, -1, -1)  # [B, AK, AK]
        mask = torch.cat([sees_ctx, sees_block], dim=-1)[:, None]  # [B, 1, AK, L + AK]
        ctx_pos = torch.arange(L, device=anchors.device).expand(B, L)  # [B, L]
        for layer in self.layers:
            x = layer.forward_dense(x, block_pos, ctx, ctx_pos, mask)
        return self.norm(x).view(B, A, K, -1)

    # ---- heads ----------------------------------------------------------------------------

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., V] fp32
        return self.target.lm_head(hidden).float()

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor | float:  # [...] -> [..., V]
        if self.markov_out is None:
            return 0.0
        return self.markov_out(self.markov_in(prev)).float()

    def confidence_logit(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Raw (uncalibrated) logit of c[k] from h[k] and the previous token only: [...]."""
        assert self.confidence is not None, "this drafter has no confidence head"
        feats = [hidden]
        if self.markov_in is not None:
            feats.append(self.markov_in(prev).to(hidden.dtype))
        return self.confidence(torch.cat(feats, dim=-1))[..., 0].float()

    # ---- checkpoint -----------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=1))
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, directory / WEIGHTS_FILE)

    @classmethod
    def load(
        cls,
        directory: str | Path,
        target: LlamaForCausalLM,
        target_weights_hash: str,
        backend: str = "torch",
    ) -> DSparkDrafter:
        directory = Path(directory)
        hf = read_drafter_config(directory)
        tensors = None
        if is_deepspec(hf):  # DeepSeek's layout: identity by the frozen embedding and head
            identity = target_identity(target, target_weights_hash)
            config = deepspec_drafter_config(hf, target, identity)
            tensors = deepspec_state_dict(read_weights(directory), config, target)
        else:
            config = DrafterConfig.from_dict(hf)
        device = target.embed_tokens.weight.device
        dtype = target.embed_tokens.weight.dtype
        drafter = cls(config, target, target_weights_hash, backend)  # checks the identity first
        tensors = tensors if tensors is not None else read_weights(directory)
        if target.tp is not None:  # this rank's heads and MLP rows (models/sharding.py)
            tp, full = target.tp, target.checkpoint_config
            tensors = dict(shard_weights(tensors.items(), full, tp.rank, tp.size))
        drafter.load_state_dict(tensors)
        drafter = drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)
        # .to(dtype) rounded the (shared) rotary frequencies: the kernels want them in fp32
        drafter.layers[0].self_attn.rotary.inv_freq = rope_inv_freq(drafter.target_config).to(
            device
        )
        if backend == "triton" and folded_context_enabled():
            if drafter.target_config.use_qk_norm:  # k norm is per head: it does not fold
                logger.info("drafter context upkeep unfolded: %s has q/k norm",
                            drafter.target_config.architecture)  # fmt: skip
            else:
                drafter.folded_context = drafter.fold_context()
        return drafter

    def fold_context(self) -> FoldedContext:
        """append_context's projections folded into one (models/folded_context.py), from the
        weights as they are now."""
        kv = []
        for layer in self.layers:
            a = layer.self_attn
            bias = a.qkv_proj.bias
            kv.append((a.qkv_proj.weight[a.q_size :], None if bias is None else bias[a.q_size :]))
        return FoldedContext(self.fc, self.context_norm.weight, self.context_norm.eps, kv,
                             self.layers[0].self_attn.rotary.inv_freq)  # fmt: skip


def drafter_dims(directory: Path) -> tuple[int, int]:
    """(drafter layers, draft length K) from a drafter directory's config, either layout."""
    hf = read_drafter_config(directory)
    return deepspec_dims(hf) if is_deepspec(hf) else (int(hf["num_layers"]), int(hf["draft_len"]))


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The drafter's tensors: model.safetensors, or the shards its index file names."""
    from safetensors.torch import load_file

    index = directory / WEIGHTS_INDEX_FILE
    if (directory / WEIGHTS_FILE).is_file() or not index.is_file():
        return load_file(directory / WEIGHTS_FILE)
    weight_map = json.loads(index.read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        tensors.update(load_file(directory / shard))
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise FileNotFoundError(f"{index} names tensors no shard holds: {missing[:5]}")
    return tensors
