"""Staging: a StepPlan written into the host staging buffers (runner/input_buffers.py).

The persistent rows (block table, sampling parameters) are brought up to date by their changes
(PersistentBatch.sync), then the per-token inputs are written by the path that fits the step,
padded to the captured shape it replays (none: eager, the reason counted in `stats`):

  every row one decode token that samples       numpy over the rows, padded to a G
  every row a window K + 1 wide (uniform)       numpy over the rows, padded to a G
  windows, then a tail of prefill chunks        the mixed speculative layout (G, P)
  decode rows, then a tail of prefill chunks    the mixed decode layout (G, P)
  any other step                                row by row

(the mixed layouts: runner/mixed_layout.py). An input still pending on the device (async
scheduling) is staged as an index pair that ModelRunner.launch feeds there (`_stage_feed`).
The stager owns what only staging decides: the graph ladder a decode step pads to, the decode
graphs it picks from (launch replays the one picked), and the serials the previous launch
sampled for (`last_sampled`, recorded by launch).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np

from dspark.request import PENDING_TOKEN, Request
from dspark.runner.cuda_graph import DecodeGraphs
from dspark.runner.input_buffers import InputBuffers, StepLayout
from dspark.runner.mixed_layout import graph_tail_rows, stage_tail, write_tail_pads
from dspark.runner.persistent_batch import NOT_FOUND, PersistentBatch, index_of
from dspark.runner.shapes import (
    decode_size,
    leading_windows,
    mixed_decode_shape,
    prompt_scored,
    window_width,
)
from dspark.runner.spec_runner import SpecRunner
from dspark.spec.spec_decoder import SpecDecoder
from dspark.step_plan import PAD_SLOT, PAD_TOKEN_ID, StepPlan


class Staged(NamedTuple):
    """A staged step: its layout and graph size, and the per-row facts sampling needs."""

    layout: StepLayout
    graph_size: int | None
    reqs: list[Request]  # the plan rows' requests
    serials: np.ndarray  # [R] their serials
    sampled_rows: np.ndarray  # [N] plan rows that sample one token (windows verify instead)
    sampled_ends: np.ndarray  # [N] index of the token each samples (its position)
    is_decode: bool = False  # every row one token that samples
    window_rows: tuple[int, ...] = ()  # plan rows verified as windows (empty windows too)
    graph_tail: int = 0  # a mixed step's captured tail size P (graph_size is its G)
    # prompt_logprobs: the logits rows after the sampled ones that score prompt tokens, one
    # (plan row, first position, count) per chunk, and each scored token's next prompt token
    prompt_scored: tuple[tuple[int, int, int], ...] = ()
    prompt_next_ids: tuple[int, ...] = ()


class StepStager:
    """Writes a StepPlan into the host staging buffers (`stage`); ModelRunner uploads them,
    launches the step and records which requests it sampled for (`last_sampled`)."""

    def __init__(
        self,
        buffers: InputBuffers,
        batch: PersistentBatch,  # the rows' block tables and sampling parameters
        page_size: int,
        stats: Counter[str],  # the runner's: which path each step took
        graph_sizes: list[int],  # sorted: the ladder decode batches pad to ([]: no padding)
        graphs: DecodeGraphs | None = None,  # the captured decode graphs (None: eager)
        spec: SpecDecoder | None = None,
        spec_runner: SpecRunner | None = None,  # windows: their layout and graphs
    ) -> None:
        self.buffers = buffers
        self.batch = batch
        self.page_size = page_size
        self.stats = stats
        self.graph_sizes = graph_sizes
        self.graphs = graphs
        self.spec = spec
        self.spec_runner = spec_runner
        # serials of the requests the previous launch sampled for, in its token order
        # (ModelRunner.launch records them; _stage_feed maps pending tokens to them)
        self.last_sampled = np.empty(0, dtype=np.int64)
        self._arange = np.arange(buffers.input_ids.shape[0] + 1)  # (sliced, never written)

    def stage(self, plan: StepPlan) -> Staged:
        """Write the plan into the host staging buffers: the persistent rows (block table,
        sampling parameters) by their changes, then the per-token inputs."""
        self.buffers.wait_for_upload()
        reqs = [r.request for r in plan.rows]
        serials = self.batch.sync(reqs)
        if plan.is_decode:
            return self._stage_decode(plan, reqs, serials)
        if prompt_scored(plan)[0]:  # (its extra logits rows: no captured shape has them)
            self.stats["eager_steps_prompt_logprobs"] += 1
            return self._stage_rows(plan, reqs, serials)
        if self.spec_runner is not None:
            width = self.spec_runner.window_width(plan)
            if width is not None:
                return self._stage_windows(plan, reqs, serials, width)
            num_windows = self.spec_runner.mixed_windows(plan)
            if num_windows is not None:
                return self._stage_mixed(plan, reqs, serials, num_windows)
        key = self._mixed_decode_graph(plan)
        if key is not None:
            return self._stage_mixed_decode(plan, reqs, serials, *key)
        return self._stage_rows(plan, reqs, serials)

    def lays_windows_first(self, plan: StepPlan) -> bool:
        """Will stage() lay the plan's windows out K + 1 wide in its first rows (all windows,
        or windows and then a tail), so that a step may launch behind it?"""
        runner = self.spec_runner
        if runner is None or not runner.uniform_windows or plan.is_decode:
            return False
        if prompt_scored(plan)[0]:
            return False
        num_verify, capacity = self.spec.num_verify, runner.capacity
        if window_width(plan, num_verify, capacity) is not None:
            return True
        return leading_windows(plan, num_verify, capacity, runner.max_tail_tokens)[0] is not None

    def _stage_decode(self, plan: StepPlan, reqs: list, serials: np.ndarray) -> Staged:
        """A decode step, by numpy over the rows: row i feeds token `start` of its request at
        position start, its KV slot read from its block-table row, and samples index start + 1.

          page_size 4, starts [5, 9], block_table rows [[3, 8, ..], [2, 6, 7, ..]]
          positions [5, 9]  slot_mapping [8*4 + 1, 7*4 + 1] = [33, 29]  seq_lens [6, 10]
        """
        b, n = self.buffers, len(plan.rows)
        starts, num_fed = self._write_decode_rows(plan.rows, serials)
        rows = self._arange[:n]
        graph_size = self._graph_size(plan, is_decode=True)
        size = n if graph_size is None else graph_size
        if size > n:  # pad to the captured size; every token is scored
            b.write_pad_rows(n, n, size - n)
            b.np("logits_indices")[:size] = self._arange[:size]
        seq_lens = (starts + 1).tolist() + [1] * (size - n)
        layout = StepLayout(size, size, size, tuple(range(size + 1)), tuple(seq_lens),
                            num_fed=num_fed)  # fmt: skip
        return Staged(layout, graph_size, reqs, serials, rows, starts + 1, is_decode=True)

    def _write_decode_rows(self, rows: tuple, serials: np.ndarray) -> tuple[np.ndarray, int]:
        """Rows 0..n-1 of the step, one decode token each (see _stage_decode), every one
        scored; returns their positions [n] and how many inputs are fed on the device."""
        b, ps, n = self.buffers, self.page_size, len(rows)
        starts = np.array([r.start for r in rows], dtype=np.int64)  # [n]
        ids = np.array([r.request.token_ids[r.start] for r in rows], dtype=np.int64)
        pending = np.flatnonzero(ids == PENDING_TOKEN)  # token i is row i's
        num_fed = self._stage_feed(pending, serials[pending])
        pages = b.np("block_table")[self._arange[:n], starts // ps].astype(np.int64)  # [n]
        b.np("input_ids")[:n] = ids  # (pending ones are written on the device)
        b.np("positions")[:n] = starts
        b.np("slot_mapping")[:n] = pages * ps + starts % ps
        b.np("cu_num_tokens")[: n + 1] = self._arange[: n + 1]
        b.np("seq_lens")[:n] = starts + 1
        b.np("logits_indices")[:n] = self._arange[:n]
        return starts, num_fed

    def _mixed_decode_graph(self, plan: StepPlan) -> tuple[int, int, int] | None:
        """A mixed decode step's (decode rows n, captured G, P), or None (eager; the reason
        counted when the step has decode rows): runner/shapes.py decides."""
        graphs = self.graphs
        if graphs is None or not graphs.tail_tokens:
            return None
        shape, reason = mixed_decode_shape(graphs.sizes, graphs.tail_tokens, plan)
        if reason is not None and plan.rows[0].num_tokens == 1 and plan.rows[0].do_sample:
            self.stats[f"eager_steps_mixed_{reason}"] += 1
        return shape

    def _stage_mixed_decode(
        self, plan: StepPlan, reqs: list, serials: np.ndarray, n: int, G: int, P: int
    ) -> Staged:
        """A mixed decode step padded to its captured (G, P): the n decode rows, the tail's
        rows (prefill chunks), pad decode rows up to G, then the tail's pads (mixed_layout.py,
        with windows one token wide). Logits: the decode rows', then one per tail row that
        samples, then index 0 up to G + R.

          n 2 of G 4, a 3-token chunk of P 8 (R 5): rows [d0 d1 | pre | pad pad | left, 3 empty]
          tokens 0 1 | 2..4 | 5 6 | 7..11; logits [0 1 4 | 0 0 0 0 0 0]
        """
        b = self.buffers
        self.stats["mixed_decode_steps"] += 1
        self.stats["mixed_decode_steps_prefill_only"] += n == 0
        starts, num_fed = self._write_decode_rows(plan.rows[:n], serials[:n])
        tail = stage_tail(b, plan.rows[n:], n, n, self.page_size)
        m, t_live = len(plan.rows) - n, n + tail.num_tokens
        b.write_pad_rows(n + m, t_live, G - n)
        tail_rows = graph_tail_rows(P)
        write_tail_pads(b, G + m, t_live + G - n, tail_rows - m, P - tail.num_tokens)
        logits = [*range(n), *tail.last_tokens]
        logits += [0] * (G + tail_rows - len(logits))
        b.np("logits_indices")[: len(logits)] = logits
        rows = G + tail_rows  # (the host mirrors: what the staging above wrote)
        cu, seq_lens = b.np("cu_num_tokens")[: rows + 1], b.np("seq_lens")[:rows]
        layout = StepLayout(G + P, rows, len(logits), tuple(cu.tolist()),
                            tuple(seq_lens.tolist()), num_fed=num_fed,
                            tail_rows=tail_rows)  # fmt: skip
        sampled = np.concatenate([self._arange[:n], n + np.array(tail.sampled, dtype=np.int64)])
        ends = np.concatenate([starts + 1, np.array(tail.sampled_ends, dtype=np.int64)])
        return Staged(layout, G, reqs, serials, sampled, ends, graph_tail=P)

    def _stage_windows(self, plan: StepPlan, reqs: list, serials: np.ndarray, width: int) -> Staged:
        """A step of uniform windows (every row a window, empty windows too), by numpy over the
        rows: row i has `width` tokens from its anchor at start_i, all scored; the drafts and a
        continuation's anchor are written on the device later, so their host values are 0. An
        empty window's tail tokens write the scratch page (its request owns the anchor's slot).

          width 4, page_size 4, starts [5, 9], rows' pages [[3, 8, ..], [2, 6, 7, ..]]
          positions [5 6 7 8 | 9 10 11 12]  slots [33 34 35 8 | 25 26 27 28]
          cu [0, 4, 8]  seq_lens [9, 13]  logits_indices 0..7
        """
        b, n = self.buffers, len(plan.rows)
        t = n * width
        starts, num_fed = self._write_windows(plan.rows, serials, width)
        graph_size = self.spec_runner.graph_size(plan, width)
        size = n if graph_size is None else graph_size
        if size > n:  # pad windows on the scratch page; every token is scored
            b.write_pad_rows(n, t, size - n, width)
            b.np("logits_indices")[: size * width] = self._arange[: size * width]
        seq_lens = (starts + width).tolist() + [width] * (size - n)
        layout = StepLayout(size * width, size, size * width,
                            tuple(range(0, (size + 1) * width, width)), tuple(seq_lens),
                            num_fed=num_fed, window_width=width)  # fmt: skip
        no_rows = np.empty(0, dtype=np.int64)
        return Staged(layout, graph_size, reqs, serials, no_rows, no_rows,
                      window_rows=tuple(range(n)))  # fmt: skip

    def _write_windows(
        self, rows: tuple, serials: np.ndarray, width: int
    ) -> tuple[np.ndarray, int]:
        """Rows 0..n-1 of the step, windows of `width` tokens from token 0 on (see
        _stage_windows), every token scored; returns their anchors' positions [n] and how
        many anchors are fed on the device: a window launched behind the plain step that
        samples its anchor (`_stage_feed`; SpecRunner gives the drafter the same token)."""
        b, ps, n = self.buffers, self.page_size, len(rows)
        t = n * width
        starts = np.array([r.start for r in rows], dtype=np.int64)  # [n]
        positions = starts[:, None] + self._arange[None, :width]  # [n, width]
        pages = b.np("block_table")[self._arange[:n, None], positions // ps].astype(np.int64)
        slots = pages * ps + positions % ps
        empty = np.array([r.empty_window for r in rows])
        slots[empty, 1:] = PAD_SLOT
        ids = np.zeros((n, width), dtype=np.int64)
        ids[:, 0] = [PAD_TOKEN_ID if r.is_continuation else r.request.token_ids[r.start]
                     for r in rows]  # fmt: skip
        fed = np.flatnonzero(ids[:, 0] == PENDING_TOKEN)
        num_fed = self._stage_feed(fed * width, serials[fed]) if fed.size else 0
        b.np("input_ids")[:t] = ids.reshape(-1)
        b.np("positions")[:t] = positions.reshape(-1)
        b.np("slot_mapping")[:t] = slots.reshape(-1)
        b.np("cu_num_tokens")[: n + 1] = self._arange[: t + 1 : width]
        b.np("seq_lens")[:n] = starts + width
        b.np("logits_indices")[:t] = self._arange[:t]
        self.stats["empty_windows"] += int(empty.sum())
        return starts, num_fed

    def _stage_mixed(
        self, plan: StepPlan, reqs: list, serials: np.ndarray, num_windows: int
    ) -> Staged:
        """A mixed step: windows in rows 0..n-1, then the tail's rows (prefill chunks, plain
        rows), then, to a captured (G, P), pad windows and the tail's pads (mixed_layout.py).
        The windows' logits come first (G * w of them), then one per tail row: those that
        sample, in row order."""
        b, n, width = self.buffers, num_windows, 1 + self.spec.num_verify
        self.stats["mixed_spec_steps"] += 1
        t_windows = n * width
        _, num_fed = self._write_windows(plan.rows[:n], serials[:n], width)
        tail = stage_tail(b, plan.rows[n:], n, t_windows, self.page_size)
        m, t_live = len(plan.rows) - n, t_windows + tail.num_tokens
        window_logits = list(range(t_windows))
        key = self.spec_runner.mixed_graph(n, tail.num_tokens, m)
        G, P, tail_rows = n, tail.num_tokens, m
        if key is not None:  # pad windows after the live tail; the tail's pads last
            G, P = key
            tail_rows = graph_tail_rows(P)
            b.write_pad_rows(n + m, t_live, G - n, width)
            t_pads = t_live + (G - n) * width
            window_logits += range(t_live, t_pads)
            write_tail_pads(b, G + m, t_pads, tail_rows - m, P - tail.num_tokens)
        logits = window_logits + tail.last_tokens
        logits += [0] * (G * width + tail_rows - len(logits) if key else 0)
        b.np("logits_indices")[: len(logits)] = logits
        rows = G + tail_rows  # (the host mirrors: what the staging above wrote)
        cu, seq_lens = b.np("cu_num_tokens")[: rows + 1], b.np("seq_lens")[:rows]
        layout = StepLayout(G * width + P, rows, len(logits), tuple(cu.tolist()),
                            tuple(seq_lens.tolist()), num_fed=num_fed, window_width=width,
                            tail_rows=tail_rows)  # fmt: skip
        sampled = np.array([n + k for k in tail.sampled], dtype=np.int64)
        ends = np.array(tail.sampled_ends, dtype=np.int64)
        return Staged(layout, None if key is None else G, reqs, serials, sampled, ends,
                      window_rows=tuple(range(n)), graph_tail=0 if key is None else P)  # fmt: skip

    def _stage_feed(self, tokens: np.ndarray, serials: np.ndarray) -> int:
        """Input token tokens[j] of the step is the previous launch's sampled token of request
        serials[j], taken on the device (async scheduling); returns how many are fed.

          previous launch sampled serials [4, 9, 2]; tokens [0, 2] of serials [9, 4]
          feed_dst [0, 2], feed_src [1, 0]
        """
        if not tokens.size:
            return 0
        if np.array_equal(self.last_sampled, serials):  # the same rows, in the same order
            src = np.arange(tokens.size)
        else:
            src = index_of(self.last_sampled, serials)
            assert (src != NOT_FOUND).all(), "a pending token the previous launch did not sample"
        b = self.buffers
        b.np("feed_dst")[: tokens.size] = tokens
        b.np("feed_src")[: tokens.size] = src
        return int(tokens.size)

    def _stage_rows(
        self,
        plan: StepPlan,
        reqs: list,
        serials: np.ndarray,
        window_width: int | None = None,  # SpecRunner.window_width(plan): uniform windows
    ) -> Staged:
        """Any other step (prefill chunks, windows, mixed), row by row (decode steps and uniform
        windows too: the tests compare _stage_decode and _stage_windows with it).

        Per-token values are gathered in Python lists and written with one numpy assignment
        each (per-row numpy calls cost more than the data at decode batch sizes).
        """
        b, ps = self.buffers, self.page_size
        ids, positions, slots, cu, seq_lens, logits_idx = [], [], [], [0], [], []
        fed_dst, fed_rows = [], []  # input tokens still on the device (async scheduling)
        sampled_rows, sampled_ends = [], []  # plain rows that sample one token
        window_rows = []  # rows verified as windows
        for i, row in enumerate(plan.rows):
            req, start, end = row.request, row.start, row.end
            pages = req.page_ids
            if row.empty_window and window_width:
                # an empty window (verify length 0): the anchor, then K tail tokens scored and
                # never accepted, whose KV goes to the scratch page (the request owns the
                # anchor's slot only: its last token)
                end = start + window_width
                if req.token_ids[start] == PENDING_TOKEN:  # (behind the step that samples it)
                    fed_dst.append(cu[-1])
                    fed_rows.append(i)
                ids += [req.token_ids[start]] + [0] * (window_width - 1)
                logits_idx += range(cu[-1], cu[-1] + window_width)
                positions += range(start, end)
                slots += [pages[start // ps] * ps + start % ps] + [PAD_SLOT] * (window_width - 1)
                window_rows.append(i)
                self.stats["empty_windows"] += 1
            elif end - start == 1 and not row.num_draft:  # a decode token: the common case
                token = req.token_ids[start]
                if token == PENDING_TOKEN:
                    fed_dst.append(cu[-1])
                    fed_rows.append(i)
                ids.append(token)
                positions.append(start)
                slots.append(pages[start // ps] * ps + start % ps)
                if row.do_sample:  # (a 1-token prefill chunk short of the prompt's end does not)
                    logits_idx.append(cu[-1])
            else:
                if row.num_draft:  # [anchor, drafts]: the drafts are scattered in on the device
                    window_rows.append(i)
                    # a window shorter than window_width gets tail tokens past its verify_len:
                    # scored, never accepted, their KV on the request's own reserved pages
                    # (the scheduler reserves a whole block) and rewritten before it is read
                    # (a continuation's anchor and positions are written on the device: its
                    # start is the latest the anchor can be, every host value an upper bound)
                    end = start + (window_width or row.num_tokens)
                    anchor = PAD_TOKEN_ID if row.is_continuation else req.token_ids[start]
                    if anchor == PENDING_TOKEN:  # (behind the step that samples it)
                        fed_dst.append(cu[-1])
                        fed_rows.append(i)
                    ids += [anchor] + [0] * (end - start - 1)
                    logits_idx += range(cu[-1], cu[-1] + end - start)  # all scored
                else:
                    ids += req.token_ids[start:end]
                    assert PENDING_TOKEN not in req.token_ids[start:end], (
                        f"request {req.request_id}: a pending token can only feed a decode row"
                    )
                    if row.do_sample:
                        logits_idx.append(cu[-1] + row.num_tokens - 1)
                positions += range(start, end)
                slots += [pages[p // ps] * ps + p % ps for p in range(start, end)]
            if row.do_sample and not row.num_draft and not (row.empty_window and window_width):
                sampled_rows.append(i)
                sampled_ends.append(row.end)
            cu.append(cu[-1] + end - start)
            seq_lens.append(end)
        num_fed = self._stage_feed(np.array(fed_dst, dtype=np.int64), serials[fed_rows])
        scored, next_ids = prompt_scored(plan)
        if scored:  # (after the sampled rows' logits, which keep their indices)
            logits_idx += [cu[i] + p - plan.rows[i].start for i, p0, m in scored
                           for p in range(p0, p0 + m)]  # fmt: skip
        t, num_rows, n = cu[-1], len(plan.rows), len(logits_idx)
        b.np("input_ids")[:t] = ids
        b.np("positions")[:t] = positions
        b.np("slot_mapping")[:t] = slots
        b.np("cu_num_tokens")[: num_rows + 1] = cu
        b.np("seq_lens")[:num_rows] = seq_lens
        b.np("logits_indices")[:n] = logits_idx
        graph_size = None if scored else self._graph_size(plan, plan.is_decode)
        width = 1
        if not scored and (
            graph_size is None
            and self.spec_runner is not None
            and any(r.num_draft for r in plan.rows)
        ):
            graph_size = self.spec_runner.graph_size(plan, window_width)
            width = 1 + self.spec.num_verify
        if graph_size is not None:  # pad to the captured size; every token is scored
            pad = graph_size - num_rows
            b.write_pad_rows(num_rows, t, pad, width)
            b.np("logits_indices")[: t + pad * width] = range(t + pad * width)
            cu += range(t + width, t + pad * width + 1, width)
            seq_lens += [width] * pad
            t, num_rows = t + pad * width, graph_size
            n = t
        layout = StepLayout(t, num_rows, n, tuple(cu), tuple(seq_lens), num_fed=num_fed,
                            window_width=window_width)  # fmt: skip
        sampled = np.array(sampled_rows, dtype=np.int64), np.array(sampled_ends, dtype=np.int64)
        return Staged(layout, graph_size, reqs, serials, *sampled, window_rows=tuple(window_rows),
                      prompt_scored=scored, prompt_next_ids=next_ids)  # fmt: skip

    def _graph_size(self, plan: StepPlan, is_decode: bool) -> int | None:
        """The captured size a pure-decode step pads to, or None (eager, reason counted)."""
        if not self.graph_sizes:
            return None
        if not is_decode:
            if not any(r.num_draft for r in plan.rows):  # (windows: the speculative runner's)
                self.stats["eager_steps_not_decode"] += 1
            return None
        size, reason = decode_size(self.graph_sizes, plan)
        if reason is not None:
            self.stats[f"eager_steps_{reason}"] += 1
        return size
