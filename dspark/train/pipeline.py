"""`dspark train`: regenerate -> train -> calibrate -> evaluate, each stage resumable.

Every stage writes its outputs under the work directory and a marker when complete; running a
stage again skips what is done (or continues where the last command stopped), so the whole
pipeline fits in commands of at most 10 minutes (`--max-minutes`). Each command appends its
stages' wall time to `<work>/log.json` (on a GPU that is the GPU time spent) and logs to
`<work>/pipeline.log`.

    <data>/                 regenerate: prompts.jsonl, shards, regenerate.json   (data.py)
    <work>/train/           checkpoint.pt (resume), train.json when done          (trainer.py)
    <work>/drafter/         the exported drafter; calibration.json (calibrate)    (export.py)
    <work>/eval.json        evaluate: tau and acceptance per position per source  (evaluate.py)

Budget for the default target (SmolLM2-135M-Instruct, bf16, one H200; the lead measured plain
batched generation at ~60k output tokens/s at batch 256 with 256-token answers):
- regenerate (<= ~6 min): answers are up to 384 tokens and ~220 on average (GSM8K and HumanEval
  answers end early); ragged lengths and prefill lower the rate, so assume 40k tokens/s.
  24,000 self-written user turns x ~50 tokens ~ 1.2M tokens (~30 s); answers: GSM8K 6,500,
  Alpaca 3,000, Vicuna 1,500, HumanEval 3,000, and one per kept self turn (~14,000 if ~70% end
  properly and 85% fall in the train split) ~ 28,000 x 220 ~ 6.2M tokens (~155 s); plus start-up
  and rendering ~30 s: ~4 min, so 50% slower than assumed still fits in 6.
- train (<= 2 x 10 min): a step is 32 sequences (~450 tokens each, ~14k target tokens) and 64
  anchors x 7 slots each (~14k drafted slots). Target forward ~3.8 TFLOP (its LM head only at
  the labelled rows), drafter forward + backward ~3.6 TFLOP (its 576 x 49,152 LM head dominates),
  and ~15 fp32 passes over [14k, 49,152] logits (~40 GB of memory traffic, ~30-40 GB peak
  memory). At ~150 TFLOP/s and ~4 TB/s that is ~60-80 ms a step, ~13k steps (~15 epochs of the
  ~28k answers, new anchors each time) in 16 minutes. The step count is not guessed: with the
  default total_steps 0 the trainer times its first 30 steps and fixes total_steps to fill
  train_minutes (16), two commands of --max-minutes 9 (each ~40 s of start-up: GGUF
  dequantisation, reading the shards, CUDA initialisation) with the checkpoint between them.
- calibrate + evaluate (<= ~5 min): speculation runs eagerly (~40-60 ms a step). Calibration
  rolls out <= 320 held-out prompts x 256 tokens at once (~100 steps, ~10 s); evaluation runs
  2 temperatures x 5 sources x <= 64 prompts x 256 tokens (~100 steps each, ~1 min); each engine
  start-up (GGUF dequantisation, KV sizing, Triton warm-up) is ~30-60 s. About 3 minutes.
The DFlash ablation (--markov-rank 0) reuses the data (--data-dir) and trains with the same
recipe; give it the DSpark run's step count (--total-steps) for a like-for-like comparison.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.benchmarks.prompts import default_prompts_dir
from dspark.llm import LLM
from dspark.models.llama import build_model
from dspark.models.loader import checkpoint_hash, load_checkpoint, resolve_model
from dspark.train.calibrate import CALIBRATION_FILE, calibrate_drafter, format_ece_table
from dspark.train.data import REGENERATE_DONE_FILE, held_out_texts, read_prompts
from dspark.train.dataset import load_sequences
from dspark.train.evaluate import EvalConfig, compare, evaluate_drafter, format_results
from dspark.train.regenerate import RegenerateConfig, regenerate
from dspark.train.rollouts import full_block_spec
from dspark.train.trainer import TRAIN_DONE_FILE, TrainConfig, Trainer, build_drafter

logger = logging.getLogger(__name__)

STAGES = ("regenerate", "train", "calibrate", "evaluate")
LOG_FILE = "log.json"
EVAL_FILE = "eval.json"

# answers per source (self: user turns sampled); see the budget in the module docstring
DEFAULT_COUNTS = {"gsm8k": 6500, "alpaca": 3000, "vicuna": 1500, "humaneval": 3000, "self": 24000}


@dataclass(frozen=True)
class PipelineConfig:
    work_dir: Path
    data_dir: Path | None = None  # None: <work_dir>/data
    target: str = "default"
    prompts_dir: Path | None = None  # None: the prompt files shipped in dspark/benchmarks/data
    device: str = "auto"
    dtype: str = "auto"
    engine: dict = field(default_factory=dict)  # extra EngineConfig fields for the LLMs
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    calib_prompts_per_source: int = 64
    calib_temperature: float = 1.0
    calib_max_tokens: int = 256
    eval: EvalConfig = field(default_factory=EvalConfig)
    baseline_work_dir: Path | None = None  # evaluate: print tau against that run's eval.json
    max_minutes: float | None = None  # this command's time limit (stages stop and resume)
    progress: bool = True

    @property
    def data(self) -> Path:
        return self.data_dir or self.work_dir / "data"

    @property
    def drafter_dir(self) -> Path:
        return self.work_dir / "drafter"

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def run_pipeline(config: PipelineConfig, stages: tuple[str, ...] = STAGES) -> bool:
    """Run the given stages in order; True when all of them are complete."""
    config.work_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(config.work_dir / "pipeline.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("dspark").addHandler(handler)
    start = time.monotonic()
    deadline = start + 60 * config.max_minutes if config.max_minutes else None
    try:
        for stage in stages:
            if not _run_stage(stage, config, deadline):
                logger.warning("stage %s stopped at the time limit: run the command again to "
                               "resume it", stage)  # fmt: skip
                return False
        if "evaluate" in stages and config.baseline_work_dir is not None:
            _print_comparison(config.work_dir, config.baseline_work_dir)
        return True
    finally:
        logging.getLogger("dspark").removeHandler(handler)
        handler.close()


def _run_stage(stage: str, config: PipelineConfig, deadline: float | None) -> bool:
    if _is_done(stage, config):
        logger.info("stage %s: already complete", stage)
        return True
    device = config.torch_device()
    t0 = time.monotonic()
    done = {"regenerate": _regenerate, "train": _train, "calibrate": _calibrate,
            "evaluate": _evaluate}[stage](config, deadline)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    _log_run(config.work_dir, stage, time.monotonic() - t0, device, done)
    # the stage's engine (its KV cache takes most of the GPU) must be gone before the next one
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return done


def _is_done(stage: str, config: PipelineConfig) -> bool:
    if stage == "regenerate":
        return (config.data / REGENERATE_DONE_FILE).is_file()
    if stage == "train":
        return (config.work_dir / "train" / TRAIN_DONE_FILE).is_file()
    if stage == "calibrate":
        return not config.train.use_confidence or (config.drafter_dir / CALIBRATION_FILE).is_file()
    return (config.work_dir / EVAL_FILE).is_file()


def _log_run(work_dir: Path, stage: str, seconds: float, device: torch.device, done: bool) -> None:
    """Append one stage run to log.json and keep the per-stage totals (the GPU cost) current."""
    path = work_dir / LOG_FILE
    log = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log["runs"].append({"stage": stage, "seconds": round(seconds, 2), "device": name,
                        "completed": done, "time": time.strftime("%Y-%m-%d %H:%M:%S")})  # fmt: skip
    totals: dict[str, float] = {}
    for run in log["runs"]:
        totals[run["stage"]] = round(totals.get(run["stage"], 0.0) + run["seconds"], 2)
    log["seconds_per_stage"] = totals
    log["seconds_total"] = round(sum(totals.values()), 2)
    path.write_text(json.dumps(log, indent=1))
    logger.info("stage %s: %.1f s on %s (%s)", stage, seconds, name,
                "complete" if done else "to be resumed")  # fmt: skip


# ---- the stages ------------------------------------------------------------------------------


def _llm(config: PipelineConfig, speculative: bool = False) -> LLM:
    kwargs = dict(config.engine)
    if speculative:  # full-block verification (the confidence recorder observes every step)
        kwargs["speculative_config"] = full_block_spec(config.drafter_dir, config.train.draft_len)
    return LLM(config.target, dtype=config.dtype, device=config.device, **kwargs)


def _regenerate(config: PipelineConfig, deadline: float | None) -> bool:
    prompts_dir = config.prompts_dir or default_prompts_dir()
    return regenerate(_llm(config), config.data, prompts_dir, config.regenerate, deadline)


def _train(config: PipelineConfig, deadline: float | None) -> bool:
    device = config.torch_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    source = resolve_model(config.target)
    model_config, weights = load_checkpoint(source)
    backend = "triton" if device.type == "cuda" else "torch"
    target = build_model(model_config, weights, dtype, device, backend)
    del weights
    seqs, per_source = load_sequences(config.data, config.train.max_seq_len)
    logger.info("train: %d sequences %s", len(seqs), dict(per_source))
    drafter = build_drafter(target, checkpoint_hash(source), config.train)
    trainer = Trainer(target, drafter, seqs, config.train)
    return trainer.run(config.work_dir, deadline, config.progress)


def _calibrate(config: PipelineConfig, deadline: float | None) -> bool:
    held_out = held_out_texts(read_prompts(config.data), "calib")
    texts = [t for rows in held_out.values() for t in rows[: config.calib_prompts_per_source]]
    report = calibrate_drafter(
        _llm(config, speculative=True), config.drafter_dir, texts, config.calib_temperature,
        config.calib_max_tokens, config.eval.seed, config.progress,
    )  # fmt: skip
    print(f"STS calibration on {report['num_blocks']} full blocks ({len(texts)} prompts):")
    print(format_ece_table(report))
    return True


def _evaluate(config: PipelineConfig, deadline: float | None) -> bool:
    texts = held_out_texts(read_prompts(config.data), "eval")
    results = evaluate_drafter(_llm(config, speculative=True), texts, config.eval,
                               str(config.drafter_dir), config.progress)  # fmt: skip
    results["drafter"] = {"markov_rank": config.train.markov_rank,
                          "use_confidence": config.train.use_confidence}  # fmt: skip
    (config.work_dir / EVAL_FILE).write_text(json.dumps(results, indent=1))
    print(format_results({k: v for k, v in results.items() if k.startswith("T=")}))
    return True


def _print_comparison(work_dir: Path, baseline_dir: Path) -> None:
    """tau against another run's eval.json (no GPU: both are read from their files)."""
    if not (baseline_dir / EVAL_FILE).is_file():
        logger.warning("no %s in %s: nothing to compare with", EVAL_FILE, baseline_dir)
        return
    results = json.loads((work_dir / EVAL_FILE).read_text())
    print(compare(results, json.loads((baseline_dir / EVAL_FILE).read_text())))
