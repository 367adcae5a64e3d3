"""Qwen3-8B's (or -14B's) shapes with random weights, no download: what serving the real
target costs.

    python bench/real_target_shapes.py --out /tmp/real_shapes            # on an H100, ~15 min
    python bench/real_target_shapes.py --out /tmp/rs --shapes tiny --device cpu   # dry run

Writes a random bf16 checkpoint of Qwen3-8B's shapes as the Hub publishes it (config.json with
two EOS ids, 5 safetensors shards and their index, a word-level tokenizer over the 151,936 ids)
and a random drafter in DeepSpec's layout of the released block-7 drafter's shapes (5 layers,
taps 1, 9, 17, 25, 33, Markov rank 256, confidence head), then measures, each in its own
process so peaks and start-up are clean:

  startup        LLM(target) start-up time and peak host RSS, against the largest shard
  throughput     plain decoding output tokens/s at batch 1, 16, 64, 256 (prompts of 128 random
                 ids, 128 output tokens, ignore_eos, median of 3), beside transformers' static-
                 cache generate on the same checkpoint and prompts (dspark/benchmarks/hf_peer.py)
  bandwidth      batch 1's captured decode step against its memory-bandwidth floor: (weights
                 read per step + KV bytes) / the measured device copy bandwidth
  drafting       bench/spec_step_profile.py at K = 7: the drafting part's time against the
                 target forward's, per batch size

Random weights accept nothing: these are costs, never acceptance (`dspark bench
--synthetic-acceptance` over OUT/target and OUT/drafter measures scheduling at a given
acceptance: dspark/spec/synthetic.py). `--skip startup,throughput,drafting` only writes the
checkpoints. Results go to OUT/*.json and one summary table on stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

# Qwen/Qwen3-8B's and Qwen3-14B's config.json (the fields the engine reads) and the released
# drafter's (14b: the same drafter recipe at its shapes; bench/tensor_parallel.py uses it)
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
BATCHES = (1, 16, 64, 256)
PROMPT_LEN, OUTPUT_LEN = 128, 128
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


def target_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, i, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            f"{p}self_attn.q_proj.weight": (q, h), f"{p}self_attn.k_proj.weight": (kv, h),
            f"{p}self_attn.v_proj.weight": (kv, h), f"{p}self_attn.o_proj.weight": (h, q),
            f"{p}self_attn.q_norm.weight": (hd,), f"{p}self_attn.k_norm.weight": (hd,),
            f"{p}mlp.gate_proj.weight": (i, h), f"{p}mlp.up_proj.weight": (i, h),
            f"{p}mlp.down_proj.weight": (h, i), f"{p}input_layernorm.weight": (h,),
            f"{p}post_attention_layernorm.weight": (h,),
        }  # fmt: skip
    return shapes


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
    h, hd, v = config["hidden_size"], config["head_dim"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    i = config["intermediate_size"]
    shapes = {"fc.weight": (h, len(s["taps"]) * h), "hidden_norm.weight": (h,), "norm.weight": (h,),
              "markov_head.markov_w1.weight": (v, MARKOV_RANK),
              "markov_head.markov_w2.weight": (v, MARKOV_RANK),
              "confidence_head.proj.weight": (1, h + MARKOV_RANK)}  # fmt: skip
    for n in range(s["draft_layers"]):
        p = f"layers.{n}."
        shapes |= {
            f"{p}self_attn.q_proj.weight": (q, h), f"{p}self_attn.k_proj.weight": (kv, h),
            f"{p}self_attn.v_proj.weight": (kv, h), f"{p}self_attn.o_proj.weight": (h, q),
            f"{p}self_attn.q_norm.weight": (hd,), f"{p}self_attn.k_norm.weight": (hd,),
            f"{p}mlp.gate_proj.weight": (i, h), f"{p}mlp.up_proj.weight": (i, h),
            f"{p}mlp.down_proj.weight": (h, i), f"{p}input_layernorm.weight": (h,),
            f"{p}post_attention_layernorm.weight": (h,),
        }  # fmt: skip
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


STARTUP_CHILD = """
import json, resource, sys, time
t = time.perf_counter()
from dspark import LLM
imported = time.perf_counter() - t
t = time.perf_counter()
llm = LLM(model=sys.argv[1], dtype="bfloat16", device=sys.argv[2], max_num_seqs=256)
init = time.perf_counter() - t
print(json.dumps({"import_s": imported, "init_s": init,
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def run_child(args: list[str]) -> dict:
    """A fresh Python process whose last stdout line is a JSON object."""
    out = subprocess.run([sys.executable, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def startup(target: Path, device: str) -> dict:
    shards = sorted(target.glob("*.safetensors"))
    result = run_child(["-c", STARTUP_CHILD, str(target), device])
    result["largest_shard_gb"] = max(f.stat().st_size for f in shards) / 2**30
    result["checkpoint_gb"] = sum(f.stat().st_size for f in shards) / 2**30
    return result


THROUGHPUT_CHILD = """
import json, statistics, sys, time
import torch
from dspark import LLM, SamplingParams
from dspark.benchmarks.hf_peer import HFPeerConfig, load_hf_model, release_memory, run_hf_level
model, device, prompt_len, output_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
batches = [int(b) for b in sys.argv[5].split(",")]
g = torch.Generator().manual_seed(0)
vocab = json.load(open(model + "/config.json"))["vocab_size"]
prompts = {b: torch.randint(0, vocab - 8, (b, prompt_len), generator=g).tolist() for b in batches}
llm = LLM(model=model, dtype="bfloat16", device=device, max_num_seqs=max(batches),
          max_model_len=prompt_len + output_len + 16)
params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
rows = {}
for b in batches:
    llm.generate(prompts[b], params, use_tqdm=False)
    walls = []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(prompts[b], params, use_tqdm=False)
        walls.append(time.perf_counter() - t)
    rows[b] = {"dspark_tok_s": b * output_len / statistics.median(walls)}
del llm
release_memory()
hf = load_hf_model(model, torch.bfloat16, torch.device(device))
config = HFPeerConfig(output_len, 3, max(batches), "static", 0)
for b in batches:
    try:
        rows[b]["hf_static_tok_s"] = run_hf_level(hf, prompts[b], config)["output_tokens_per_s"]
    except torch.OutOfMemoryError as e:
        rows[b]["hf_static_tok_s"] = None
        rows[b]["hf_error"] = str(e).splitlines()[0]
        release_memory()
print(json.dumps(rows))
"""


def copy_bandwidth_gbs(device: str, nbytes: int = 2**31) -> float:
    """Device memory bandwidth as a large copy sees it: bytes read + written per second."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    return 2 * nbytes / sorted(times)[len(times) // 2] / 1e9


def step_floor_us(config: dict, context_len: int, bandwidth_gbs: float) -> dict:
    """What one batch-1 decode step must read: every weight but the embedding (one row of it),
    bf16, and the KV of `context_len` tokens; over the copy bandwidth."""
    shapes = target_shapes(config)
    weights = sum(torch.Size(s).numel() for n, s in shapes.items() if "embed_tokens" not in n) * 2
    per_token_kv = (
        2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2
    )
    kv = context_len * per_token_kv
    return {"weights_gb": weights / 1e9, "kv_gb": kv / 1e9,
            "floor_us": (weights + kv) / (bandwidth_gbs * 1e9) * 1e6}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--skip", default="", help="comma-separated phases to skip")
    args = parser.parse_args()
    s, skip = SHAPES[args.shapes], set(args.skip.split(","))
    target, drafter = args.out / "target", args.out / "drafter"
    t = time.perf_counter()
    config = write_target(target, s, args.device)
    write_drafter(drafter, target, config, s, args.device)
    results: dict = {"shapes": args.shapes, "write_s": time.perf_counter() - t}
    if torch.cuda.is_available():
        results["device"] = torch.cuda.get_device_name()
    if "startup" not in skip:
        results["startup"] = startup(target, args.device)
        print("startup", json.dumps(results["startup"]), flush=True)
    if "throughput" not in skip:
        rows = run_child(["-c", THROUGHPUT_CHILD, str(target), args.device, str(PROMPT_LEN),
                          str(OUTPUT_LEN), args.batches])  # fmt: skip
        results["throughput"] = rows
        print("throughput", json.dumps(rows), flush=True)
    bandwidth = copy_bandwidth_gbs(args.device)
    results["copy_bandwidth_gbs"] = bandwidth
    if args.device == "cuda" and "drafting" not in skip:
        profile = args.out / "spec_step_profile.json"
        subprocess.run([sys.executable, "bench/spec_step_profile.py", "--model", str(target),
                        "--drafter", str(drafter), "--k", "7", "--batch", args.batches,
                        "--out", str(profile)], check=True)  # fmt: skip
        rows = json.loads(profile.read_text())["rows"]
        results["drafting"] = [
            {k: r[k] for k in ("batch", "draft_us", "target_us", "graph_us", "decode_graph_us")}
            | {"draft_over_target": r["draft_us"] / r["target_us"]}
            for r in rows
        ]
        batch1 = next(r for r in rows if r["batch"] == 1)
        floor = step_floor_us(config, PROMPT_LEN + 20, bandwidth)  # the profile's steady context
        floor["step_us"] = batch1["decode_graph_us"]
        floor["fraction_of_floor"] = floor["floor_us"] / batch1["decode_graph_us"]
        results["batch1_bandwidth"] = floor
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
