"""Full-block rollouts through the engine, recording what STS calibration needs
(docs/SPECULATION.md 3.3).

Per verify step and window row: the drafter's raw confidence logits (K) and how many drafts the
target accepted. From those, the prefix labels y_k = 1[drafts 1..k all accepted] = 1[accepted >= k].

The recorder is an observer of the engine's own SpecDecoder (the path every speculative request
takes, eager or replayed from a CUDA graph): after each verified step's host sync the runner
hands it the step's live windows, their accepted counts and the drafter's raw confidence
logits, in the same row order, so a step's labels are paired with that step's confidences:

  step t:  draft -> target forward -> verify -> host sync
           observer(verify_len [R], num_accepted [R], confidence logits [R, K])
                                                    -> rows with verify_len == K recorded

Rows verified with fewer than K drafts (windows shortened near max_tokens) are dropped: their
later labels are censored, and a censored label reads as a rejection (docs/SPECULATION.md 3.3).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.llm import LLM
from dspark.outputs import RequestOutput
from dspark.sampling_params import SamplingParams
from dspark.spec.spec_decoder import SpecDecoder
from dspark.train.data import answer_seed, prompt_key, render

logger = logging.getLogger(__name__)


@dataclass
class ConfidenceRecorder:
    draft_len: int
    confidence_logits: list[torch.Tensor] = field(default_factory=list)  # [n, K] per step
    num_accepted: list[torch.Tensor] = field(default_factory=list)  # [n] per step
    num_censored: int = 0  # rows verified with fewer than K drafts

    def __call__(
        self, verify_len: list[int], num_accepted: list[int], confidence: torch.Tensor | None
    ) -> None:
        assert confidence is not None, "the drafter has no confidence head"
        logits = confidence.float().cpu()  # the host copy, ready after the step's sync
        assert logits.shape == (len(verify_len), self.draft_len), logits.shape
        full = torch.tensor(verify_len) == self.draft_len
        self.num_censored += int((~full).sum())
        self.confidence_logits.append(logits[full])
        self.num_accepted.append(torch.tensor(num_accepted, dtype=torch.int64)[full])

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw confidence logits [N, K], prefix labels [N, K] float 0/1)."""
        logits = torch.cat(self.confidence_logits) if self.confidence_logits else None
        if logits is None:
            return torch.zeros(0, self.draft_len), torch.zeros(0, self.draft_len)
        accepted = torch.cat(self.num_accepted)  # [N]
        labels = accepted[:, None] >= torch.arange(1, self.draft_len + 1)  # [N, K]
        return logits, labels.float()


def full_block_spec(drafter: str | Path, draft_len: int | None = None) -> dict:
    """The speculative_config of calibration and evaluation: every step drafts and verifies the
    whole block. Scheduling is off, so a cost table beside the drafter (a shipped drafter has
    one) cannot turn drafting off for some steps and bias tau and the labels."""
    spec = {"method": "dspark", "model": str(drafter), "scheduling": False}
    if draft_len is not None:
        spec["num_speculative_tokens"] = draft_len
    return spec


def require_full_blocks(llm: LLM, purpose: str) -> SpecDecoder:
    """The engine's SpecDecoder, checked to verify the full block at every step."""
    spec: SpecDecoder | None = llm.engine.spec
    if spec is None:
        raise ValueError(f"{purpose} needs an LLM with speculative_config")
    if spec.num_verify != spec.draft_len:
        raise ValueError(
            f"{purpose} needs full-block verification: num_speculative_tokens is "
            f"{spec.num_verify}, the drafter drafts {spec.draft_len}"
        )
    if llm.engine.policy is not None:
        raise ValueError(
            f"{purpose} needs full-block verification, but the engine decides drafting per "
            f"step ({llm.engine.scheduling_status}): build it with speculative_config "
            f'"scheduling": false (full_block_spec)'
        )
    return spec


@contextlib.contextmanager
def record_confidences(llm: LLM) -> Iterator[ConfidenceRecorder]:
    """Record every full-block verify step the engine runs inside the `with` block."""
    spec = require_full_blocks(llm, "calibration")
    if spec.drafter.confidence is None:
        raise ValueError("recording confidences needs a drafter with a confidence head")
    recorder = ConfidenceRecorder(spec.draft_len)
    spec.observers.append(recorder)
    try:
        yield recorder
    finally:
        spec.observers.remove(recorder)


def rollout(
    llm: LLM, texts: list[str], temperature: float, max_tokens: int, seed: int = 0,
    progress: bool = True,
) -> list[RequestOutput]:  # fmt: skip
    """Chat-rendered prompts answered with plain sampling (no top-k/top-p), seeded per prompt.

    Prompts too long for the engine's max_model_len are skipped, with a warning."""
    tok = llm.get_tokenizer()
    rendered = [render(tok, t) for t in texts]
    limit = llm.engine.max_model_len - max_tokens
    kept = [(t, ids) for t, ids in zip(texts, rendered, strict=True) if len(ids) <= limit]
    if len(kept) < len(texts):
        logger.warning("rollout: %d of %d prompts skipped (longer than %d tokens)",
                       len(texts) - len(kept), len(texts), limit)  # fmt: skip
    params = [
        SamplingParams(temperature=temperature, max_tokens=max_tokens,
                       seed=answer_seed(seed, "rollout", prompt_key(t), 0))
        for t, _ in kept
    ]  # fmt: skip
    prompts = [{"prompt_token_ids": ids} for _, ids in kept]
    return llm.generate(prompts, params, use_tqdm=progress) if prompts else []
