"""Persistent step inputs: device buffers written in place every step, and their host twins.

A captured CUDA graph bakes the addresses of its inputs, so these tensors are allocated once
and never rebound; `data_ptrs()` lets a debug check prove it. Each step the host fills the
pinned staging arrays (numpy views) and copies the used prefix to the device, asynchronously.

Layout of a step with rows r = 0..R-1 (real rows first, pad rows last, each >= 1 token):

  windows:         [3, 1, 2]  + 1 pad row (graph size G = 4)
  cu_num_tokens:   [0, 3, 4, 6, 7]
  seq_lens:        [10, 5, 2, 1]         pad rows see only their own scratch token
  slot_mapping:    [.. 6 live slots .., 0]   pad tokens write slot 0: the scratch page
  block_table:     row 3 = [SCRATCH_PAGE, SCRATCH_PAGE, ...]
  logits_indices:  [2, 3, 5, 6]          last token of every row
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark.attention_metadata import AttentionMetadata
from dspark.device_buffers import UploadFence, staging_pair
from dspark.step_plan import PAD_SLOT, PAD_TOKEN_ID, SCRATCH_PAGE

NO_OWNER = -1  # a block-table row that holds no request's pages (pad rows, warm-up)


def to_host(x):
    """Queue device -> pinned host copies (a tensor or a tuple of them); None stays None. The
    values are valid once the step's completion event has been waited for. Always a copy: on
    the CPU, .to("cpu") would return a persistent buffer itself, which the next step rewrites
    before this one's results are read (SpecBuffers.verify_len, under async scheduling)."""
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(t.to("cpu", non_blocking=True, copy=True) for t in x)
    return x.to("cpu", non_blocking=True, copy=True)


def host_to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a synchronisation. It is staged in pinned
    memory: a copy from pageable memory waits for the stream to drain, which under async
    scheduling means waiting for the previous step's GPU work. `values`: a list or a numpy
    array (torch.tensor(ndarray, pin_memory=True) raises, so the copy into pinned memory is
    its own call; as_tensor wraps an int64 array without a copy first)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.as_tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class StepLayout:
    """The used sizes of one step: T tokens in R rows, N sampled rows, page-table width W."""

    num_tokens: int
    num_rows: int
    num_logits: int
    cu_num_tokens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    num_fed: int = 0  # input tokens fed from the previous step's output on the device
    # every window this many tokens (a step laid out for a speculative graph; short windows
    # padded, see SpecRunner); None: each window is its verify_len + 1
    window_width: int | None = None
    # a mixed step (runner/mixed_layout.py): the last tail_rows rows are plain rows (prefill
    # chunks, plain decode rows, their pads), every row before them a window of window_width
    tail_rows: int = 0

    @property
    def num_window_logits(self) -> int:
        """A step of windows: its window tokens' logits come first, this many."""
        return (self.num_rows - self.tail_rows) * (self.window_width or 0)


class InputBuffers:
    def __init__(
        self, max_num_tokens: int, max_num_rows: int, max_pages_per_row: int, device: torch.device
    ) -> None:
        self.device = device
        self.max_pages_per_row = max_pages_per_row

        def pair(shape, dtype):
            return staging_pair(shape, dtype, device)

        self.input_ids_cpu, self.input_ids = pair(max_num_tokens, torch.int64)
        self.positions_cpu, self.positions = pair(max_num_tokens, torch.int64)
        self.slot_mapping_cpu, self.slot_mapping = pair(max_num_tokens, torch.int64)
        self.cu_num_tokens_cpu, self.cu_num_tokens = pair(max_num_rows + 1, torch.int32)
        self.seq_lens_cpu, self.seq_lens = pair(max_num_rows, torch.int32)
        self.block_table_cpu, self.block_table = pair(
            (max_num_rows, max_pages_per_row), torch.int32
        )
        self.logits_indices_cpu, self.logits_indices = pair(max_num_tokens, torch.int64)
        # async scheduling: token index <- index into the previous step's sampled tokens
        self.feed_dst_cpu, self.feed_dst = pair(max_num_rows, torch.int64)
        self.feed_src_cpu, self.feed_src = pair(max_num_rows, torch.int64)
        self._pointers = self.data_ptrs()
        self._views: dict[str, np.ndarray] = {}
        # What each block-table row holds (PersistentBatch keeps it current): the first
        # block_row_num_pages[i] pages of request block_row_owner[i] (its serial: an id may come
        # back with other pages) as they stood at its block_row_preemptions[i]-th preemption.
        # While a request runs its pages only grow; a preemption rebuilds them and bumps the
        # count, so a row whose three values match is correct without being rewritten.
        self.block_row_owner = np.full(max_num_rows, NO_OWNER, dtype=np.int64)
        self.block_row_preemptions = np.zeros(max_num_rows, dtype=np.int64)
        self.block_row_num_pages = np.zeros(max_num_rows, dtype=np.int64)
        self._uploaded = UploadFence(device)

    def wait_for_upload(self) -> None:
        """Before the host rewrites the staging buffers: the previous step's async copies out of
        them must have run. Under async scheduling that step may still be queued; by the time
        the host stages again it has long started, so this wait is for a few microseconds of
        copies at most (it is not the step's result synchronisation)."""
        self._uploaded.wait()

    def write_block_row(self, row: int, pages: list[int]) -> None:
        """Row `row` of the block table holds `pages` and no request's (warm-up, capture)."""
        bt = self.np("block_table")
        bt[row, : len(pages)] = pages
        bt[row, len(pages) :] = SCRATCH_PAGE
        self.block_row_owner[row] = NO_OWNER

    def data_ptrs(self) -> tuple[int, ...]:
        return tuple(
            t.data_ptr()
            for t in (
                self.input_ids,
                self.positions,
                self.slot_mapping,
                self.cu_num_tokens,
                self.seq_lens,
                self.block_table,
                self.logits_indices,
            )
        )

    def check_pointers(self) -> None:
        assert self.data_ptrs() == self._pointers, "a persistent input buffer was rebound"

    def np(self, name: str) -> np.ndarray:
        """The numpy view of a host staging buffer (writes go straight to pinned memory)."""
        view = self._views.get(name)
        if view is None:  # (made once: .numpy() costs microseconds, a dozen times per step)
            view = self._views[name] = getattr(self, f"{name}_cpu").numpy()
        return view

    def upload(self, layout: StepLayout) -> None:
        """Copy the used prefix of every staging buffer to the device (async when pinned)."""
        if self.device.type == "cpu":
            return
        t, r, n = layout.num_tokens, layout.num_rows, layout.num_logits
        for name, used in (
            ("input_ids", t),
            ("positions", t),
            ("slot_mapping", t),
            ("cu_num_tokens", r + 1),
            ("seq_lens", r),
            ("block_table", r),
            ("logits_indices", n),
            ("feed_dst", layout.num_fed),
            ("feed_src", layout.num_fed),
        ):
            if used:
                getattr(self, name)[:used].copy_(getattr(self, f"{name}_cpu")[:used], True)
        self._uploaded.record()

    def metadata(self, layout: StepLayout) -> AttentionMetadata:
        """Views of the persistent buffers for this step's used sizes (never copies)."""
        r = layout.num_rows
        return AttentionMetadata(
            cu_num_tokens=self.cu_num_tokens[: r + 1],
            seq_lens=self.seq_lens[:r],
            slot_mapping=self.slot_mapping[: layout.num_tokens],
            block_table=self.block_table[:r],
            cu_num_tokens_cpu=layout.cu_num_tokens_cpu,
            seq_lens_cpu=layout.seq_lens_cpu,
        )

    def write_pad_rows(
        self, start_row: int, start_token: int, num_pad_rows: int, width: int = 1
    ) -> None:
        """Rows start_row.. get `width` pad tokens each (a decode token, or a pad window of a
        speculative graph), all on the scratch page (never a live page).

          start_row 2, start_token 5, 2 pad rows of width 3:
          tokens 5..10, positions [0 1 2 0 1 2], slots all PAD_SLOT, cu[3:5] = [8, 11],
          seq_lens [3, 3] (a pad row sees its own window: scratch-page keys only)
        """
        t0, t1 = start_token, start_token + num_pad_rows * width
        self.np("input_ids")[t0:t1] = PAD_TOKEN_ID
        self.np("positions")[t0:t1] = np.tile(np.arange(width), num_pad_rows)
        self.np("slot_mapping")[t0:t1] = PAD_SLOT
        r1 = start_row + num_pad_rows
        self.np("cu_num_tokens")[start_row + 1 : r1 + 1] = np.arange(t0 + width, t1 + 1, width)
        self.np("seq_lens")[start_row:r1] = width
        self.np("block_table")[start_row:r1] = SCRATCH_PAGE
        self.block_row_owner[start_row:r1] = NO_OWNER
