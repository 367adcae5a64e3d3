"""The target model's architecture, read once from a checkpoint (HF config.json or GGUF)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> whether q/k/v projections carry a bias.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
    "Qwen3ForCausalLM": False,
}
# Architectures that RMS-normalise each query and key head (one [head_dim] weight per layer,
# shared by the heads) after the projection and before rotary: Qwen3's training recipe.
QK_NORM_ARCHITECTURES = frozenset({"Qwen3ForCausalLM"})

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this engine does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # config.json's, then generation_config.json's others
    use_qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope_scaling type {rope_type!r}; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(
        cls, hf: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """From config.json's dict (and generation_config.json's, whose EOS ids join config's:
        Qwen3 ends a chat turn on <|im_end|> and plain text on <|endoftext|>)."""
        architectures = hf.get("architectures") or [hf.get("model_type", "?")]
        arch = architectures[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError(
                f"{arch} with use_sliding_window=true is not supported (full attention only)"
            )
        eos_ids = _eos_ids(hf.get("eos_token_id"))
        for extra in _eos_ids((generation_config or {}).get("eos_token_id")):
            eos_ids += (extra,) if extra not in eos_ids else ()
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        # transformers >= 5 nests rope settings under "rope_parameters".
        rope_params = hf.get("rope_parameters")
        if rope_params:
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or rope_params
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", SUPPORTED_ARCHITECTURES[arch]),
            rope_scaling=rope_scaling,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            use_qk_norm=arch in QK_NORM_ARCHITECTURES,
        )


def _eos_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
