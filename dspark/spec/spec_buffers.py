"""Persistent per-window inputs of a speculative step: device buffers and their pinned twins.

The target's own inputs (tokens, positions, slots, page table, ...) live in InputBuffers; these
are the extra ones drafting and verification read, one entry per window row j (a request's
window, or a pad row at the tail of a captured graph). Like InputBuffers they are allocated once
and written in place, so a captured speculative step can replay with new contents.

Window rows of a step, worked example (K = 3; verify_len [2, 3]; anchors at positions 9, 4;
the windows start at tokens 0 and 3 of the target layout):

  anchors, anchor_pos:   [a0, a1], [9, 4]
  block positions:       [9 10 11 | 4 5 6]           anchor_pos + k, k < K
  block slots:           slot of each block position in the row's pages
  block seq_lens:        [12, 7]                     anchor_pos + K: context + the block
  draft_dst [R, K]:      [[1, 2, 0], [4, 5, 6]]      target token index of draft k, or the
                                                     anchor's own index when k >= verify_len
  verify_len:            [2, 3]
  verify_cap:            [2, 3]                      verify_len, 0 for pad rows: the most a
                                                     trimmed cell may verify (spec/ragged.py)
  window_len:            [3, 4]                      the windows' tokens in the target layout:
                                                     verify_len + 1, or K + 1 for every row of a
                                                     step laid out for a captured graph (a short
                                                     window then has unverified tail tokens)

A pad row (j >= the live count) is a dummy identity on the scratch page: anchor 0 at position
0, greedy, seed 0, block slots on the scratch page, draft_dst inside its own pad window. An
empty window (verify_len 0: a request's last token) has its block slots after the anchor's on
the scratch page too: its request owns no page past the anchor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from dspark.attention_metadata import AttentionMetadata
from dspark.device_buffers import UploadFence, staging_pair
from dspark.sample.sampler import SamplingTensors
from dspark.step_plan import SCRATCH_PAGE


class WindowRow(NamedTuple):
    """One live window as the host knows it (a NamedTuple: built once per window per step)."""

    anchor: int
    anchor_pos: int
    verify_len: int
    token_offset: int  # index of the anchor in the step's target token layout
    table_row: int  # its request's row of the step's block table (host staging copy)
    temperature: float
    top_k: int  # vocab size: no top-k
    top_p: float
    seed: int


@dataclass(frozen=True)
class SamplingMode:
    """Which sampling work a step does (host flags; a captured graph is one mode)."""

    all_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def of(cls, rows: list[WindowRow], vocab_size: int) -> SamplingMode:
        greedy = all(r.temperature == 0 for r in rows)
        return cls(
            greedy,
            not greedy and any(r.top_k < vocab_size for r in rows),
            not greedy and any(r.top_p < 1.0 for r in rows),
        )


GREEDY = SamplingMode(True, False, False)
TEMPERATURE = SamplingMode(False, False, False)
FILTERED = SamplingMode(False, True, True)  # top-k and top-p on (rows without them pass)


class SpecBuffers:
    def __init__(self, max_rows: int, draft_len: int, page_size: int, device: torch.device):
        self.max_rows, self.K, self.page_size, self.device = max_rows, draft_len, page_size, device
        K = draft_len
        self._names = []
        for name, shape, dtype in (
            ("anchors", max_rows, torch.int64),
            ("anchor_pos", max_rows, torch.int64),
            ("verify_len", max_rows, torch.int64),
            ("verify_cap", max_rows, torch.int64),
            ("window_len", max_rows, torch.int64),
            ("block_positions", max_rows * K, torch.int64),
            ("block_slots", max_rows * K, torch.int64),
            ("block_seq_lens", max_rows, torch.int32),
            ("draft_dst", (max_rows, K), torch.int64),
            ("temperature", max_rows, torch.float32),
            ("top_k", max_rows, torch.int64),
            ("top_p", max_rows, torch.float32),
            ("seeds", max_rows, torch.int64),
        ):
            host, dev = staging_pair(shape, dtype, device)
            setattr(self, f"{name}_cpu", host)
            setattr(self, name, dev)
            self._names.append(name)
        # block layout: K query tokens per row, so cu is fixed: [0, K, 2K, ...]
        self.block_cu = torch.arange(0, (max_rows + 1) * K, K, dtype=torch.int32, device=device)
        self._uploaded = UploadFence(device)
        self.block_seq_lens_host: tuple[int, ...] = ()  # of the last write (CPU attention)

    def np(self, name: str) -> np.ndarray:
        return getattr(self, f"{name}_cpu").numpy()

    def write(
        self,
        rows: list[WindowRow],
        num_rows: int,
        pad_token_offset: int,
        pad_verify_len: int,
        window_width: int | None = None,  # tokens of every window; None: its verify_len + 1
        block_table: np.ndarray | None = None,  # [rows, W] the step's pages (row r.table_row)
    ) -> None:
        """Stage the live rows, then pad rows up to num_rows (their windows of pad_verify_len
        + 1 tokens start at pad_token_offset in the target layout)."""
        self._uploaded.wait()  # the previous upload's copies read these buffers
        K, ps = self.K, self.page_size
        n = len(rows)
        assert n <= num_rows <= self.max_rows, (n, num_rows, self.max_rows)
        k = np.arange(K)
        # the rows' fields, one tuple each (WindowRow's order): one pass over the rows
        columns = zip(*rows, strict=True) if n else ((),) * len(WindowRow._fields)
        (anchors, positions, verify_lens, token_offsets, table_rows, temperatures, top_ks,
         top_ps, seeds) = columns  # fmt: skip
        anchor_pos = np.zeros(num_rows, dtype=np.int64)
        anchor_pos[:n] = positions
        block_pos = anchor_pos[:, None] + k[None, :]  # [G, K]
        verify_len = np.full(num_rows, pad_verify_len, dtype=np.int64)
        verify_len[:n] = verify_lens
        slots = np.full((num_rows, K), SCRATCH_PAGE * ps, dtype=np.int64)
        if n:  # position p of row j: its page block_table[table_row, p // ps], offset p % ps
            table_rows = np.array(table_rows, dtype=np.int64)
            pages = block_table[table_rows[:, None], block_pos[:n] // ps].astype(np.int64)
            live = pages * ps + block_pos[:n] % ps
            # an empty window owns its anchor's slot alone: the rest stay on the scratch page
            live[verify_len[:n] == 0, 1:] = SCRATCH_PAGE * ps
            slots[:n] = live
        window_len = verify_len + 1 if window_width is None else np.full(num_rows, window_width)
        offsets = np.empty(num_rows, dtype=np.int64)
        offsets[:n] = token_offsets
        offsets[n:] = pad_token_offset + (pad_verify_len + 1) * np.arange(num_rows - n)
        dst = np.where(k[None, :] < verify_len[:, None], offsets[:, None] + 1 + k, offsets[:, None])
        self._write_rows("anchors", anchors, n, num_rows, 0)
        self.np("anchor_pos")[:num_rows] = anchor_pos
        self.np("verify_len")[:num_rows] = verify_len
        self.np("verify_cap")[:num_rows] = np.where(np.arange(num_rows) < n, verify_len, 0)
        self.np("window_len")[:num_rows] = window_len
        self.np("block_positions")[: num_rows * K] = block_pos.reshape(-1)
        self.np("block_slots")[: num_rows * K] = slots.reshape(-1)
        self.np("block_seq_lens")[:num_rows] = anchor_pos + K
        self.np("draft_dst")[:num_rows] = dst
        self._write_rows("temperature", temperatures, n, num_rows, 0.0)
        self._write_rows("top_k", top_ks, n, num_rows, 1)
        self._write_rows("top_p", top_ps, n, num_rows, 1.0)
        self._write_rows("seeds", seeds, n, num_rows, 0)
        self.block_seq_lens_host = tuple((anchor_pos + K).tolist())

    def _write_rows(self, name: str, values: tuple, n: int, num_rows: int, pad) -> None:
        """Rows 0..n-1 of a per-row buffer from the live rows' values, then pad rows up to
        num_rows."""
        host = self.np(name)
        host[:n] = values
        host[n:num_rows] = pad

    def upload(self, num_rows: int) -> None:
        if self.device.type == "cpu":
            return
        for name in self._names:
            per_slot = name in ("block_positions", "block_slots")
            used = num_rows * self.K if per_slot else num_rows
            getattr(self, name)[:used].copy_(getattr(self, f"{name}_cpu")[:used], True)
        self._uploaded.record()

    def sampling(self, num_rows: int, mode: SamplingMode) -> SamplingTensors:
        """Per-row sampling tensors (views); `positions` is each window's anchor position."""
        return SamplingTensors(
            temperature=self.temperature[:num_rows],
            top_k=self.top_k[:num_rows],
            top_p=self.top_p[:num_rows],
            seeds=self.seeds[:num_rows],
            positions=self.anchor_pos[:num_rows],
            all_greedy=mode.all_greedy,
            any_top_k=mode.any_top_k,
            any_top_p=mode.any_top_p,
        )

    def block_metadata(self, num_rows: int, block_table: torch.Tensor) -> AttentionMetadata:
        """The drafter block's attention inputs: K non-causal queries per row over its context
        and itself. `block_table` [num_rows, W]: the rows' pages (shared with the target's)."""
        K = self.K
        return AttentionMetadata(
            cu_num_tokens=self.block_cu[: num_rows + 1],
            seq_lens=self.block_seq_lens[:num_rows],
            slot_mapping=self.block_slots[: num_rows * K],
            block_table=block_table,
            cu_num_tokens_cpu=tuple(range(0, (num_rows + 1) * K, K)),
            seq_lens_cpu=self.block_seq_lens_host[:num_rows],
            causal=False,
        )
