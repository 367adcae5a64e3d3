"""`dspark bench`: offline throughput and latency over a concurrency sweep, with the HF peer.

This file is the command: its parser and `cmd_bench`. The options are BenchConfig
(offline_config.py), the sweep offline_sweep.py, one level offline_level.py. The transformers
peer runs the same prompts in the same invocation, on the same device, so the dspark/HF ratio
carries no cross-run noise.

Arms compare engine configurations the same way. On a shared host consecutive runs drift (up to
2x on the GPU machine), so two separate invocations cannot be compared; `--arms` measures several
speculative_configs in one invocation, interleaved:

    dspark bench --arms '{"plain": null, "k7": {"method": "dspark"},
                          "k3": {"method": "dspark", "num_speculative_tokens": 3},
                          "scheduled": {"method": "dspark", "cost_table": "t.json"},
                          "k7-sync": {"method": "dspark", "engine": {"async_scheduling": false}}}'
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from dspark.benchmarks.hf_peer import CACHE_IMPLEMENTATIONS
from dspark.benchmarks.offline_config import BenchConfig, parse_arms, parse_concurrency
from dspark.benchmarks.offline_sweep import run_offline_bench
from dspark.benchmarks.prompts import PROMPT_SPLITS, SOURCES, parse_sources
from dspark.config import DTYPE_CHOICES
from dspark.spec.synthetic import PROFILES

DEFAULT_CONCURRENCY = "1,4,16,64,256,512"


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `dspark bench` on the CLI's subparsers."""
    p = subparsers.add_parser("bench", help="offline throughput/latency sweep, optionally vs HF")
    p.add_argument("--model", default="default", help="'default', a .gguf file or a HF directory")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='JSON, e.g. \'{"method": "dspark", "model": "path/to/drafter"}\'',
    )
    p.add_argument(
        "--arms",
        default=None,
        help="JSON object: arm name -> a --speculative-config object, or null for plain "
        "decoding; the arms run interleaved (each level, each repeat, every arm in turn) in one "
        "invocation, so their ratios carry no drift, e.g. "
        '\'{"plain": null, "k3": {"method": "dspark", "num_speculative_tokens": 3}}\'. '
        "All arms' engines are resident at once; not with --speculative-config",
    )
    p.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="default: enough pages for the largest level at full length",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="ranks the model is sharded over, one GPU each")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help="comma-separated levels")
    p.add_argument("--output-len", type=int, default=256, help="tokens per request (ignore_eos)")
    p.add_argument("--max-prompt-len", type=int, default=512, help="longer prompts are cut")
    p.add_argument("--repeats", type=int, default=1, help="runs per level; median reported")
    p.add_argument(
        "--waves",
        type=int,
        default=1,
        help="requests per level in units of C: 1 submits C at once; W > 1 runs W * C with at "
        "most C in flight (a closed loop, the tail of one wave no longer sets the wall time)",
    )
    p.add_argument(
        "--min-requests",
        type=int,
        default=1,
        help="at least this many requests per level, at most C in flight (a closed loop where "
        "it exceeds W * C): low levels then do enough work to time",
    )
    p.add_argument(
        "--output-len-spread",
        type=float,
        default=0.0,
        help="S in [0, 1): request lengths uniform in output_len * [1 - S, 1 + S], seeded, the "
        "same for every arm (with --waves, requests then end at different steps, as in a server)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy (the default); T > 0 samples at T, request i seeded with i",
    )
    p.add_argument(
        "--prompts-dir",
        type=Path,
        default=None,
        help="default: the prompt files shipped in dspark/benchmarks/data",
    )
    p.add_argument("--sources", default=",".join(SOURCES), help="comma-separated prompt sources")
    p.add_argument("--seed", type=int, default=0, help="prompt shuffle seed")
    p.add_argument(
        "--prompt-split",
        default="eval",
        choices=PROMPT_SPLITS,
        help="eval: only prompts held out of drafter training (default); all: every prompt",
    )
    p.add_argument("--hf-peer", action="store_true", help="also run transformers generate")
    p.add_argument("--hf-only", action="store_true", help="run only the transformers peer")
    p.add_argument("--hf-max-concurrency", type=int, default=64)
    p.add_argument("--hf-cache", default="static", choices=CACHE_IMPLEMENTATIONS)
    add_synthetic_args(p)
    p.add_argument("--out", type=Path, default=Path("bench_results.json"))
    p.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--plot-from",
        type=Path,
        default=None,
        help="only redraw the plot from an earlier results JSON",
    )
    p.set_defaults(func=cmd_bench)
    return p


def add_synthetic_args(p: argparse.ArgumentParser) -> None:
    """--synthetic-acceptance and its seed (`dspark bench` and `dspark profile` only)."""
    p.add_argument(
        "--synthetic-acceptance",
        default=None,
        help=f"keep drafts by this profile, not the target: one of {sorted(PROFILES)} or "
        "comma-separated conditional rates per position (e.g. 0.9,0.8,0.7); the forwards and "
        "layouts are real, the text is not; every result is marked synthetic",
    )
    p.add_argument("--synthetic-seed", type=int, default=0, help="seed of the synthetic draws")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    plot = None if args.no_plot else (args.plot or args.out.with_suffix(".png"))
    return BenchConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        speculative_config=args.speculative_config,
        arms=parse_arms(args.arms),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        concurrency=parse_concurrency(args.concurrency),
        output_len=args.output_len,
        max_prompt_len=args.max_prompt_len,
        repeats=args.repeats,
        waves=args.waves,
        min_requests=args.min_requests,
        output_len_spread=args.output_len_spread,
        temperature=args.temperature,
        prompts_dir=args.prompts_dir,
        sources=parse_sources(args.sources),
        seed=args.seed,
        prompt_split=args.prompt_split,
        use_dspark=not args.hf_only,
        use_hf=args.hf_peer or args.hf_only,
        hf_max_concurrency=args.hf_max_concurrency,
        hf_cache=args.hf_cache,
        out=args.out,
        plot=plot,
        synthetic_acceptance=args.synthetic_acceptance,
        synthetic_seed=args.synthetic_seed,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    if args.plot_from is not None:
        from dspark.benchmarks.plot import plot_results

        png = args.plot or args.plot_from.with_suffix(".png")
        plot_results(args.plot_from, png)
        print(f"wrote {png}", file=sys.stderr)
        return 0
    arguments = {k: v for k, v in vars(args).items() if k != "func"}
    run_offline_bench(config_from_args(args), shlex.join(sys.argv), arguments)
    return 0
