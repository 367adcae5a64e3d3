"""Read a GGUF file: architecture metadata -> ModelConfig, tensors -> HF-named float tensors.

Dequantisation uses the `gguf` package (every ggml type it knows, Q4_0/Q4_1/Q8_0/F16/F32 among
them). llama.cpp's converter permutes the rows of q and k for the llama architecture (it uses
the interleaved RoPE layout); we undo that so the weights match the HF layout our rotary uses.

A file's index (its scalar fields, each array field's length, each tensor's type, shape and byte
range) is read from the header bytes (gguf_scan.py: 0.03 s for SmolLM2-135M, where gguf's
reader, which parses every token and merge, took 6-9 s on a 2-core CPU) and cached as JSON under
~/.cache/dspark/gguf, keyed like the tokenizer cache (path, size, mtime); later loads read the
index and slice the file's bytes. A cache that cannot be read is logged and rebuilt.

  field "llama.block_count"          -> 30
  array "tokenizer.ggml.tokens"      -> "tokenizer.ggml.tokens#length": 49152
  tensor "blk.0.attn_q.weight", Q4_1 -> raw uint8 [576, 360] at bytes [o, o + 207360)
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dspark.models.file_cache import cache_entry
from dspark.models.gguf_scan import scan_gguf
from dspark.models.model_config import ModelConfig, UnsupportedModelError

logger = logging.getLogger(__name__)
INDEX_VERSION = 1  # bump when GGUFIndex's JSON changes: older entries are then rebuilt

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


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: int  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # of the raw array as gguf lays it out (bytes per row if quantized)
    dtype: str  # its numpy dtype, byte order included
    offset: int  # from the file's start
    n_bytes: int


@dataclass(frozen=True)
class GGUFIndex:
    """What the engine reads of a GGUF file besides the tensor bytes (module docstring)."""

    path: Path
    fields: dict  # scalar and string fields; "KEY#length" for each array field
    tensors: tuple[GGUFTensor, ...]

    def field(self, key: str, default=None):
        return self.fields.get(key, default)


def open_gguf(path: str | os.PathLike) -> GGUFIndex:
    """The file's index, from the cache or parsed (and cached); a truncated or corrupt file is a
    CheckpointError naming it."""
    path = Path(path)
    cached = cache_entry("gguf", path).with_suffix(".json")
    index = _read_index(path, cached) if cached.is_file() else None
    if index is not None:
        return index
    index = _parse_index(path)
    size = path.stat().st_size
    end = max((t.offset + t.n_bytes for t in index.tensors), default=0)
    if end > size:  # (checked before caching: a truncated file's index is never cached)
        raise CheckpointError(
            f"{path} is truncated: tensor data ends at byte {end}, the file has {size}"
        )
    _write_index(index, cached)
    return index


def _parse_index(path: Path) -> GGUFIndex:
    try:
        fields, tensors = scan_gguf(path)
    except ValueError as e:  # (bad or missing bytes; UnicodeDecodeError is one too)
        raise CheckpointError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e
    return GGUFIndex(path, fields, tuple(GGUFTensor(*t) for t in tensors))


def _read_index(path: Path, cached: Path) -> GGUFIndex | None:
    """The cached index, or None (logged with the reason) when it is unreadable or of another
    version."""
    try:
        data = json.loads(cached.read_text())
        if data["version"] != INDEX_VERSION:
            raise ValueError(f"version {data['version']}, this dspark writes {INDEX_VERSION}")
        tensors = tuple(GGUFTensor(**t | {"shape": tuple(t["shape"])}) for t in data["tensors"])
        return GGUFIndex(path, data["fields"], tensors)
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("GGUF index cache %s is unreadable (%s: %s): parsing %s again",
                       cached, type(e).__name__, e, path)  # fmt: skip
        return None


def _write_index(index: GGUFIndex, cached: Path) -> None:
    tensors = [asdict(t) for t in index.tensors]
    text = json.dumps({"version": INDEX_VERSION, "fields": index.fields, "tensors": tensors})
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(text)
        os.replace(partial, cached)  # (atomic: a concurrent load reads the old or the new)
    except OSError as e:  # a read-only home still works, just slower next time
        logger.warning("could not cache the GGUF index at %s: %s", cached, e)


def gguf_model_config(index: GGUFIndex) -> ModelConfig:
    _field = index.field
    arch = _field("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    hf_arch, _ = GGUF_ARCHITECTURES[arch]
    num_heads = _field(f"{arch}.attention.head_count")
    hidden = _field(f"{arch}.embedding_length")
    names = {t.name for t in index.tensors}
    vocab = _field(f"{arch}.vocab_size") or _field("tokenizer.ggml.tokens#length")
    rope_scaling = None
    scaling_type = _field(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        factor = _field(f"{arch}.rope.scaling.factor")
        rope_scaling = {"rope_type": "linear", "factor": factor}
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"unsupported GGUF rope scaling type {scaling_type!r}")
    eos = _field("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=hf_arch,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(_field(f"{arch}.feed_forward_length")),
        num_layers=int(_field(f"{arch}.block_count")),
        num_heads=int(num_heads),
        num_kv_heads=int(_field(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(f"{arch}.rope.dimension_count", hidden // num_heads)),
        rms_norm_eps=float(_field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_scaling=rope_scaling,
        bos_token_id=_field("tokenizer.ggml.bos_token_id"),
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


def load_gguf_weights(index: GGUFIndex, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantise every tensor to float32, keyed by its HF name."""
    from gguf.quants import dequantize

    _, permuted = GGUF_ARCHITECTURES[index.field("general.architecture")]
    # the file's bytes in memory: dequantising slices of a plain array is ~40% faster than of
    # a memmap (every row group's slice of a memmap is a new memmap object)
    raw = np.fromfile(index.path, dtype=np.uint8)
    weights = {}
    for t in index.tensors:
        name = _hf_name(t.name)
        data = raw[t.offset : t.offset + t.n_bytes].view(np.dtype(t.dtype)).reshape(t.shape)
        w = dequantize(data, t.tensor_type).astype(np.float32, copy=False)
        if permuted and t.name.endswith(
            ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")
        ):
            heads = config.num_heads if ".attn_q." in t.name else config.num_kv_heads
            w = _unpermute_rows(w, heads)
        weights[name] = torch.from_numpy(np.array(w))  # a copy of its own, off the file's bytes
    return weights
