"""`dspark <command>`: parse arguments, build the config, call the library."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from dspark.config import DTYPE_CHOICES
from dspark.version import __version__


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="default", help="'default', a .gguf file, a HF directory or 'org/name'"
    )
    p.add_argument("--revision", default=None, help="of a Hub model: branch, tag or commit")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks the model is sharded over, one GPU each",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV pages of prompts' common prefixes (default on)",
    )
    p.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='JSON, e.g. \'{"method": "dspark"}\' (the drafter shipped for the model) or '
        '\'{"method": "dspark", "model": "path/to/drafter", "num_speculative_tokens": 3}\'',
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def cmd_generate(args: argparse.Namespace) -> int:
    from dspark.config import EngineConfig
    from dspark.engine.engine import LLMEngine
    from dspark.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            revision=args.revision,
            dtype=args.dtype,
            device=args.device,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            enable_prefix_caching=args.enable_prefix_caching,
            tensor_parallel_size=args.tensor_parallel_size,
            speculative_config=args.speculative_config,
        )
    )
    tok = engine.tokenizer
    if args.raw:
        prompt_ids = tok.encode(args.prompt)
    else:
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    engine.add_request("0", prompt_ids, params, prompt_text=args.prompt)
    printed = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
            if out.finished:
                sys.stdout.write("\n")
                sys.stdout.flush()
                n = len(out.outputs[0].token_ids)
                print(
                    f"[{n} tokens, finish_reason={out.outputs[0].finish_reason}]", file=sys.stderr
                )
    metrics = engine.get_metrics()
    engine.shutdown()  # (tensor parallelism: the worker ranks stop)
    if metrics.get("num_drafts"):
        print(
            f"[speculation: mean acceptance length {metrics['mean_acceptance_length']:.2f}]",
            file=sys.stderr,
        )
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from dspark.benchmarks.gpu_state import describe, held_down, read_gpu_state
    from dspark.benchmarks.profile import format_table, profile_cost_table
    from dspark.config import EngineConfig
    from dspark.engine.engine import LLMEngine
    from dspark.llm import LLM
    from dspark.policy.cost_table import flatness_reason, table_file_name, user_tables_dir
    from dspark.spec.synthetic import SyntheticAcceptance

    spec = dict(args.speculative_config or {"method": "dspark"})
    if "cost_table" in spec:
        raise ValueError("dspark profile measures a new table: leave cost_table out")
    spec["scheduling"] = False  # the profiler pins each cell (a shipped table must not decide)
    batches = [int(x) for x in args.batch.split(",")] if args.batch else None
    config = EngineConfig(args.model, revision=args.revision, dtype=args.dtype,
                          device=args.device, max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs if batches is None else max(batches),
                          kv_cache_memory_gb=args.kv_cache_memory_gb, speculative_config=spec,
                          enable_prefix_caching=args.enable_prefix_caching,
                          tensor_parallel_size=args.tensor_parallel_size)  # fmt: skip
    synthetic = None
    if args.synthetic_acceptance is not None:  # (step costs of real forwards, marked)
        synthetic = SyntheticAcceptance.parse(args.synthetic_acceptance, args.synthetic_seed)
    llm = LLM.from_engine(LLMEngine(config, synthetic=synthetic))
    if batches is None:  # the captured ladder (on the CPU: powers of two to max_num_seqs)
        graphs = llm.engine.runner.spec_runner.graphs
        batches = (
            graphs.sizes if graphs else [1 << i for i in range(args.max_num_seqs.bit_length())]
        )
    device = llm.engine.device
    before = read_gpu_state(device)
    table = profile_cost_table(llm, batches, steps=args.steps, warmup=args.warmup,
                               rounds=args.rounds, sampled=not args.greedy_only)  # fmt: skip
    after = read_gpu_state(device)
    if before is not None or after is not None:
        # a table read on a GPU whose clocks are held down by heat or power reads high
        print(f"GPU before: {describe(before)}\nGPU after:  {describe(after)}", file=sys.stderr)
        reasons = held_down(before, after)
        if reasons:
            print(
                f"dspark profile: the GPU's clocks were held down ({', '.join(reasons)}): its "
                f"cells may read high; let the GPU cool and profile again",
                file=sys.stderr,
            )
        table = replace(table, measured={"gpu_state_before": before, "gpu_state_after": after})
    if synthetic is not None:
        record = synthetic.record(llm.engine.spec.num_verify)
        table = replace(table, measured={**(table.measured or {}), "synthetic": record})
    print(format_table(table, llm.engine.spec.num_verify))
    _compare_to_reference(table, llm, args.compare_to)
    why = flatness_reason(table)
    if why:
        print(f"dspark profile: not writing {args.out}: {why}", file=sys.stderr)
        return 1
    if args.out is None:  # the user's tables, where an engine like this one finds it
        out = user_tables_dir() / table_file_name(table.fingerprint)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table.to_json())
        print(f"wrote {out}: engines with this fingerprint use it (speculative_config's "
              f'"cost_table" names another)')  # fmt: skip
        return 0
    Path(args.out).write_text(table.to_json())
    print(f'wrote {args.out}: pass it as speculative_config\'s "cost_table"')
    return 0


def _compare_to_reference(table, llm, path: str | None) -> None:
    """The new table against --compare-to (or the table an engine like this one uses, if any):
    the median ratio of their cells, and a warning when it is off by more than DRIFT_WARNING."""
    from pathlib import Path

    from dspark.benchmarks.profile import DRIFT_WARNING, reference_drift
    from dspark.engine.spec_setup import matching_cost_table
    from dspark.policy.cost_table import parse_table

    engine = llm.engine
    path = path or matching_cost_table(engine.drafter_dir, engine.cost_fingerprint)
    if path is None:
        return
    drift = reference_drift(table, parse_table(Path(path).read_text()))
    if drift is None:
        print(f"against {path}: no cell in common", file=sys.stderr)
        return
    median, cells = drift
    print(f"against {path}: new / reference {median:.3f} (median over {cells} cells)")
    if abs(median - 1) > DRIFT_WARNING:
        where = "above" if median > 1 else "below"
        print(f"dspark profile: this table reads {abs(median - 1):.0%} {where} {path} (median "
              f"over {cells} cells): a whole run can read high; profile again and keep each "
              f"cell's lower value (bench/results.py cost-tables shows them side by side)",
              file=sys.stderr)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"dspark {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    prof = sub.add_parser("profile", help="measure the cost table of speculative steps")
    _add_engine_args(prof)
    prof.add_argument("--batch", default=None, help="comma-separated G (default: the graph ladder)")
    prof.add_argument("--steps", type=int, default=8, help="timed steps per cell (median)")
    prof.add_argument("--warmup", type=int, default=3, help="untimed steps before each cell")
    prof.add_argument("--rounds", type=int, default=2,
                      help="rounds of every cell; a cell is its lowest round median")  # fmt: skip
    prof.add_argument("--greedy-only", action="store_true",
                      help="skip the cells measured at temperature 1 (sampled_cells)")  # fmt: skip
    prof.add_argument("--compare-to", default=None,
                      help="a table to compare the new one with (default: the table an "
                      "engine like this one uses, if any)")  # fmt: skip
    from dspark.benchmarks.offline import add_synthetic_args

    add_synthetic_args(prof)
    prof.add_argument("--out", help="where to write the table (default: the user's tables, "
                      "cost_tables/ under $DSPARK_CACHE_DIR or ~/.cache/dspark, where engines "
                      "with its fingerprint find it)")  # fmt: skip
    prof.set_defaults(func=cmd_profile)
    from dspark.benchmarks.offline import add_bench_parser
    from dspark.benchmarks.serve_bench import add_serve_bench_parser
    from dspark.server.cli import add_serve_parser
    from dspark.train.cli import add_train_parsers

    add_serve_parser(sub)
    bench = add_bench_parser(sub)  # `dspark bench` is the offline sweep; `bench serve` the HTTP one
    add_serve_bench_parser(bench.add_subparsers(dest="bench_mode", metavar="{serve}"))
    add_train_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("dspark").setLevel(logging.INFO)  # start-up facts (KV capacity) always
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, MemoryError) as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
