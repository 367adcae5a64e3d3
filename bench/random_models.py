"""Random-weight checkpoints, no download: stand-ins for speed runs. A step's cost does not
depend on the weights (requests run with ignore_eos to a fixed length), so these measure
speed on a machine without the real checkpoint; never quality or acceptance (a random
drafter's drafts are almost never accepted).

    python bench/random_models.py smollm2 --out smollm2-random --tokenizer DIR
    python bench/random_models.py drafter --target smollm2-random --out drafter-random
    python bench/random_models.py qwen3 --shapes 8b --out qwen3-8b-random

smollm2  SmolLM2-135M's exact shapes as a transformers checkpoint (HF directory, bf16), with
         the tokenizer of DIR (a directory with tokenizer.json)
drafter  a random DSpark drafter for --target in the default recipe's shape (2 layers, K = 7,
         taps (1, 10, 19, 28), Markov rank 64, confidence head); it passes the identity check
         against --target
qwen3    Qwen3-8B's (--shapes 14b: -14B's; tiny: a CPU-sized one) shapes as the Hub publishes
         them (config.json with two EOS ids, safetensors shards of 4 GB and their index, a
         word-level tokenizer over every id) in OUT/target, and a drafter in DeepSpec's layout
         of the released block-7 drafter's shapes (5 layers, taps 1, 9, 17, 25, 33, Markov rank
         256, confidence head) in OUT/drafter; bench/real_target_shapes.py measures them
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

# Qwen/Qwen3-8B's and Qwen3-14B's config.json (the fields the engine reads) and the released
# drafter's (14b: the same drafter recipe at its shapes)
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
               taps=[1, 9, 17, 25, 33], draft_layers=5, shard_gb=4.0),
    # Qwen/Qwen3-14B's config.json; its drafter's taps spaced as the 8B's are over 40 layers
    # (assumed: the released 14B drafter's own config was not at hand)
    "14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                taps=[1, 10, 19, 28, 37], draft_layers=5, shard_gb=4.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                 taps=[1, 2], draft_layers=2, shard_gb=0.0002),
}  # fmt: skip
BLOCK_SIZE, MARKOV_RANK = 7, 256


def target_config(s: dict) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": s["num_hidden_layers"], "head_dim": s["head_dim"],
        "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_key_value_heads"], "vocab_size": s["vocab_size"],
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
        "attention_bias": False, "tie_word_embeddings": False, "use_sliding_window": False,
        "hidden_act": "silu", "bos_token_id": s["vocab_size"] - 3,
        "eos_token_id": s["vocab_size"] - 2, "torch_dtype": "bfloat16",
    }  # fmt: skip


def layer_shapes(c: dict, prefix: str, num_layers: int) -> dict[str, tuple[int, ...]]:
    """A Qwen3 decoder layer's tensors (the target's and the DeepSpec drafter's alike), for
    layers prefix0 .. prefix{num_layers - 1}."""
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {}
    for n in range(num_layers):
        p = f"{prefix}{n}."
        shapes |= {
            f"{p}self_attn.q_proj.weight": (q, h), f"{p}self_attn.k_proj.weight": (kv, h),
            f"{p}self_attn.v_proj.weight": (kv, h), f"{p}self_attn.o_proj.weight": (h, q),
            f"{p}self_attn.q_norm.weight": (hd,), f"{p}self_attn.k_norm.weight": (hd,),
            f"{p}mlp.gate_proj.weight": (i, h), f"{p}mlp.up_proj.weight": (i, h),
            f"{p}mlp.down_proj.weight": (h, i), f"{p}input_layernorm.weight": (h,),
            f"{p}post_attention_layernorm.weight": (h,),
        }  # fmt: skip
    return shapes


def target_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, v = c["hidden_size"], c["vocab_size"]
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    return shapes | layer_shapes(c, "model.layers.", c["num_hidden_layers"])


def random_tensor(shape: tuple[int, ...], device: str, seed: int) -> torch.Tensor:
    """bf16, on the host: norms near one, matrices of std 0.02 (drawn on `device`)."""
    g = torch.Generator(device=device).manual_seed(seed)
    if len(shape) == 1:
        return (1 + 0.05 * torch.randn(shape, generator=g, device=device)).bfloat16().cpu()
    return (0.02 * torch.randn(shape, generator=g, device=device)).bfloat16().cpu()


def write_sharded(directory: Path, tensors, shard_bytes: float) -> None:
    """(name, tensor) pairs into model-0000i-of-0000n.safetensors shards and their index."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, t in tensors:
        if shards[-1] and sum(x.nbytes for x in shards[-1].values()) + t.nbytes > shard_bytes:
            path = directory / f"shard-{len(shards)}.tmp"
            save_file(shards[-1], path)  # written as it fills: one shard in host memory
            shards[-1] = {k: None for k in shards[-1]}
            shards.append({})
        shards[-1][name] = t
    save_file(shards[-1], directory / f"shard-{len(shards)}.tmp")
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        final = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        (directory / f"shard-{n}.tmp").rename(directory / final)
        weight_map |= {k: final for k in shard}
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer over every id (w0 .. wN) with a chat template: the engine and the
    peer need one; throughput prompts are token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0",
                                   eos_token=f"w{vocab_size - 2}")  # fmt: skip
    fast.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    fast.save_pretrained(directory)


def write_target(directory: Path, s: dict, device: str) -> dict:
    config = target_config(s)
    if (directory / "config.json").is_file():
        return config
    directory.mkdir(parents=True, exist_ok=True)
    shapes = target_shapes(config)
    tensors = ((n, random_tensor(shape, device, i)) for i, (n, shape) in enumerate(shapes.items()))
    write_sharded(directory, tensors, s["shard_gb"] * 2**30)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    eos = [config["eos_token_id"], config["vocab_size"] - 1]  # Qwen3's <|im_end|>, <|endoftext|>
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    write_tokenizer(directory, config["vocab_size"])
    return config


def write_drafter(directory: Path, target_dir: Path, config: dict, s: dict, device: str) -> None:
    """DeepSpec's save_pretrained layout (dspark/models/deepspec_format.py) at these shapes."""
    from safetensors.torch import save_file

    from dspark.models.safetensors_weights import SafetensorsWeights

    if (directory / "config.json").is_file():
        return
    directory.mkdir(parents=True, exist_ok=True)
    weights = SafetensorsWeights(sorted(target_dir.glob("*.safetensors")))
    h, v = config["hidden_size"], config["vocab_size"]
    shapes = {"fc.weight": (h, len(s["taps"]) * h), "hidden_norm.weight": (h,), "norm.weight": (h,),
              "markov_head.markov_w1.weight": (v, MARKOV_RANK),
              "markov_head.markov_w2.weight": (v, MARKOV_RANK),
              "confidence_head.proj.weight": (1, h + MARKOV_RANK)}  # fmt: skip
    shapes |= layer_shapes(config, "layers.", s["draft_layers"])
    tensors = {
        n: random_tensor(shape, device, 1000 + j) for j, (n, shape) in enumerate(shapes.items())
    }
    tensors["confidence_head.proj.bias"] = torch.zeros(1, dtype=torch.bfloat16)
    tensors["embed_tokens.weight"] = weights["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = weights["lm_head.weight"]
    save_file(tensors, directory / "model.safetensors")
    drafter = dict(config) | {
        "architectures": ["Qwen3DSparkModel"], "num_target_layers": config["num_hidden_layers"],
        "num_hidden_layers": s["draft_layers"], "target_layer_ids": s["taps"],
        "block_size": BLOCK_SIZE, "mask_token_id": v - 4, "num_anchors": 512,
        "markov_rank": MARKOV_RANK, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "confidence_head_with_markov": True,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(drafter, indent=1))


def write_smollm2(out: str, tokenizer: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(  # SmolLM2-135M-Instruct, as its GGUF metadata gives it
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(Path(out), safe_serialization=True)
    for f in Path(tokenizer).iterdir():
        shutil.copy(f, Path(out) / f.name)


def write_random_drafter(
    target_path: str, out: str, draft_len: int = 7, num_layers: int = 2, markov_rank: int = 64
) -> None:
    from dspark.models.drafter_config import DrafterConfig
    from dspark.models.dspark_drafter import DSparkDrafter, target_identity
    from dspark.models.llama import build_model
    from dspark.models.loader import checkpoint_hash, load_checkpoint, resolve_model

    source = resolve_model(target_path)
    config, weights = load_checkpoint(source)
    target = build_model(config, weights, torch.float32, torch.device("cpu"))
    taps = tuple(sorted({min(t, config.num_layers - 1) for t in (1, 10, 19, 28)}))
    h = checkpoint_hash(source)
    cfg = DrafterConfig(target_identity(target, h), draft_len=draft_len, target_layers=taps,
                        num_layers=num_layers, markov_rank=markov_rank)  # fmt: skip
    torch.manual_seed(0)
    drafter = DSparkDrafter(cfg, target, h)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
        drafter.mask_embedding.normal_(std=0.02)
    drafter.save(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="model", required=True)
    s = sub.add_parser("smollm2", help="SmolLM2-135M's shapes (transformers checkpoint)")
    s.add_argument("--out", required=True)
    s.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json")
    d = sub.add_parser("drafter", help="a random DSpark drafter for a target")
    d.add_argument("--target", default="default")
    d.add_argument("--out", required=True)
    d.add_argument("--draft-len", type=int, default=7)
    d.add_argument("--num-layers", type=int, default=2)
    d.add_argument("--markov-rank", type=int, default=64)
    q = sub.add_parser("qwen3", help="Qwen3-8B's or -14B's shapes and a DeepSpec-layout drafter")
    q.add_argument("--out", type=Path, required=True)
    q.add_argument("--shapes", choices=sorted(SHAPES), default="8b")
    q.add_argument("--device", default="cpu", help="where the random tensors are drawn")
    args = parser.parse_args(argv)
    if args.model == "smollm2":
        write_smollm2(args.out, args.tokenizer)
    elif args.model == "drafter":
        write_random_drafter(args.target, args.out, args.draft_len, args.num_layers,
                             args.markov_rank)  # fmt: skip
    else:
        shapes = SHAPES[args.shapes]
        config = write_target(args.out / "target", shapes, args.device)
        write_drafter(args.out / "drafter", args.out / "target", config, shapes, args.device)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
