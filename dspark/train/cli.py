"""`dspark train` and `dspark calibrate`: parse, build the pipeline config, call the library."""

from __future__ import annotations

import argparse
from pathlib import Path

from dspark.config import DTYPE_CHOICES
from dspark.train.data import SOURCES, SplitConfig
from dspark.train.evaluate import EvalConfig
from dspark.train.pipeline import DEFAULT_COUNTS, STAGES, PipelineConfig
from dspark.train.regenerate import RegenerateConfig
from dspark.train.trainer import TrainConfig


def _taps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--taps takes comma-separated layers, got {text!r}"
        ) from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="'default', a .gguf file or a HF dir")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="the engines' dtype")
    p.add_argument("--max-num-seqs", type=int, default=256, help="generation batch size")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_train_parsers(subparsers) -> None:
    """Register `dspark train` and `dspark calibrate` on the CLI's subparsers."""
    t = subparsers.add_parser("train", help="train a DSpark drafter (resumable stages)")
    t.add_argument("--stage", default="all", choices=("all", *STAGES))
    t.add_argument("--work-dir", type=Path, required=True)
    t.add_argument("--data-dir", type=Path, default=None, help="default: <work-dir>/data")
    t.add_argument(
        "--prompts-dir",
        type=Path,
        default=None,
        help="default: the prompt files shipped in dspark/benchmarks/data",
    )
    t.add_argument("--max-minutes", type=float, default=9.0, help="this command's time limit")
    t.add_argument("--redo", action="store_true", help="run calibrate/evaluate again")
    _add_engine_args(t)
    g = t.add_argument_group("regenerate")
    for source in SOURCES:
        what = "user turns the target writes" if source == "self" else "answers"
        g.add_argument(f"--num-{source}", type=int, default=DEFAULT_COUNTS[source],
                       help=f"{what} (default {DEFAULT_COUNTS[source]})")  # fmt: skip
    g.add_argument("--answer-max-tokens", type=int, default=384)
    g.add_argument("--shard-size", type=int, default=4096)
    g.add_argument("--eval-fraction", type=float, default=0.10, help="held out for evaluate")
    g.add_argument("--calib-fraction", type=float, default=0.05, help="held out for calibrate")
    g = t.add_argument_group("train")
    g.add_argument("--markov-rank", type=int, default=64,
                   help="0: the DFlash ablation (no Markov head, no confidence head)")  # fmt: skip
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--draft-len", type=int, default=7)
    g.add_argument("--taps", type=_taps, default=None, help="default: 4 layers spread over depth")
    g.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    g.add_argument("--anchors-per-seq", type=int, default=64)
    g.add_argument("--max-seq-len", type=int, default=1024)
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--warmup-steps", type=int, default=100)
    g.add_argument("--total-steps", type=int, default=0, help="0: fill --train-minutes")
    g.add_argument("--train-minutes", type=float, default=16.0, help="budget when steps are 0")
    g.add_argument("--save-every", type=int, default=500)
    g.add_argument("--init-from", default=None,
                   help="start from this drafter's weights (e.g. the shipped one)")  # fmt: skip
    g = t.add_argument_group("calibrate and evaluate")
    g.add_argument("--calib-prompts-per-source", type=int, default=64)
    g.add_argument("--calib-temperature", type=float, default=1.0)
    g.add_argument("--eval-prompts-per-source", type=int, default=64)
    g.add_argument("--eval-max-tokens", type=int, default=256)
    g.add_argument("--eval-temperatures", type=_floats, default=(0.0, 1.0))
    g.add_argument("--baseline-work-dir", type=Path, default=None,
                   help="compare tau with this run (e.g. the DFlash ablation)")  # fmt: skip
    t.set_defaults(func=cmd_train)

    c = subparsers.add_parser("calibrate", help="STS-calibrate a drafter's confidence head")
    c.add_argument("--drafter", type=Path, required=True, help="the drafter directory")
    c.add_argument(
        "--data-dir", type=Path, default=None,
        help="a regenerate data dir (its calib split); default: the prompt files' calib split",
    )  # fmt: skip
    c.add_argument(
        "--prompts-dir",
        type=Path,
        default=None,
        help="default: the prompt files shipped in dspark/benchmarks/data",
    )
    c.add_argument("--prompts-per-source", type=int, default=64)
    c.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    c.add_argument("--no-greedy", action="store_true",
                   help="skip the greedy rollouts (calibration.json's greedy section)")  # fmt: skip
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--plot", type=Path, default=None,
                   help="also draw the reliability diagram to this PNG")  # fmt: skip
    _add_engine_args(c)
    c.set_defaults(func=cmd_calibrate)


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {"max_num_seqs": args.max_num_seqs}
    if args.kv_cache_memory_gb is not None:
        kwargs["kv_cache_memory_gb"] = args.kv_cache_memory_gb
    return kwargs


def pipeline_config(args: argparse.Namespace) -> PipelineConfig:
    split = SplitConfig(args.eval_fraction, args.calib_fraction)
    counts = {s: getattr(args, f"num_{s}") for s in SOURCES}
    return PipelineConfig(
        work_dir=args.work_dir, data_dir=args.data_dir, target=args.target,
        prompts_dir=args.prompts_dir, device=args.device, dtype=args.dtype,
        engine=_engine_kwargs(args),
        regenerate=RegenerateConfig(counts=counts, max_tokens=args.answer_max_tokens,
                                    shard_size=args.shard_size, seed=args.seed, split=split),
        train=TrainConfig(
            draft_len=args.draft_len, target_layers=args.taps, num_layers=args.num_layers,
            markov_rank=args.markov_rank, batch_size=args.batch_size,
            anchors_per_seq=args.anchors_per_seq, max_seq_len=args.max_seq_len, lr=args.lr,
            warmup_steps=args.warmup_steps, total_steps=args.total_steps,
            train_minutes=args.train_minutes, save_every=args.save_every, seed=args.seed,
            init_from=args.init_from,
        ),
        calib_prompts_per_source=args.calib_prompts_per_source,
        calib_temperature=args.calib_temperature,
        eval=EvalConfig(temperatures=args.eval_temperatures, max_tokens=args.eval_max_tokens,
                        prompts_per_source=args.eval_prompts_per_source, seed=args.seed),
        baseline_work_dir=args.baseline_work_dir, max_minutes=args.max_minutes,
        progress=not args.no_progress,
    )  # fmt: skip


def cmd_train(args: argparse.Namespace) -> int:
    from dspark.train.calibrate import CALIBRATION_FILE
    from dspark.train.pipeline import EVAL_FILE, run_pipeline

    config = pipeline_config(args)
    stages = STAGES if args.stage == "all" else (args.stage,)
    if args.redo:
        if args.stage not in ("calibrate", "evaluate"):
            raise ValueError(
                f"--redo applies to --stage calibrate or evaluate, not {args.stage!r}; to redo "
                "regenerate or train, use a new --work-dir / --data-dir"
            )
        marker = config.drafter_dir / CALIBRATION_FILE if args.stage == "calibrate" else None
        (marker or config.work_dir / EVAL_FILE).unlink(missing_ok=True)
    done = run_pipeline(config, stages)
    print(f"dspark train: {'complete' if done else 'stopped at the time limit, run it again'}: "
          f"{', '.join(stages)} (log: {config.work_dir / 'log.json'})")  # fmt: skip
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from dspark.benchmarks.prompts import default_prompts_dir
    from dspark.llm import LLM
    from dspark.train.calibrate import calibrate_drafter, format_ece_table
    from dspark.train.data import held_out_texts, load_file_prompts, read_prompts
    from dspark.train.rollouts import full_block_spec

    if args.data_dir is not None:
        prompts = read_prompts(args.data_dir)
    else:
        prompts = load_file_prompts(args.prompts_dir or default_prompts_dir(), SplitConfig())
    held_out = held_out_texts(prompts, "calib")
    texts = [t for rows in held_out.values() for t in rows[: args.prompts_per_source]]
    llm = LLM(args.target, dtype=args.dtype, device=args.device,
              speculative_config=full_block_spec(args.drafter),
              **_engine_kwargs(args))  # fmt: skip
    report = calibrate_drafter(llm, args.drafter, texts, args.temperature, args.max_tokens,
                               args.seed, not args.no_progress,
                               greedy=not args.no_greedy)  # fmt: skip
    print(f"STS calibration on {report['num_blocks']} full blocks ({len(texts)} prompts), "
          f"written to {args.drafter / 'calibration.json'}:")  # fmt: skip
    print(format_ece_table(report))
    if args.plot is not None:
        from dspark.train.reliability import plot_reliability

        print(f"reliability diagram: {plot_reliability(report, args.plot)}")
    return 0
