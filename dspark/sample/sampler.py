"""Turn logits into tokens: temperature, top-k, top-p, greedy, seeded per (seed, position).

A token is drawn by inversion with one uniform per row: the first token whose cumulative
probability exceeds u times the total (`inverse_cdf`), u from the counter-based generator, so a
row's draw depends only on its (seed, position) and its probs. An exponential race (argmax of
probs_v / E_v) needs one uniform per vocabulary entry instead, 49,152 hashes a row; with it,
temperature-1 plain decoding ran 1.5x slower than greedy at one request and 1.8x at 256 on the
H200. The inversion has not been timed on the GPU yet.

On CUDA, a batch whose rows have neither top-k nor top-p is drawn in two Triton launches
(kernels/markov_sample_triton.py, `sample_rows`) instead of about ten: a sampled plain step cost
0.88-0.97x on the H200. DSPARK_REFERENCE_OPS keeps the PyTorch ops. The two sum in another order, so
a draw whose u Z falls within rounding of a boundary between two tokens may differ between them: a
seeded request batched with a row that uses top-k or top-p (which takes the whole batch to PyTorch)
can, that rarely, draw another token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark import envs
from dspark.kernels.inverse_cdf import inverse_cdf  # (re-exported: the draws use it)
from dspark.sample.logits_shaping import apply_min_p
from dspark.sample.random import STREAM_SAMPLE, uniform


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters on the device, and host flags that let us skip work."""

    temperature: torch.Tensor  # [N] float32; 0 means greedy
    top_k: torch.Tensor  # [N] int64; vocab_size means no top-k
    top_p: torch.Tensor  # [N] float32; 1.0 means no top-p
    seeds: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, position of the token being sampled
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    # every row's top-k is at most this (host-known, set by eager steps only): top-k and top-p
    # then run on the rows' `max_top_k` largest logits instead of sorting the vocabulary
    max_top_k: int | None = None
    # [N] float32, each row's min_p (0: none); None when no row has one
    # (sample/logits_shaping.py: applied after temperature, before top-k and top-p)
    min_p: torch.Tensor | None = None


TOPK_PATH_MAX = 1024  # the largest max_top_k taken by the top-k path (beyond it: the sort)

FUSED_SAMPLE = not envs.ENVS.reference_ops  # (module docstring)


def takes_fused_path(st: SamplingTensors) -> bool:
    """Does `sample` draw these rows with the two-launch kernel (on CUDA): some row samples,
    none has top-k, top-p or min_p?"""
    return FUSED_SAMPLE and not (st.all_greedy or st.any_top_k or st.any_top_p or
                                 st.min_p is not None)  # fmt: skip


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int | None = None,  # every row's top_k <= this: only that many are ranked
) -> torch.Tensor:
    """Mask logits [N, V] to -inf outside each row's top-k and top-p nucleus (keeps >= 1).

    The candidates are the whole vocabulary, sorted, or with `max_top_k` (<= TOPK_PATH_MAX)
    only each row's max_top_k largest logits (torch.topk, sorted): the tokens past them are
    outside every row's top-k anyway, so the kept set is the same (up to which of equal
    logits at the boundary is kept).
    """
    if max_top_k is not None and top_k is not None and max_top_k <= TOPK_PATH_MAX:
        sorted_logits, order = logits.topk(min(max_top_k, logits.shape[-1]), dim=-1)
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    vocab = sorted_logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop |= rank >= top_k[:, None]
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly higher-ranked tokens
        drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if vocab < logits.shape[-1]:  # (the top-k path: the rest of the vocabulary is out)
        return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sampling_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The exact distribution each row samples from [N, V] (after temperature, min_p, top-k and
    top-p; `logits` already shaped by sample/logits_shaping.py where a row asks for it).

    Greedy rows get their temperature treated as 1 here; callers take argmax for them.
    """
    temperature = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    logits = logits / temperature[:, None]
    if st.min_p is not None:
        logits = apply_min_p(logits, st.min_p)
    if st.any_top_k or st.any_top_p:
        logits = apply_top_k_top_p(
            logits, st.top_k if st.any_top_k else None, st.top_p if st.any_top_p else None,
            st.max_top_k,
        )  # fmt: skip
    return logits.softmax(dim=-1)


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Sample one token per row: logits [N, V] float32 -> [N] int64."""
    if logits.is_cuda and takes_fused_path(st):
        from dspark.kernels.markov_sample_triton import sample_rows

        u = uniform(st.seeds, st.positions, STREAM_SAMPLE)
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        return sample_rows(logits, st.temperature.contiguous(), u, out)
    greedy = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy
    probs = sampling_probs(logits, st)
    sampled = inverse_cdf(probs, uniform(st.seeds, st.positions, STREAM_SAMPLE))  # [N]
    return torch.where(st.temperature > 0, sampled, greedy)


def top_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw-model log-probabilities: of each sampled token [N], and the top `num` [N, num] x2."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    top = logprobs.topk(num, dim=-1) if num > 0 else None
    if top is None:
        empty = logprobs[:, :0]
        return chosen, empty.long(), empty
    return chosen, top.indices, top.values
