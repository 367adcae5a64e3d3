"""The DSpark drafter network: a parallel backbone conditioned on the target, a Markov head and a
confidence head (DSPARK.md section 3).

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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from dspark.layers.attention import Attention
from dspark.layers.attention_metadata import AttentionMetadata
from dspark.layers.norm import RMSNorm
from dspark.layers.rotary import RotaryEmbedding
from dspark.models.llama import MLP, LlamaForCausalLM
from dspark.models.model_config import ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class DrafterMismatchError(ValueError):
    """A drafter checkpoint was made for another target model."""


@dataclass(frozen=True)
class TargetIdentity:
    architecture: str
    vocab_size: int
    hidden_size: int
    weights_hash: str  # sha256 over the target's parameter names, shapes and a value sample


@dataclass(frozen=True)
class DrafterConfig:
    target: TargetIdentity
    draft_len: int = 7  # K: drafted slots per block
    target_layers: tuple[int, ...] = (1, 10, 19, 28)  # taps: decoder layers whose output is read
    num_layers: int = 2
    markov_rank: int = 64  # 0: a plain DFlash-style drafter (no Markov head)
    use_confidence: bool = True
    mask_token_id: int = -1  # unused: MASK is a trainable embedding; kept for the file format
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        d = dict(d)
        d["target"] = TargetIdentity(**d["target"])
        d["target_layers"] = tuple(d["target_layers"])
        return cls(**d)


def target_identity(model: LlamaForCausalLM, weights_hash: str) -> TargetIdentity:
    """The identity a drafter checkpoint records; `weights_hash` is `checkpoint_hash(source)`."""
    cfg = model.config
    return TargetIdentity(cfg.architecture, cfg.vocab_size, cfg.hidden_size, weights_hash)


class DrafterLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: str) -> None:
        super().__init__()
        use_triton = backend == "triton"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, use_triton)
        self.self_attn = Attention(config, rotary, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, use_triton)
        self.mlp = MLP(config, use_triton)

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
        self.context_norm = RMSNorm(d, tc.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        rotary = RotaryEmbedding(tc)
        self.layers = nn.ModuleList(
            DrafterLayer(tc, rotary, backend) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(d, tc.rms_norm_eps)
        r = config.markov_rank
        self.markov_in = nn.Embedding(tc.vocab_size, r) if r > 0 else None  # W1: V x r
        self.markov_out = nn.Linear(r, tc.vocab_size, bias=False) if r > 0 else None  # W2
        conf_in = d + r
        self.confidence = nn.Linear(conf_in, 1) if config.use_confidence else None
        # frozen target pieces, held by reference (not parameters of the drafter)
        self._target = [target]

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
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"{directory} is not a DSpark drafter (no {CONFIG_FILE})")
        config = DrafterConfig.from_dict(json.loads((directory / CONFIG_FILE).read_text()))
        device = target.embed_tokens.weight.device
        dtype = target.embed_tokens.weight.dtype
        drafter = cls(config, target, target_weights_hash, backend)  # checks the identity first
        drafter.load_state_dict(load_file(directory / WEIGHTS_FILE))
        return drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)


def check_identity(expected: TargetIdentity, live: TargetIdentity) -> None:
    for name in ("architecture", "vocab_size", "hidden_size", "weights_hash"):
        want, got = getattr(expected, name), getattr(live, name)
        if want != got:
            raise DrafterMismatchError(
                f"this drafter was trained for another target: {name} is {want!r} in the drafter "
                f"checkpoint but {got!r} in the loaded target model"
            )
