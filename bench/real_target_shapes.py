"""Qwen3-8B's (or -14B's) shapes with random weights, no download: what serving the real
target costs.

    python bench/real_target_shapes.py --out real_shapes            # on an H100, ~15 min
    python bench/real_target_shapes.py --out real_shapes_tiny --shapes tiny --device cpu  # dry run

Writes a random bf16 checkpoint of Qwen3-8B's shapes as the Hub publishes it (config.json with
two EOS ids, 5 safetensors shards and their index, a word-level tokenizer over the 151,936 ids)
and a random drafter in DeepSpec's layout of the released block-7 drafter's shapes (5 layers,
taps 1, 9, 17, 25, 33, Markov rank 256, confidence head), as `random_models.py qwen3` does,
then measures, each in its own process so peaks and start-up are clean:

  startup        LLM(target) start-up time and peak host RSS, against the largest shard
  throughput     plain decoding output tokens/s at batch 1, 16, 64, 256 (prompts of 128 random
                 ids, 128 output tokens, ignore_eos, median of 3), beside transformers' static-
                 cache generate on the same checkpoint and prompts (dspark/benchmarks/hf_peer.py)
  bandwidth      batch 1's captured decode step against its memory-bandwidth floor: (weights
                 read per step + KV bytes) / the measured device copy bandwidth
  drafting       bench/step_profile.py spec at K = 7: the drafting part's time against the
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
from random_models import SHAPES, target_shapes, write_drafter, write_target

BATCHES = (1, 16, 64, 256)
PROMPT_LEN, OUTPUT_LEN = 128, 128


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
        script = Path(__file__).with_name("step_profile.py")
        subprocess.run([sys.executable, str(script), "spec", "--model", str(target),
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
