"""Sampling parameters per row of the step, kept from step to step (the persistent batch).

Row i holds the parameters of the request whose block-table row it is (PersistentBatch moves and
writes both together), so a step whose rows merely continue sets up sampling with a few numpy
slices instead of reading every request's SamplingParams: a request's parameters never change.
"""

from __future__ import annotations

import numpy as np
import torch

from dspark.request import Request
from dspark.runner.input_buffers import host_to_device
from dspark.sample.sampler import SamplingTensors

NO_LOGPROBS = -1  # the row's request asks for no logprobs


class SamplingRows:
    def __init__(self, max_rows: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.temperature = np.zeros(max_rows, dtype=np.float32)  # 0: greedy
        self.top_k = np.full(max_rows, vocab_size, dtype=np.int64)  # vocab_size: no top-k
        self.top_p = np.ones(max_rows, dtype=np.float32)
        self.seed = np.zeros(max_rows, dtype=np.int64)
        # the token count at which the min_tokens ban lifts: a row ending before it may not
        # stop (num_prompt_tokens + min_tokens; 0 without min_tokens)
        self.min_tokens_end = np.zeros(max_rows, dtype=np.int64)
        self.logprobs = np.full(max_rows, NO_LOGPROBS, dtype=np.int64)
        self._fields = (self.temperature, self.top_k, self.top_p, self.seed,
                        self.min_tokens_end, self.logprobs)  # fmt: skip

    def write(self, row: int, req: Request) -> None:
        sp = req.sampling_params
        self.temperature[row] = sp.temperature
        self.top_k[row] = sp.top_k if sp.top_k > 0 else self.vocab_size
        self.top_p[row] = sp.top_p
        self.seed[row] = req.seed
        self.min_tokens_end[row] = req.num_prompt_tokens + sp.min_tokens if sp.min_tokens else 0
        self.logprobs[row] = NO_LOGPROBS if sp.logprobs is None else sp.logprobs

    def move(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Rows dst <- rows src (each side read before any is written, as numpy does)."""
        for field in self._fields:
            field[dst] = field[src]

    def tensors(
        self, rows: np.ndarray, positions: np.ndarray, device: torch.device
    ) -> SamplingTensors:
        """The sampling tensors of `rows` [N], sampling the tokens at `positions` [N]."""
        temperature, top_k, top_p = self.temperature[rows], self.top_k[rows], self.top_p[rows]
        return SamplingTensors(
            temperature=host_to_device(temperature, torch.float32, device),
            top_k=host_to_device(top_k, torch.int64, device),
            top_p=host_to_device(top_p, torch.float32, device),
            seeds=host_to_device(self.seed[rows], torch.int64, device),
            positions=host_to_device(positions, torch.int64, device),
            all_greedy=not temperature.any(),
            any_top_k=bool((top_k < self.vocab_size).any()),
            any_top_p=bool((top_p < 1.0).any()),
            max_top_k=int(top_k.max(initial=0)),  # (vocab_size when a row has no top-k)
        )

    def all_greedy(self, rows: np.ndarray) -> bool:
        return not self.temperature[rows].any()

    def max_logprobs(self, rows: np.ndarray) -> int | None:
        """The most top logprobs any of `rows` asks for (None: none asks)."""
        most = int(self.logprobs[rows].max(initial=NO_LOGPROBS))
        return None if most == NO_LOGPROBS else most

    def banned(
        self, rows: np.ndarray, ends: np.ndarray, reqs: list[Request]
    ) -> tuple[list[int], list[int]]:
        """min_tokens: (index into `rows`, token id) pairs a row may not sample, because the
        token at index ends[j] of its request would be an output before its minimum.

          rows [0, 1, 2], ends [9, 12, 20], min_tokens_end [0, 14, 14] -> only j = 1 is banned
          (request 1 has 12 tokens before the one sampled: its output reaches 14 later)
        """
        under = np.flatnonzero(ends < self.min_tokens_end[rows])
        banned_rows, banned_ids = [], []
        for j in under.tolist():
            req = reqs[int(rows[j])]
            sp = req.sampling_params
            ids = list(sp.stop_token_ids)
            if req.eos_token_id is not None and not sp.ignore_eos:
                ids.append(req.eos_token_id)
            banned_rows.extend([j] * len(ids))
            banned_ids.extend(ids)
        return banned_rows, banned_ids
