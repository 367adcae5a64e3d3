"""Write a tiny llama GGUF (any ggml tensor type) from HF-named weights, as llama.cpp would."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter: per head, interleave the two rotary halves
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_llama_gguf(path: Path, hf_config, weights: dict[str, torch.Tensor], qtype, arch="llama",
                     more_fields=None):  # fmt: skip
    """more_fields: called with the GGUFWriter to add metadata fields of its own."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if more_fields is not None:
        more_fields(w)
    w.add_block_count(hf_config.num_hidden_layers)
    w.add_context_length(hf_config.max_position_embeddings)
    w.add_embedding_length(hf_config.hidden_size)
    w.add_feed_forward_length(hf_config.intermediate_size)
    w.add_head_count(hf_config.num_attention_heads)
    w.add_head_count_kv(hf_config.num_key_value_heads)
    w.add_rope_freq_base(hf_config.rope_theta if hasattr(hf_config, "rope_theta") else 10000.0)
    w.add_layer_norm_rms_eps(hf_config.rms_norm_eps)
    w.add_vocab_size(hf_config.vocab_size)
    w.add_rope_dimension_count(hf_config.hidden_size // hf_config.num_attention_heads)
    for name, t in weights.items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{_LAYER[rest]}"
            if rest.startswith("self_attn.q_proj"):
                a = _permute(a, hf_config.num_attention_heads)
            elif rest.startswith("self_attn.k_proj"):
                a = _permute(a, hf_config.num_key_value_heads)
        if a.ndim == 1:  # norms stay float32, as in real files
            w.add_tensor(gname, a.astype(np.float32))
        else:
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
