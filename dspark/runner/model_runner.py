"""Plan -> device tensors -> forward -> sampled tokens. The CPU/GPU boundary of the engine.

The runner reads a StepPlan and never mutates requests: it returns one SampledTokens (or None for
a prefill chunk that does not reach the end of its prompt) per plan row. A step whose rows all
decode one token replays a captured CUDA graph when one fits; any other step runs eagerly on
the same persistent buffers. Which path ran is counted in `stats`.

With speculation, window rows [anchor, drafts] go through SpecDecoder.step: drafted first (the
drafts are written into the input buffer on the device), every window token scored, the tap
features of all tokens appended to the drafter cache, the windows verified; plain rows sample
as usual. A step of only full windows replays a captured speculative graph (SpecGraphs), and
so does a step of windows then a few prefill chunks (a mixed step: runner/mixed_layout.py).
Both results come to the host in the step's one synchronisation (`_collect`).
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from dspark.engine.kv_cache import pages_for
from dspark.engine.step_plan import SampledTokens, StepPlan
from dspark.models.llama import LlamaForCausalLM
from dspark.request import PENDING_TOKEN, Request, TokenLogprobs
from dspark.runner.cuda_graph import DecodeGraphs
from dspark.runner.input_buffers import (
    PAD_SLOT,
    PAD_TOKEN_ID,
    InputBuffers,
    StepLayout,
    host_to_device,
    to_host,
)
from dspark.runner.mixed_layout import (
    GRAPH_TAIL_ROWS,
    MAX_TAIL_ROWS,
    stage_tail,
    write_tail_pads,
)
from dspark.runner.persistent_batch import NOT_FOUND, PersistentBatch, index_of
from dspark.runner.spec_runner import SpecRunner
from dspark.sample.sampler import sample, top_logprobs
from dspark.sample.sampling_rows import SamplingRows
from dspark.spec.spec_decoder import SpecDecoder

logger = logging.getLogger(__name__)

_new_tuple = tuple.__new__


@dataclass
class InFlightStep:
    """A launched step: its plan and the host copies of its results, valid once `done`."""

    plan: StepPlan
    plain: list[int]  # plan rows that sampled one token, in the order of `tokens`
    tokens: torch.Tensor | None = None  # [len(plain)]
    logprobs: tuple[torch.Tensor, ...] | None = None
    window_rows: list[int] | None = None  # plan rows with a window, in verification order
    verify_len: list[int] | None = None
    verified: tuple[torch.Tensor, torch.Tensor] | None = None  # emitted tokens, num accepted
    trimmed_verify_len: torch.Tensor | None = None  # [R] a trimmed cell's, chosen on the device
    confidence: torch.Tensor | None = None  # [R, K] raw confidence logits (for observers)
    window_logprobs: tuple[torch.Tensor, ...] | None = None
    is_uniform: bool = False  # all rows windows laid out K + 1 wide: a step may launch behind it
    sampled_serials: np.ndarray | None = None  # [len(plain)] the requests of `tokens`
    done: torch.cuda.Event | None = None  # None on the CPU: the results are ready at once


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


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        page_size: int,
        max_num_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        graph_sizes: list[int] | None = None,  # decode batches pad to these sizes
        capture_graphs: bool = True,  # False: run the padded batches eagerly (tests, debugging)
        spec: SpecDecoder | None = None,  # speculation: drafting, context, verification
        mixed_tail_tokens: int = 0,  # P of the captured mixed steps (runner/mixed_layout.py)
        trimmed_widths: tuple[int, ...] = (),  # w of the trimmed cells (G, w G) (spec/ragged.py)
        sync_planning: bool = False,  # verify lengths by Algorithm 1 on the host (eager)
        decode_tail_tokens: int = 0,  # P of the captured mixed decode steps (cuda_graph.py)
    ) -> None:
        self.model = model
        self.spec = spec
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.device = device
        self.vocab_size = model.config.vocab_size
        max_rows = max([max_num_seqs, *(graph_sizes or [])])
        # (a mixed step has tail rows after its largest G of windows or decode rows)
        has_tails = spec is not None or decode_tail_tokens > 0
        buffer_rows = max_rows + (GRAPH_TAIL_ROWS if has_tails else 0)
        self.buffers = InputBuffers(
            max(max_num_tokens, max_rows), buffer_rows, pages_for(max_model_len, page_size),
            device,
        )  # fmt: skip
        self.stats: Counter[str] = Counter()
        # the rows' block tables and sampling parameters, applied by their changes each step
        self.sampling_rows = SamplingRows(max_rows, self.vocab_size)
        self.batch = PersistentBatch(self.buffers, self.sampling_rows)
        # serials of the requests the previous launch sampled for, in its token order
        self._last_sampled = np.empty(0, dtype=np.int64)
        self._arange = np.arange(self.buffers.input_ids.shape[0] + 1)  # (sliced, never written)
        # sampled tokens come back through two persistent pinned buffers, alternately: under
        # async scheduling one holds the step being read while the next step's copy is queued
        self._token_host = None
        if device.type == "cuda":
            self._token_host = [torch.empty(max_rows, dtype=torch.int64, pin_memory=True)
                                for _ in range(2)]  # fmt: skip
        self._token_parity = 0
        self.graph_sizes = sorted(graph_sizes or [])
        if device.type == "cuda":
            self._warm_up_eager(max_num_tokens)
        self.graphs = None
        self.spec_runner = None
        if spec is not None:
            # Fixed-K windows replay captured speculative steps; plain decode steps (drafting
            # off, every row opted out) replay decode graphs that also feed the drafter's
            # context, so drafting can resume on an up-to-date cache.
            ladder = self.graph_sizes if capture_graphs else []
            tails = (mixed_tail_tokens,) if mixed_tail_tokens else ()
            self.spec_runner = SpecRunner(
                spec, self.buffers, self._run_model, self.vocab_size, self.stats, ladder, tails,
                trimmed_widths, sync_planning,
            )  # fmt: skip
        if self.graph_sizes and capture_graphs:
            tail = decode_tail_tokens
            if tail and max(self.graph_sizes) + tail > self.buffers.input_ids.shape[0]:
                logger.warning("mixed decode graphs: %d rows + %d tail tokens exceed the %d-token"
                               " buffers: steps that admit run eagerly", max(self.graph_sizes),
                               tail, self.buffers.input_ids.shape[0])  # fmt: skip
                tail = 0
            self.graphs = DecodeGraphs(self._forward, self.buffers, self.graph_sizes, tail)

    # ---- staging --------------------------------------------------------------------------

    def _stage(self, plan: StepPlan) -> Staged:
        """Write the plan into the host staging buffers: the persistent rows (block table,
        sampling parameters) by their changes, then the per-token inputs."""
        self.buffers.wait_for_upload()
        reqs = [r.request for r in plan.rows]
        serials = self.batch.sync(reqs)
        if plan.is_decode:
            return self._stage_decode(plan, reqs, serials)
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

    @property
    def decode_mixed_limits(self) -> tuple[int, int] | None:
        """(tail rows, tail tokens) of the captured mixed decode steps, for the scheduler's cap
        on the prefill a plain step carries; None without them."""
        if self.graphs is None or not self.graphs.tail_tokens:
            return None
        return MAX_TAIL_ROWS, self.graphs.tail_tokens

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
        """A plain step of decode rows, then a tail of prefill chunks (a mixed decode step):
        (its decode rows n, the captured (G, P) it pads to), or None (eager; the reason counted
        when the step has both).

        A step of prefill chunks alone (n = 0: a request admitted into an idle engine, as each
        one is at low load) that fits the tail replays the smallest mixed graph, its one decode
        row a pad row: a graph replay instead of an eager step's ~10 ms of host work (on the
        H200), most of the time to first token at low load. Larger ones run eagerly, uncounted
        here (eager_steps_not_decode)."""
        graphs = self.graphs
        if graphs is None or not graphs.tail_tokens:
            return None
        rows = plan.rows
        n = 0
        while n < len(rows) and rows[n].num_tokens == 1 and rows[n].do_sample:
            n += 1
        if n == len(rows) or any(r.num_draft or r.empty_window for r in rows):
            return None  # (nothing but decode rows, or windows)
        tail = rows[n:]
        reason = None  # (a one-token row may be in the tail: staged as a chunk of 1)
        if len(tail) > MAX_TAIL_ROWS:
            reason = "tail_rows"
        elif sum(r.num_tokens for r in tail) > graphs.tail_tokens:
            reason = "tail_tokens"
        elif n > graphs.sizes[-1]:
            reason = "batch_too_large"
        elif any(PENDING_TOKEN in r.request.token_ids[r.start : r.end] for r in tail):
            reason = "pending_in_tail"
        if reason is not None:
            if n:
                self.stats[f"eager_steps_mixed_{reason}"] += 1
            return None
        return n, graphs.sizes[bisect.bisect_left(graphs.sizes, n)], graphs.tail_tokens

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
        write_tail_pads(b, G + m, t_live + G - n, GRAPH_TAIL_ROWS - m, P - tail.num_tokens)
        logits = [*range(n), *tail.last_tokens]
        logits += [0] * (G + GRAPH_TAIL_ROWS - len(logits))
        b.np("logits_indices")[: len(logits)] = logits
        rows = G + GRAPH_TAIL_ROWS  # (the host mirrors: what the staging above wrote)
        cu, seq_lens = b.np("cu_num_tokens")[: rows + 1], b.np("seq_lens")[:rows]
        layout = StepLayout(G + P, rows, len(logits), tuple(cu.tolist()),
                            tuple(seq_lens.tolist()), num_fed=num_fed,
                            tail_rows=GRAPH_TAIL_ROWS)  # fmt: skip
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
        starts = self._write_windows(plan.rows, width)
        graph_size = self.spec_runner.graph_size(plan, width)
        size = n if graph_size is None else graph_size
        if size > n:  # pad windows on the scratch page; every token is scored
            b.write_pad_rows(n, t, size - n, width)
            b.np("logits_indices")[: size * width] = self._arange[: size * width]
        seq_lens = (starts + width).tolist() + [width] * (size - n)
        layout = StepLayout(size * width, size, size * width,
                            tuple(range(0, (size + 1) * width, width)), tuple(seq_lens),
                            window_width=width)  # fmt: skip
        no_rows = np.empty(0, dtype=np.int64)
        return Staged(layout, graph_size, reqs, serials, no_rows, no_rows,
                      window_rows=tuple(range(n)))  # fmt: skip

    def _write_windows(self, rows: tuple, width: int) -> np.ndarray:
        """Rows 0..n-1 of the step, windows of `width` tokens from token 0 on (see
        _stage_windows), every token scored; returns their anchors' positions [n]."""
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
        b.np("input_ids")[:t] = ids.reshape(-1)
        b.np("positions")[:t] = positions.reshape(-1)
        b.np("slot_mapping")[:t] = slots.reshape(-1)
        b.np("cu_num_tokens")[: n + 1] = self._arange[: t + 1 : width]
        b.np("seq_lens")[:n] = starts + width
        b.np("logits_indices")[:t] = self._arange[:t]
        self.stats["empty_windows"] += int(empty.sum())
        return starts

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
        self._write_windows(plan.rows[:n], width)
        tail = stage_tail(b, plan.rows[n:], n, t_windows, self.page_size)
        m, t_live = len(plan.rows) - n, t_windows + tail.num_tokens
        window_logits = list(range(t_windows))
        key = self.spec_runner.mixed_graph(n, tail.num_tokens)
        G, P, tail_rows = n, tail.num_tokens, m
        if key is not None:  # pad windows after the live tail; the tail's pads last
            (G, P), tail_rows = key, GRAPH_TAIL_ROWS
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
                            tuple(seq_lens.tolist()), window_width=width,
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
        if np.array_equal(self._last_sampled, serials):  # the same rows, in the same order
            src = np.arange(tokens.size)
        else:
            src = index_of(self._last_sampled, serials)
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
        t, num_rows, n = cu[-1], len(plan.rows), len(logits_idx)
        b.np("input_ids")[:t] = ids
        b.np("positions")[:t] = positions
        b.np("slot_mapping")[:t] = slots
        b.np("cu_num_tokens")[: num_rows + 1] = cu
        b.np("seq_lens")[:num_rows] = seq_lens
        b.np("logits_indices")[:n] = logits_idx
        graph_size = self._graph_size(plan, plan.is_decode)
        width = 1
        if (
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
        return Staged(layout, graph_size, reqs, serials, *sampled, window_rows=tuple(window_rows))

    @torch.inference_mode()
    def _warm_up_eager(self, max_num_tokens: int) -> None:
        """Compile the JIT kernels' eager variants now, not at a user's first prefill.

        Triton compiles per tile configuration (set by the longest query run) and specialises
        integer arguments equal to 1 or divisible by 16, so a few prefill lengths cover every
        variant. The dummy request writes pages 1.. (free at start-up, overwritten before any
        real request reads them).
        """
        ps, b = self.page_size, self.buffers
        for n in sorted({1, 2, 7, 16, 17, 33, 64, 100, max_num_tokens}):
            n = min(n, max_num_tokens, b.max_pages_per_row * ps)
            pages = list(range(1, pages_for(n, ps) + 1))
            b.np("input_ids")[:n] = 0
            b.np("positions")[:n] = range(n)
            b.np("slot_mapping")[:n] = [pages[p // ps] * ps + p % ps for p in range(n)]
            b.np("cu_num_tokens")[:2] = [0, n]
            b.np("seq_lens")[:1] = n
            b.write_block_row(0, pages)
            b.np("logits_indices")[:1] = n - 1
            layout = StepLayout(n, 1, 1, (0, n), (n,))
            b.upload(layout)
            self._forward(layout)
        torch.cuda.synchronize(self.device)

    def _graph_size(self, plan: StepPlan, is_decode: bool) -> int | None:
        """The captured size a pure-decode step pads to, or None (eager, reason counted)."""
        if not self.graph_sizes:
            return None
        if not is_decode:
            if not any(r.num_draft for r in plan.rows):  # (windows: the speculative runner's)
                self.stats["eager_steps_not_decode"] += 1
            return None
        i = bisect.bisect_left(self.graph_sizes, len(plan.rows))
        if i == len(self.graph_sizes):
            self.stats["eager_steps_batch_too_large"] += 1
            return None
        return self.graph_sizes[i]

    def _forward(self, layout: StepLayout) -> torch.Tensor:  # [N, vocab]
        """A plain step's logits; with speculation, its tokens also join the drafter's context
        (pad rows write to the scratch page)."""
        if self.spec is None:
            return self._run_model(layout).logits
        out = self._run_model(layout, self.spec.taps)
        b, t = self.buffers, layout.num_tokens
        self.spec.append_context(out.hidden_states, b.positions[:t], b.slot_mapping[:t])
        return out.logits

    def _run_model(self, layout: StepLayout, hidden_layers: tuple[int, ...] = ()):
        b = self.buffers
        return self.model(
            b.input_ids[: layout.num_tokens],
            b.positions[: layout.num_tokens],
            b.metadata(layout),
            self.kv_caches,
            b.logits_indices[: layout.num_logits],
            hidden_layers,
        )

    # ---- the step -------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> list[SampledTokens | None]:
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> InFlightStep:
        """Queue the step's device work and the copies of its results; returns without waiting.

        A row whose input is the previous launch's still-pending token (async scheduling) gets
        it on the device: input_ids[t] = last_tokens[j], j its row among those that sampled.
        """
        staged = self._stage(plan)
        layout, graph_size = staged.layout, staged.graph_size
        self.buffers.upload(layout)
        self._feed_pending(layout)
        window_rows = list(staged.window_rows)
        spec_out = None
        if window_rows:
            spec_out = self.spec_runner.run(plan, layout, window_rows, graph_size,
                                            staged.graph_tail)  # fmt: skip
            logits = spec_out.logits
        elif graph_size is not None and self.graphs is not None:
            logits = self.graphs.replay(graph_size, staged.graph_tail)
            self.stats["graph_steps"] += 1
            self.stats["graph_steps_mixed"] += bool(staged.graph_tail)
        else:  # (plain rows feed the drafter's context too)
            logits = self._forward(layout)
            self.stats["eager_steps"] += 1
        sampled = staged.sampled_rows
        step = InFlightStep(plan, sampled.tolist())
        # (a mixed step is not: the next step needs its tail's sampled tokens on the host)
        step.is_uniform = bool(window_rows) and layout.window_width is not None
        step.is_uniform &= not layout.tail_rows
        if sampled.size:
            tokens, lp = self._sample(self._plain_logits(plan, logits, staged), staged)
            self._last_tokens = tokens
            serials = staged.serials if staged.is_decode else staged.serials[sampled]
            self._last_sampled = step.sampled_serials = serials
            step.tokens = self._tokensto_host(tokens)
            step.logprobs = to_host(lp)
        if spec_out is not None:
            self.spec_runner.queue_results(step, plan, layout, window_rows, spec_out)
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()
        return step

    def _plain_logits(
        self, plan: StepPlan, logits: torch.Tensor, staged: Staged
    ) -> torch.Tensor:  # [N, vocab]
        """The logits of the rows that sample one token: rows 0..N-1 of `logits` unless window
        rows (which score all their tokens) come first.

          rows [window of 3 tokens, plain, plain]: logits rows 0..2 the window's, plain 3, 4
        """
        if staged.is_decode:
            return logits[: len(plan.rows)]
        if staged.layout.tail_rows:  # a mixed step: after the windows' logits, in row order
            first = staged.layout.num_window_logits
            return logits[first : first + staged.sampled_rows.size]
        logit_rows, logit_row = [], 0
        for row in plan.rows:
            if row.num_draft:
                logit_row += row.num_tokens
            elif row.do_sample:
                logit_rows.append(logit_row)
                logit_row += 1
        if logit_rows[-1] == len(logit_rows) - 1:  # rows 0..n-1: a view, no gather
            return logits[: len(logit_rows)]
        return logits[host_to_device(logit_rows, torch.int64, self.device)]

    @staticmethod
    def can_feed(plan: StepPlan, previous: InFlightStep) -> bool:
        """May `plan` launch before `previous` is collected? A pending token may only be the
        one input of a decode row, fed from `previous` (a preempted request re-admitted at once
        would need its pending token on the host)."""
        if plan.is_decode:
            pending = [r.request.serial for r in plan.rows
                       if r.request.token_ids[r.start] == PENDING_TOKEN]  # fmt: skip
        else:
            pending = []
            for row in plan.rows:
                tokens = row.request.token_ids
                if row.num_tokens == 1:
                    if tokens[row.start] == PENDING_TOKEN:
                        pending.append(row.request.serial)
                elif PENDING_TOKEN in tokens[row.start : row.end]:
                    return False
        if not pending:
            return True
        if previous.sampled_serials is None:
            return False
        pending = np.array(pending, dtype=np.int64)
        if np.array_equal(previous.sampled_serials, pending):  # the same rows, in order
            return True
        return bool((index_of(previous.sampled_serials, pending) != NOT_FOUND).all())

    def _tokensto_host(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._token_host is None:  # CPU: already there
            return tokens
        buf = self._token_host[self._token_parity][: tokens.shape[0]]
        self._token_parity ^= 1
        return buf.copy_(tokens, non_blocking=True)

    def _feed_pending(self, layout: StepLayout) -> None:
        """input_ids[feed_dst[j]] = last_tokens[feed_src[j]]: the previous launch's pending
        tokens into this step's inputs, on the device (indices staged by _stage)."""
        n, b = layout.num_fed, self.buffers
        if n:
            fed = self._last_tokens.index_select(0, b.feed_src[:n])
            b.input_ids.index_copy_(0, b.feed_dst[:n], fed)

    def collect(self, step: InFlightStep) -> list[SampledTokens | None]:
        """Wait for a launched step and assign its results to plan rows."""
        plan = step.plan
        # sync: the one host synchronisation of the step; the host copies were queued behind it
        if step.done is not None:
            step.done.synchronize()
        if step.plain and step.logprobs is None and len(step.plain) == len(plan.rows):
            # a decode step: one token per row, each SampledTokens((tok,)) built by tuple.__new__
            # (the NamedTuple's generated __new__ is a Python call, 256 times per step)
            return [_new_tuple(SampledTokens, ((tok,), None)) for tok in step.tokens.tolist()]
        results: list[SampledTokens | None] = [None] * len(plan.rows)
        if step.verified is not None:
            self.spec_runner.assign(step, results)
        if not step.plain:
            return results
        token_list = step.tokens.tolist()
        lp_lists = [x.tolist() for x in step.logprobs] if step.logprobs is not None else None
        for j, (i, tok) in enumerate(zip(step.plain, token_list, strict=True)):
            n = plan.rows[i].request.sampling_params.logprobs
            logprobs = None
            if n is not None and lp_lists is not None:
                chosen, top_ids, top_vals = lp_lists
                top = dict(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
                logprobs = (TokenLogprobs(tok, chosen[j], top),)
            results[i] = SampledTokens((tok,), logprobs)
        return results

    def _sample(self, logits: torch.Tensor, staged: Staged):
        """Tokens [N] (and logprobs) of the rows that sample one token, still on the device.
        Their parameters are the persistent sampling rows (written by PersistentBatch.sync)."""
        rows, ends, params = staged.sampled_rows, staged.sampled_ends, self.sampling_rows
        masked = self._ban_stop_tokens(logits, params.banned(rows, ends, staged.reqs))
        if params.all_greedy(rows):
            tokens = masked.argmax(dim=-1)  # no sampling tensors to build or upload
        else:  # (the token sampled at index `end` of its request: its position)
            tokens = sample(masked, params.tensors(rows, ends, self.device))
        num_top = params.max_logprobs(rows)
        lp = None if num_top is None else top_logprobs(logits, tokens, num_top)
        return tokens, lp

    def _ban_stop_tokens(
        self, logits: torch.Tensor, banned: tuple[list[int], list[int]]
    ) -> torch.Tensor:
        """min_tokens: a request may not stop (EOS, stop token ids) before its minimum;
        `banned` is (row, token id) pairs (SamplingRows.banned)."""
        banned_rows, banned_ids = banned
        if not banned_rows:
            return logits
        logits = logits.clone()
        index = host_to_device([banned_rows, banned_ids], torch.int64, self.device)
        logits[index[0], index[1]] = float("-inf")
        return logits
