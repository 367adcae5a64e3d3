"""Sampling parameters per row of the step, kept from step to step (the persistent batch).

Row i holds the parameters of the request whose block-table row it is (PersistentBatch moves and
writes both together), so a step whose rows merely continue sets up sampling with a few numpy
slices instead of reading every request's SamplingParams: a request's parameters never change.
"""

from __future__ import annotations

import numpy as np
import torch

from dspark.device_buffers import staging_pair
from dspark.request import Request
from dspark.sample.logits_shaping import LogitsShaping, build_shaping
from dspark.sample.sampler import SamplingTensors

CPU = torch.device("cpu")
NO_LOGPROBS = -1  # the row's request asks for no logprobs


class SamplingRows:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device = CPU) -> None:
        self.vocab_size = vocab_size
        self.temperature = np.zeros(max_rows, dtype=np.float32)  # 0: greedy
        self.top_k = np.full(max_rows, vocab_size, dtype=np.int64)  # vocab_size: no top-k
        self.top_p = np.ones(max_rows, dtype=np.float32)
        self.seed = np.zeros(max_rows, dtype=np.int64)
        # the token count at which the min_tokens ban lifts: a row ending before it may not
        # stop (num_prompt_tokens + min_tokens; 0 without min_tokens)
        self.min_tokens_end = np.zeros(max_rows, dtype=np.int64)
        self.logprobs = np.full(max_rows, NO_LOGPROBS, dtype=np.int64)
        # the row's request shapes its logits (penalties, min_p, logit_bias, bad words): the
        # step builds sample/logits_shaping.py's tensors for it and samples in PyTorch
        self.shapes_logits = np.zeros(max_rows, dtype=bool)
        self._fields = (self.temperature, self.top_k, self.top_p, self.seed,
                        self.min_tokens_end, self.logprobs, self.shapes_logits)  # fmt: skip
        # a step's sampled rows' parameters, one field a row (stage): pinned host buffers and
        # their device twins, two copies a step (one buffer each on the CPU)
        self._floats, self._floats_dev = staging_pair((2, max_rows), torch.float32, device)
        self._ints, self._ints_dev = staging_pair((3, max_rows), torch.int64, device)
        self._floats_np, self._ints_np = self._floats.numpy(), self._ints.numpy()

    def write(self, row: int, req: Request) -> None:
        sp = req.sampling_params
        self.temperature[row] = sp.temperature
        self.top_k[row] = sp.top_k if sp.top_k > 0 else self.vocab_size
        self.top_p[row] = sp.top_p
        self.seed[row] = req.seed
        self.min_tokens_end[row] = req.num_prompt_tokens + sp.min_tokens if sp.min_tokens else 0
        self.logprobs[row] = NO_LOGPROBS if sp.logprobs is None else sp.logprobs
        self.shapes_logits[row] = sp.shapes_logits

    def move(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Rows dst <- rows src (each side read before any is written, as numpy does)."""
        for field in self._fields:
            field[dst] = field[src]

    def stage(self, rows: np.ndarray, positions: np.ndarray) -> SamplingTensors:
        """The sampling tensors of `rows` [N], sampling the tokens at `positions` [N], written
        into the persistent staging buffers and copied to the device asynchronously:

          max_rows 4, N = 2:  floats [[t0 t1 . .]     temperature = floats[0, :2]
                                      [p0 p1 . .]]    top_p       = floats[1, :2]
                              ints   [[k0 k1 . .]     top_k       = ints[0, :2]
                                      [s0 s1 . .]     seeds       = ints[1, :2]
                                      [x0 x1 . .]]    positions   = ints[2, :2]

        Two copies of buffers that stay allocated (a few kB: whole, not per field), where
        uploading each field on its own pinned five host buffers and queued five copies a
        step. Each field starts at a fixed address whatever N, as a captured graph that
        samples would need. Call it after the step's wait_for_upload and before its upload
        (ModelRunner.launch): the input buffers' upload fence, recorded behind these copies,
        keeps the next step from rewriting the staging buffers under a queued copy. The
        tensors are views, valid for this step."""
        n = rows.size
        temperature, top_k, top_p = self.temperature[rows], self.top_k[rows], self.top_p[rows]
        floats, ints = self._floats_np, self._ints_np
        floats[0, :n], floats[1, :n] = temperature, top_p
        ints[0, :n], ints[1, :n], ints[2, :n] = top_k, self.seed[rows], positions
        f, i = self._floats_dev, self._ints_dev
        if f is not self._floats:  # (the CPU reads the staging buffers themselves)
            f.copy_(self._floats, non_blocking=True)
            i.copy_(self._ints, non_blocking=True)
        return SamplingTensors(
            **self._device_views(n),
            all_greedy=not temperature.any(),
            any_top_k=bool((top_k < self.vocab_size).any()),
            any_top_p=bool((top_p < 1.0).any()),
            max_top_k=int(top_k.max(initial=0)),  # (vocab_size when a row has no top-k)
        )

    def graph_tensors(self, num_rows: int) -> SamplingTensors:
        """The device tensors `stage` writes, rows 0..num_rows-1, as a captured graph that
        samples reads them (runner/sampled_decode_graphs.py): the fused path's flags (some row
        samples, none has top-k or top-p), whatever the buffers hold at capture."""
        views = self._device_views(num_rows)
        return SamplingTensors(**views, all_greedy=False, any_top_k=False, any_top_p=False)

    def _device_views(self, n: int) -> dict[str, torch.Tensor]:
        """Rows 0..n-1 of each field's device buffer (stage's layout)."""
        f, i = self._floats_dev, self._ints_dev
        return dict(temperature=f[0, :n], top_k=i[0, :n], top_p=f[1, :n], seeds=i[1, :n],
                    positions=i[2, :n])  # fmt: skip

    def shaping(
        self, rows: np.ndarray, ends: np.ndarray, reqs: list[Request], device: torch.device
    ) -> LogitsShaping | None:
        """The logits shaping of `rows` (sampling the token at index ends[j] of its request),
        or None when none of them shapes its logits."""
        if not self.shapes_logits[rows].any():
            return None
        return build_shaping([reqs[int(r)] for r in rows], ends.tolist(), self.vocab_size, device)

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
