"""Read a GGUF file: architecture metadata -> ModelConfig, tensors -> HF-named float tensors.

Dequantisation uses the `gguf` package (every ggml type it knows, Q4_0/Q4_1/Q8_0/F16/F32 among
them). llama.cpp's converter permutes the rows of q and k for the llama architecture (it uses the
interleaved RoPE layout); we undo that so the weights match the HF layout our rotary uses.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from dspark.models.model_config import ModelConfig, UnsupportedModelError

# GGUF architecture -> (HF architecture, q/k rows permuted by the converter)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}

# GGUF tensor name (per layer, after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or corrupt."""


def open_gguf(path: str | os.PathLike):
    """Open and sanity-check a GGUF file, turning the reader's low-level errors into one message."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad bytes
        raise CheckpointError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e
    size = path.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise CheckpointError(
            f"{path} is truncated: tensor data ends at byte {end}, the file has {size}"
        )
    return reader


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_model_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    hf_arch, _ = GGUF_ARCHITECTURES[arch]
    num_heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    rope_scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        factor = _field(reader, f"{arch}.rope.scaling.factor")
        rope_scaling = {"rope_type": "linear", "factor": factor}
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"unsupported GGUF rope scaling type {scaling_type!r}")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=hf_arch,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=int(num_heads),
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.rope.dimension_count", hidden // num_heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_scaling=rope_scaling,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    blk, layer, kind, suffix = gguf_name.split(".")
    if blk != "blk" or kind not in _LAYER_NAMES:
        raise CheckpointError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k permutation: per head, rows [r0 r2 r4 .. r1 r3 ..] <- [r0 r1 r2 ..].

    The converter reshaped (heads, 2, hd/2, ...) -> swap -> (heads, hd/2, 2, ...); we reverse it.
    """
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def load_gguf_weights(reader, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantise every tensor to float32, keyed by its HF name."""
    from gguf.quants import dequantize

    arch = _field(reader, "general.architecture")
    _, permuted = GGUF_ARCHITECTURES[arch]
    weights = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if permuted and t.name.endswith(
            ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")
        ):
            heads = config.num_heads if ".attn_q." in t.name else config.num_kv_heads
            w = _unpermute_rows(w, heads)
        weights[name] = torch.from_numpy(np.array(w))  # a writable copy, off the mmap
    return weights
