"""Training on CUDA (bf16 autocast, the triton target), against the CPU's fp32 reference.

Skipped without a GPU; the lead's first check on the H200 before `dspark train`."""

from __future__ import annotations

import pytest
import torch

from dspark.models.llama import build_model
from dspark.models.loader import checkpoint_hash, load_checkpoint, resolve_model
from dspark.train.trainer import TrainConfig, Trainer, build_drafter
from tests.train.conftest import TEXTS
from tests.train.test_trainer import _loss

pytestmark = pytest.mark.gpu


def _setup(tiny_llama_dir, device: str, dtype: torch.dtype, backend: str):
    from dspark.models.tokenizer import load_tokenizer
    from dspark.train.anchors import Sequence

    source = resolve_model(str(tiny_llama_dir))
    config, weights = load_checkpoint(source)
    target = build_model(config, weights, dtype, torch.device(device), backend)
    tok = load_tokenizer(source)
    seqs = []
    for prompt, answer in TEXTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
        seqs.append(Sequence(ids + tok.encode(answer, add_special_tokens=False), len(ids)))
    cfg = TrainConfig(draft_len=7, markov_rank=16, batch_size=2, anchors_per_seq=8, lr=3e-3,
                      warmup_steps=2, total_steps=20)  # fmt: skip
    trainer = Trainer(target, build_drafter(target, checkpoint_hash(source), cfg), seqs, cfg)
    return trainer, seqs


def test_cuda_bf16_losses_match_cpu_and_training_reduces_them(tiny_llama_dir):
    cpu, seqs = _setup(tiny_llama_dir, "cpu", torch.float32, "torch")
    gpu, _ = _setup(tiny_llama_dir, "cuda", torch.bfloat16, "triton")
    gpu.drafter.load_state_dict(cpu.drafter.state_dict())  # the same initial weights
    ref, got = _loss(cpu, seqs), _loss(gpu, seqs)
    for name in ("total", "ce", "l1", "confidence"):
        a, b = float(getattr(ref, name)), float(getattr(got, name))
        assert abs(a - b) < 0.05 * abs(a) + 0.02, (name, a, b)  # bf16 target and autocast
    for _ in range(12):
        gpu.train_step()
    after = _loss(gpu, seqs)
    assert after.total < 0.9 * got.total and after.ce < got.ce
