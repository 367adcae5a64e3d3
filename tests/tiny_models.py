"""Tiny real checkpoints built for the tests: random weights, real files, real tokenizers.

- `make_tiny_llama(dir)`: a 2-layer Llama with SmolLM2's tokenizer (so text prompts work).
- `make_tiny_vocab_model(dir)`: a 1-layer Llama over a 12-token word-level vocabulary, for
  distribution tests where every token's probability is measurable.
- `make_tiny_drafter(target_dir, dir, taps)`: a random DSpark drafter for one of those targets.
The two targets are written by transformers (config.json + model.safetensors), so they exercise
the same loading path as a downloaded checkpoint, and transformers can serve as the logits oracle.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_WORDS = ["<unk>", "<eos>", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]


def _llama_config(vocab_size: int, arch: str = "llama", **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
    )
    if arch == "qwen3":  # heads x head_dim (128) differs from the hidden size, as in Qwen3
        kwargs.update(head_dim=32, attention_bias=False)
    kwargs.update(overrides)
    return cls(**kwargs)


def save_random_model(directory: Path, config, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # q/k norm weights start at one: random ones show a swap or a miss
        for name, w in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                w.uniform_(0.5, 1.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def make_tiny_llama(directory: Path, hf_tokenizer, arch: str = "llama", **overrides) -> Path:
    config = _llama_config(len(hf_tokenizer), arch, **overrides)
    save_random_model(directory, config)
    hf_tokenizer.save_pretrained(directory)
    return directory


def make_tiny_vocab_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(TINY_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def make_tiny_vocab_model(directory: Path) -> Path:
    tok = make_tiny_vocab_tokenizer()
    # large init so next-token distributions are far from uniform (a meaningful test)
    config = _llama_config(
        len(TINY_WORDS),
        num_hidden_layers=1,
        eos_token_id=1,
        bos_token_id=None,
        initializer_range=0.8,
    )
    save_random_model(directory, config, seed=1)
    tok.save_pretrained(directory)
    return directory


def make_tiny_drafter(
    target_dir: Path, out_dir: Path, taps: tuple[int, ...], draft_len: int = 4, seed: int = 0
) -> Path:
    """A random-weight DSpark drafter for the checkpoint in target_dir (2 layers, Markov rank 8),
    saved with the target's identity so the engine accepts it."""
    from dspark.models.drafter_config import DrafterConfig
    from dspark.models.dspark_drafter import DSparkDrafter, target_identity
    from dspark.models.llama import build_model
    from dspark.models.loader import checkpoint_hash, load_checkpoint, resolve_model

    source = resolve_model(str(target_dir))
    config, weights = load_checkpoint(source)
    target = build_model(config, weights, torch.float32, torch.device("cpu"))
    h = checkpoint_hash(source)
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        target_identity(target, h),
        draft_len=draft_len,
        target_layers=taps,
        num_layers=2,
        markov_rank=8,
    )
    drafter = DSparkDrafter(cfg, target, h)
    with torch.no_grad():
        drafter.mask_embedding.normal_()
    drafter.save(out_dir)
    return out_dir


def make_deepspec_drafter(
    target_dir: Path,
    out_dir: Path,
    taps: tuple[int, ...] = (0,),
    block_size: int = 4,
    markov_rank: int = 8,
    num_layers: int = 2,
    seed: int = 0,
    **config_overrides,
) -> Path:
    """A random drafter for the Qwen3 checkpoint in target_dir, written in the layout DeepSpec's
    save_pretrained gives Qwen3DSparkModel (config.json = the target's config plus the drafter's
    fields; one model.safetensors of unprefixed names). markov_rank 0 writes a DFlash drafter
    (no Markov or confidence head)."""
    import json

    from safetensors.torch import load_file, save_file

    hf = json.loads((target_dir / "config.json").read_text())
    target = load_file(target_dir / "model.safetensors")
    H, V = hf["hidden_size"], hf["vocab_size"]
    hd = hf.get("head_dim") or H // hf["num_attention_heads"]
    nh, nkv, inter = hf["num_attention_heads"], hf["num_key_value_heads"], hf["intermediate_size"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return scale * torch.randn(*shape, generator=g)

    def norm(n):
        return 1 + rand(n, scale=0.1)

    embed = target["model.embed_tokens.weight"]
    tensors = {
        "embed_tokens.weight": embed,
        "lm_head.weight": target.get("lm_head.weight", embed).clone(),  # DeepSpec never ties
        "fc.weight": rand(H, len(taps) * H),
        "hidden_norm.weight": norm(H),
        "norm.weight": norm(H),
    }
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes = {
            "self_attn.q_proj": (nh * hd, H), "self_attn.k_proj": (nkv * hd, H),
            "self_attn.v_proj": (nkv * hd, H), "self_attn.o_proj": (H, nh * hd),
            "mlp.gate_proj": (inter, H), "mlp.up_proj": (inter, H), "mlp.down_proj": (H, inter),
        }  # fmt: skip
        tensors |= {f"{p}{name}.weight": rand(*shape) for name, shape in shapes.items()}
        tensors |= {
            f"{p}self_attn.q_norm.weight": norm(hd),
            f"{p}self_attn.k_norm.weight": norm(hd),
        }
        tensors |= {
            f"{p}input_layernorm.weight": norm(H),
            f"{p}post_attention_layernorm.weight": norm(H),
        }
    if markov_rank:
        tensors["markov_head.markov_w1.weight"] = rand(V, markov_rank, scale=1.0)
        tensors["markov_head.markov_w2.weight"] = rand(V, markov_rank, scale=1.0)
        tensors["confidence_head.proj.weight"] = rand(1, H + markov_rank)
        tensors["confidence_head.proj.bias"] = rand(1)
    hf |= {
        "architectures": ["Qwen3DSparkModel"],
        "num_target_layers": hf["num_hidden_layers"],
        "num_hidden_layers": num_layers,
        "target_layer_ids": list(taps),
        "block_size": block_size,
        "mask_token_id": V - 1,
        "num_anchors": 512,
        "markov_rank": markov_rank,
        "enable_confidence_head": markov_rank > 0,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * num_layers,
    }
    if markov_rank:
        hf |= {"markov_head_type": "vanilla", "confidence_head_with_markov": True}
    hf |= config_overrides
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors")
    return out_dir
