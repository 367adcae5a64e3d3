"""The train stage: self-distillation of a DSpark drafter from its frozen target
(docs/SPECULATION.md 3.1).

One step:
    seqs   = batch_order.indices(step)               # resumable: a pure function of the step
    blocks = build_blocks(seqs, A anchors, K)        # anchors, labels, prefix masks
    target = TargetRunner.run(seqs, blocks)          # tap features + target logits, no grad
    hidden = drafter.forward_train(features, anchors, anchor positions)
    logits = U + bias(prev), conf = c_raw(h, prev)   # prev: labels shifted by one (teacher forcing)
    loss   = 0.1 CE + 0.9 L1 + 1.0 BCE(conf, soft label)
Only the drafter's parameters train (the target, its embedding and LM head are frozen). AdamW,
linear warm-up then cosine decay to min_lr_ratio * lr, grad clip, bf16 autocast on CUDA (fp32
master weights) and plain fp32 on the CPU.

Checkpoints (`<work>/train/checkpoint.pt`: drafter, optimizer, step, schedule) are written every
save_every steps and when the command's time limit is reached, so the next command resumes at the
same step with the same batches. At the end the drafter is exported to `<work>/drafter`.

total_steps = 0 sizes the run to a time budget: the median time of the last measure_steps steps
of the warm-up fixes total_steps = train_minutes * 60 / step_time once, stored in the checkpoint
(the cosine needs the end to be known; the schedule up to that point does not depend on it). The
first steps are not timed: each new batch shape compiles kernels, and on the H200 the median of
steps 3-30 read 0.24 s against a steady 0.07-0.09 s, which sized a 7-minute run to 3 minutes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.models.drafter_config import CONFIG_FILE, DrafterConfig
from dspark.models.dspark_drafter import DSparkDrafter, read_weights, target_identity
from dspark.models.llama import LlamaForCausalLM
from dspark.train.anchors import Sequence, build_blocks
from dspark.train.dataset import BatchOrder
from dspark.train.export import export_drafter
from dspark.train.features import TargetRunner
from dspark.train.losses import (
    LossTerms,
    LossWeights,
    chunked_drafter_losses,
    drafter_losses,
    expected_block_tokens,
)
from dspark.train.vocab_loss import DEFAULT_CHUNK_SLOTS

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
TRAIN_DONE_FILE = "train.json"


@dataclass(frozen=True)
class TrainConfig:
    draft_len: int = 7
    target_layers: tuple[int, ...] | None = None  # None: default_taps(target layers)
    num_layers: int = 2
    markov_rank: int = 64  # 0: the DFlash ablation (no Markov head, no confidence head)
    batch_size: int = 32  # sequences per step
    anchors_per_seq: int = 64
    max_seq_len: int = 1024
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    total_steps: int = 0  # 0: sized to train_minutes from the warm-up's last measure_steps steps
    train_minutes: float = 16.0
    measure_steps: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    save_every: int = 500
    log_every: int = 25
    seed: int = 0
    loss: LossWeights = field(default_factory=LossWeights)
    # slots per chunk of the vocabulary-sized loss terms (vocab_loss.py); 0: the reference
    # drafter_losses over materialised [N K, V] logits (slower, for comparison)
    chunk_slots: int = DEFAULT_CHUNK_SLOTS
    # a drafter directory to start from (its weights; the same architecture and target), e.g.
    # the shipped drafter, to train further with a new schedule; None: a fresh initialisation
    init_from: str | None = None

    @property
    def use_confidence(self) -> bool:
        return self.markov_rank > 0

    def __post_init__(self) -> None:
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.total_steps == 0 and self.warmup_steps <= self.measure_steps:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must exceed measure_steps "
                f"({self.measure_steps}) when total_steps is sized from the time budget"
            )


def default_taps(num_layers: int, num_taps: int = 4) -> tuple[int, ...]:
    """Taps spread over depth: (1, 10, 19, 28) for 30 layers; every layer of a shallow model."""
    if num_layers <= num_taps:
        return tuple(range(num_layers))
    step = (num_layers - 3) / (num_taps - 1)
    return tuple(round(1 + i * step) for i in range(num_taps))


def lr_at(step: int, config: TrainConfig, total_steps: int) -> float:
    """Linear warm-up to lr, then cosine decay to min_lr_ratio * lr at total_steps."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_drafter(
    target: LlamaForCausalLM, weights_hash: str, config: TrainConfig
) -> DSparkDrafter:
    """A freshly initialised drafter: fp32 on the target's device, torch ops (autograd)."""
    taps = config.target_layers or default_taps(target.config.num_layers)
    drafter_config = DrafterConfig(
        target_identity(target, weights_hash), draft_len=config.draft_len, target_layers=taps,
        num_layers=config.num_layers, markov_rank=config.markov_rank,
        use_confidence=config.use_confidence,
    )  # fmt: skip
    torch.manual_seed(config.seed)
    drafter = DSparkDrafter(drafter_config, target, weights_hash, backend="torch")
    if config.init_from is not None:
        _load_initial_weights(drafter, Path(config.init_from))
        return drafter.to(target.embed_tokens.weight.device).train()
    with torch.no_grad():
        # MASK starts as a typical token embedding; the Markov bias starts at zero (W2 = 0),
        # so the untrained drafter is a plain DFlash drafter and W1 learns through W2
        std = target.embed_tokens.weight.float().std()
        drafter.mask_embedding.normal_(0.0, float(std))
        if drafter.markov_out is not None:
            drafter.markov_out.weight.zero_()
    return drafter.to(target.embed_tokens.weight.device).train()


def _load_initial_weights(drafter: DSparkDrafter, directory: Path) -> None:
    """Start from a saved drafter: its architecture must be this run's, tensor for tensor."""
    saved = DrafterConfig.from_dict(json.loads((directory / CONFIG_FILE).read_text()))
    live = drafter.config
    for name in ("target", "draft_len", "target_layers", "num_layers", "markov_rank",
                 "use_confidence"):  # fmt: skip
        if getattr(saved, name) != getattr(live, name):
            raise ValueError(
                f"--init-from {directory}: its {name} is {getattr(saved, name)!r}, this run's "
                f"is {getattr(live, name)!r}"
            )
    weights = {k: v.float() for k, v in read_weights(directory).items()}
    drafter.load_state_dict(weights)


class Trainer:
    def __init__(
        self,
        target: LlamaForCausalLM,
        drafter: DSparkDrafter,
        seqs: list[Sequence],
        config: TrainConfig,
    ) -> None:
        self.drafter = drafter
        self.config = config
        self.seqs = seqs
        self.device = target.embed_tokens.weight.device
        self.runner = TargetRunner(target, drafter.config.target_layers)
        self.order = BatchOrder(len(seqs), config.batch_size, config.seed)
        decay = [p for p in drafter.parameters() if p.dim() >= 2]
        no_decay = [p for p in drafter.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr, betas=(0.9, 0.95),
        )  # fmt: skip
        self.step = 0
        self.total_steps = config.total_steps
        self.step_seconds: list[float] = []
        self.window_seconds: list[float] = []  # the timed steps that size total_steps
        self.history: list[dict] = []

    # ---- one step ---------------------------------------------------------------------------

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def losses(self, seqs: list[Sequence], generator: torch.Generator) -> LossTerms:
        """The loss terms of one batch (anchors drawn from `generator`), with autograd."""
        cfg, d = self.config, self.drafter
        blocks = build_blocks(seqs, cfg.anchors_per_seq, cfg.draft_len, generator)
        target = self.runner.run(seqs, blocks, logits=cfg.chunk_slots == 0)
        dev = self.device
        anchors, labels = blocks.anchors.to(dev), blocks.labels.to(dev)  # [B, A], [B, A, K]
        mask = blocks.mask.to(dev)
        K = cfg.draft_len
        with self._autocast():
            hidden = d.forward_train(target.features, anchors, blocks.anchor_positions.to(dev))
            prev = torch.cat([anchors[..., None], labels[..., :-1]], dim=-1)  # [B, A, K]
            conf = d.confidence_logit(hidden, prev) if d.confidence is not None else None
            conf = None if conf is None else conf.view(-1, K)
            if cfg.chunk_slots:
                u = None if d.markov_in is None else d.markov_in(prev).flatten(0, 1)
                return chunked_drafter_losses(
                    hidden.view(-1, K, hidden.shape[-1]), u,
                    None if d.markov_out is None else d.markov_out.weight,
                    d.target.lm_head.weight, target.final_hidden.view(-1, K, hidden.shape[-1]),
                    labels.view(-1, K), mask.view(-1, K), conf, cfg.loss, cfg.chunk_slots,
                )  # fmt: skip
            draft_logits = d.base_logits(hidden) + d.markov_bias(prev)  # [B, A, K, V]
        V = draft_logits.shape[-1]
        return drafter_losses(
            draft_logits.view(-1, K, V), target.logits.view(-1, K, V), labels.view(-1, K),
            mask.view(-1, K), conf, cfg.loss,
        )  # fmt: skip

    def batch(self, step: int) -> list[Sequence]:
        return [self.seqs[i] for i in self.order.indices(step)]

    def anchor_generator(self, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.config.seed * 1_000_003 + step)

    def train_step(self) -> LossTerms:
        cfg = self.config
        lr = lr_at(self.step, cfg, self.total_steps or 10**9)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        terms = self.losses(self.batch(self.step), self.anchor_generator(self.step))
        self.optimizer.zero_grad(set_to_none=True)
        terms.total.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.step += 1
        return terms

    # ---- the loop ---------------------------------------------------------------------------

    def run(self, work_dir: Path, deadline: float | None = None, progress: bool = True) -> bool:
        """Train to total_steps; True when done (drafter exported), False at the deadline."""
        train_dir = work_dir / "train"
        train_dir.mkdir(parents=True, exist_ok=True)
        self.resume(train_dir / CHECKPOINT_FILE)
        bar = tqdm(initial=self.step, total=self.total_steps or None, desc="train",
                   disable=not progress)  # fmt: skip
        while not self.total_steps or self.step < self.total_steps:
            if deadline is not None and time.monotonic() > deadline:
                self.save(train_dir / CHECKPOINT_FILE)
                logger.info("train: time limit reached at step %d, checkpoint saved", self.step)
                bar.close()
                return False
            timed = self._in_measure_window()
            t0 = time.monotonic()
            terms = self.train_step()
            if timed and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # sync: timed steps measure the GPU's work
            self._after_step(terms, time.monotonic() - t0, bar, timed)
            if self.step % self.config.save_every == 0:
                self.save(train_dir / CHECKPOINT_FILE)
        bar.close()
        self.save(train_dir / CHECKPOINT_FILE)
        export_drafter(self.drafter, work_dir / "drafter")
        summary = {"steps": self.step, "history": self.history[-20:], "config": asdict(self.config)}
        (train_dir / TRAIN_DONE_FILE).write_text(json.dumps(summary, indent=1))
        return True

    def _in_measure_window(self) -> bool:
        """Is the step about to run timed? The last measure_steps steps of the warm-up are, while
        total_steps is still open (e.g. warm-up 100, measure 30: steps 71-100)."""
        cfg = self.config
        return not self.total_steps and self.step >= cfg.warmup_steps - cfg.measure_steps

    def _after_step(self, terms: LossTerms, seconds: float, bar: tqdm, timed: bool) -> None:
        cfg = self.config
        self.step_seconds.append(seconds)
        if timed:
            self.window_seconds.append(seconds)
        if not self.total_steps and self.step >= cfg.warmup_steps:
            typical = statistics.median(
                self.window_seconds or self.step_seconds[-cfg.measure_steps :]
            )
            self.total_steps = max(cfg.warmup_steps + 1, int(cfg.train_minutes * 60 / typical))
            bar.total = self.total_steps
            logger.info("train: %.3f s/step -> total_steps %d for %.1f minutes",
                        typical, self.total_steps, cfg.train_minutes)  # fmt: skip
        bar.update(1)
        if self.step % cfg.log_every == 0 or self.step == self.total_steps:
            # sync: float() of the loss terms, on logging steps only
            row = {
                "step": self.step, "loss": terms.total.item(), "ce": terms.ce.item(),
                "l1": terms.l1.item(), "confidence": terms.confidence.item(),
                "lr": self.optimizer.param_groups[0]["lr"], "seconds_per_step": seconds,
                "epoch": self.order.epoch(self.step),
                "tau_estimate": expected_block_tokens(terms.soft_label, terms.mask),
            }  # fmt: skip
            self.history.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", l1=f"{row['l1']:.3f}")
            logger.info("train: %s", json.dumps(row))

    # ---- checkpoints ------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        state = {
            "step": self.step,
            "total_steps": self.total_steps,
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "config": asdict(self.config),
            "drafter_config": self.drafter.config.to_dict(),
            "step_seconds": self.step_seconds[-1000:],
            "window_seconds": self.window_seconds,
            "history": self.history,
        }
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)  # a checkpoint that exists is complete

    def resume(self, path: Path) -> None:
        if not path.is_file():
            return
        # weights_only: tensors and plain values only, so a file planted in a work directory
        # cannot run code when it is unpickled (the checkpoint holds nothing else: save())
        try:
            state = torch.load(path, map_location=self.device, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(
                f"{path} could not be loaded as plain tensors and values (a checkpoint this "
                f"trainer wrote holds nothing else); delete it or use a new --work-dir: {e}"
            ) from None
        if state["drafter_config"] != self.drafter.config.to_dict():
            raise ValueError(
                f"{path} was written for another drafter configuration "
                f"({state['drafter_config']}); use a new --work-dir or the same options"
            )
        changed = sorted(k for k, v in asdict(self.config).items() if state["config"].get(k) != v)
        if changed:
            logger.warning("train: resuming with changed options %s (the checkpoint's schedule "
                           "and step count are kept)", changed)  # fmt: skip
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.total_steps = state["step"], state["total_steps"]
        self.step_seconds, self.history = state["step_seconds"], state["history"]
        self.window_seconds = state.get("window_seconds", [])
        logger.info("train: resumed at step %d of %s", self.step, self.total_steps or "auto")
