"""The speculative half of the runner: windows staged, the speculative step run (a captured
graph or eagerly), its results queued to the host and assigned to plan rows.

A step whose rows are all windows, at most a captured size of them, replays SpecGraphs (pad
windows on the scratch page after the live ones). Such a step lays every window out K + 1
tokens wide, also a window shortened near max_tokens (its verify_len caps what it accepts), so
that requests finishing at different steps do not send the batch to the eager path. A request
whose next token is its last (no room for a draft) comes as a plain decode row marked
`empty_window`: among windows it is laid out as a window of verify length 0, the anchor and K
tail tokens whose KV goes to the scratch page (the request owns only the anchor's slot), so
that it too keeps the step in its graph. A step of such windows followed by a few plain rows
(prefill chunks of requests admitted meanwhile: a mixed step) replays a captured mixed step,
windows first, the tail after (runner/mixed_layout.py). Any other step with windows runs the
same SpecDecoder.step eagerly, and the reason is counted.

  K = 3, windows of verify_len [3, 1, 0]: target tokens [a0 x x x | a1 x . . | a2 . . .],
  cu [0, 4, 8, 12]; the second window's last two tokens and the third's last three are scored
  but never accepted (the third's KV slots [s, 0, 0, 0]: scratch after the anchor's).

A step of such windows may instead have its verify lengths chosen after drafting: a trimmed
cell (G, V) the drafting policy chose, or the synchronous scheduler's plan
(runner/chosen_lengths.py).

A step launched behind one gets its continuation anchors on the device (runner/continuations.py).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from dspark.request import PENDING_TOKEN, Request, TokenLogprobs
from dspark.runner.chosen_lengths import trimmed_target, trimmed_tokens
from dspark.runner.continuations import next_anchors, write_continuations
from dspark.runner.cuda_graph import graph_logits
from dspark.runner.grammar_masks import GrammarMasks, StepWindowGrammar
from dspark.runner.input_buffers import (
    PAD_TOKEN_ID,
    InputBuffers,
    StepLayout,
    host_to_device,
    to_host,
)
from dspark.runner.mixed_layout import (
    capture_layout,
    graph_tail_rows,
    max_tail_rows,
    prepare_capture,
)
from dspark.runner.persistent_batch import NOT_FOUND, index_of
from dspark.runner.shapes import (
    leading_windows,
    padded_size,
    shapes_logits,
    tail_size,
    window_width,
)
from dspark.runner.spec_graphs import SpecGraphs, window_layout
from dspark.sample.logits_shaping import LogitsShaping, build_shaping
from dspark.sample.sampler import top_logprobs
from dspark.spec.ragged import TrimmedCell
from dspark.spec.spec_buffers import SamplingMode, WindowRow
from dspark.spec.spec_decoder import Scored, SpecDecoder, SpecStepOutput, TargetStep
from dspark.step_plan import InFlightStep, SampledTokens, StepPlan, new_tuple


@dataclass(frozen=True)
class AwaitingHost:
    """A speculative step launched up to verification, which waits for what the host fills in
    once the step before is collected: its grammar rows' masks from the drafts
    (runner/grammar_masks.py), and its shaped rows' shaping from their outputs (the tokens of
    the step before among them). SpecRunner.verify_awaiting finishes it."""

    scored: Scored
    layout: StepLayout
    window_rows: list[int]
    serials: np.ndarray
    grammar: StepWindowGrammar | None
    shaped: list[Request] | None  # the windows' requests, when a row shapes its logits

    @property
    def logits(self) -> torch.Tensor:  # [N, vocab] the target's (a mixed step's plain rows')
        return self.scored.logits


class SpecRunner:
    def __init__(
        self,
        spec: SpecDecoder,
        buffers: InputBuffers,
        run_model: Callable,  # (layout, hidden_layers) -> ModelOutput
        vocab_size: int,
        stats: Counter[str],
        graph_sizes: list[int],  # the ladder to capture ([]: none, every step eager)
        tail_sizes: tuple[int, ...] = (),  # P of the mixed steps to capture beside each G
        trimmed_widths: tuple[int, ...] = (),  # w of the trimmed cells (G, w G) per G
        grammar_masks: GrammarMasks | None = None,  # structured output (None: none here)
    ) -> None:
        self.spec, self.buffers, self.run_model = spec, buffers, run_model
        self.grammar_masks = grammar_masks
        self.vocab_size, self.stats, self.device = vocab_size, stats, buffers.device
        width = 1 + spec.num_verify
        self.capacity = buffers.input_ids.shape[0]
        sizes = [g for g in graph_sizes if g * width <= self.capacity]
        # the most tail tokens a mixed step may carry (the scheduler caps its prefill there)
        self.max_tail_tokens = max(tail_sizes, default=0)
        tails = tail_sizes
        if not sizes or max(sizes) * width + self.max_tail_tokens > self.capacity:
            tails = ()  # (token buffers too small: mixed steps run eagerly)
        # the trimmed cells' mean window widths (2 <= w <= K; they need the confidence head)
        self.trimmed_widths = tuple(w for w in trimmed_widths if 2 <= w <= spec.num_verify)
        if not spec.drafter.config.use_confidence:
            self.trimmed_widths = ()
        trimmed = {g: tuple(g * w for w in self.trimmed_widths) for g in sizes}
        self.graphs = None
        self.graph_logits: torch.Tensor | None = None  # every captured step's logits rows
        if sizes:
            rows = max(sizes) * width + (graph_tail_rows(max(tails)) if tails else 0)
            self.graph_logits = graph_logits(rows, vocab_size, self.device)
            self.graphs = SpecGraphs(self._graph_step, self._prepare_graph, sizes, tails,
                                     trimmed=trimmed)  # fmt: skip
        # lay steps of windows out K + 1 wide (on with graphs; a test turns it on eagerly)
        self.uniform_windows = self.graphs is not None
        # the next anchors (positions, tokens; [R] on the device) of the last uniform step's
        # windows, and each window's request serial [R] (host): continuations read them
        self._next_anchors: tuple[torch.Tensor, torch.Tensor] | None = None
        self._next_anchor_serials = np.empty(0, dtype=np.int64)
        # called after each speculative step's sync with the windows' request ids, calibrated
        # survivals [R, K] (SpecStepOutput.survivals, copied to the host), accepted drafts and
        # verify lengths: the drafting policy's evidence and its online recalibration
        self.confidence_sinks: list[Callable[..., None]] = []

    def window_width(self, plan: StepPlan) -> int | None:
        """K + 1 if every row of the step is a window laid out at full width (empty windows
        among them), else None (runner/shapes.py)."""
        if not self.uniform_windows:
            return None
        return window_width(plan, self.spec.num_verify, self.capacity)

    def mixed_windows(self, plan: StepPlan) -> int | None:
        """A mixed step laid out windows first, then its tail (mixed_layout.py): how many of
        its leading rows are windows (empty windows among them). None if it is not one, the
        reason counted when it has windows (runner/shapes.py)."""
        if not self.uniform_windows:
            return None
        n, reason = leading_windows(plan, self.spec.num_verify, self.capacity,
                                    self.max_tail_tokens)  # fmt: skip
        if reason is not None:
            self.stats[f"eager_spec_steps_mixed_{reason}"] += 1
        return n

    @property
    def mixed_limits(self) -> tuple[int, int] | None:
        """(tail rows, tail tokens) of the captured mixed steps, for the scheduler's cap on the
        prefill a drafting step carries; None without them."""
        if self.graphs is None or not self.graphs.tails:
            return None
        return max_tail_rows(self.max_tail_tokens), self.max_tail_tokens

    def mixed_graph(
        self, num_windows: int, num_tail_tokens: int, num_tail_rows: int
    ) -> tuple[int, int] | None:
        """The captured mixed step (G, P) a mixed step pads to, or None (eager): the smallest
        G that holds its windows, and the smallest P that holds its tail's tokens and rows
        (mixed_windows() checked that the largest does).

          tails (256, 512): 200 tail tokens in 3 rows -> P 256; 300 in 3 -> 512; 200 in 6 -> 512
        """
        if self.graphs is None or not self.graphs.tails:
            return None
        size = padded_size(self.graphs.sizes, num_windows)
        if size is None:
            self.stats["eager_spec_steps_batch_too_large"] += 1
            return None
        return size, tail_size(self.graphs.tails, num_tail_tokens, num_tail_rows)

    @property
    def max_uniform_rows(self) -> int:
        """The most windows one step can lay out K + 1 wide (0: uniform windows off)."""
        return self.capacity // (1 + self.spec.num_verify) if self.uniform_windows else 0

    def graph_size(self, plan: StepPlan, window_width: int | None) -> int | None:
        """The captured size a fixed-K speculative step (laid out with window_width, from
        window_width(plan)) pads to, or None (eager, the reason counted)."""
        if self.graphs is None:
            return None
        if window_width is None:
            self.stats["eager_spec_steps_not_all_windows"] += 1
            return None
        if any(r.num_draft < self.spec.num_verify for r in plan.rows):
            self.stats["spec_graph_steps_with_short_windows"] += 1
        size = padded_size(self.graphs.sizes, len(plan.rows))
        if size is None:
            self.stats["eager_spec_steps_batch_too_large"] += 1
        return size

    # ---- the step ---------------------------------------------------------------------------

    def run(
        self,
        plan: StepPlan,
        layout: StepLayout,
        window_rows: list[int],
        graph_size: int | None,
        graph_tail: int,  # a mixed step's captured P (0: a step of windows only)
        serials: np.ndarray,  # [R] the plan rows' request serials (Staged.serials)
    ) -> SpecStepOutput | AwaitingHost:
        """Stage the windows and run the speculative step: a captured graph when the step is
        all windows, or windows then a tail, of a captured size, else eagerly. A step with
        grammar windows or shaped rows is launched up to its verification (AwaitingHost:
        verify_awaiting finishes it)."""
        grammar = None
        if plan.grammar_rows:  # (the drafts come to the host before verification)
            grammar = self.grammar_masks.window_grammar(plan, window_rows, 1 + self.spec.num_verify)
        shaped = None  # the windows' requests, if one of them shapes its logits
        if shapes_logits(plan):  # (a plain row of a mixed step may be the one)
            reqs = [plan.rows[i].request for i in window_rows]
            if any(req.sampling_params.shapes_logits for req in reqs):
                shaped = reqs
        out = self._run(plan, layout, window_rows, graph_size, graph_tail, serials, grammar,
                        shaped is not None)  # fmt: skip
        if isinstance(out, Scored):  # (its anchors are remembered once verified)
            return AwaitingHost(out, layout, window_rows, serials, grammar, shaped)
        self._remember_anchors(layout, window_rows, serials, out)
        return out

    def verify_awaiting(self, step: AwaitingHost) -> SpecStepOutput:
        """The second half of a step launched up to verification: the shaped rows' shaping
        built from their outputs as they stand now (after the step before), the grammar rows'
        masks filled from the drafts (runner/grammar_masks.py: waiting for them here unless a
        wait before did), and verification launched with them."""
        scored = step.scored
        if step.shaped is not None:
            # window token j: the outputs up to the anchor, the request's last token now (a
            # continuation's written by the step before; an empty window's is followed by the
            # placeholder of the token it samples), then drafts 1..j
            ends = [_anchor_end(req.token_ids) for req in step.shaped]
            scored = _shaped(scored, build_shaping(step.shaped, ends, self.vocab_size,
                                                   self.device))  # fmt: skip
        masks = None if step.grammar is None else step.grammar.masks(scored.num_rows)
        out = self.spec.verify_scored(scored, masks)
        self._remember_anchors(step.layout, step.window_rows, step.serials, out)
        return out

    def _remember_anchors(
        self, layout: StepLayout, window_rows: list[int], serials: np.ndarray, out: SpecStepOutput
    ) -> None:
        """The next anchors of a step a step may be launched behind (windows K + 1 wide)."""
        if layout.window_width is None:
            return
        R = len(window_rows)
        anchor_pos = self.spec.buffers.anchor_pos[:R]  # (this step's: the next is staged later)
        self._next_anchors = next_anchors(anchor_pos, out.tokens[:R], out.num_accepted[:R])
        self._next_anchor_serials = serials[window_rows]

    def _run(
        self,
        plan: StepPlan,
        layout: StepLayout,
        window_rows: list[int],
        graph_size: int | None,
        graph_tail: int,
        serials: np.ndarray,
        grammar: StepWindowGrammar | None,
        shaped: bool,  # a window row shapes its logits: verified with them later
    ) -> SpecStepOutput | Scored:
        cu, plan_rows, vocab_size = layout.cu_num_tokens_cpu, plan.rows, self.vocab_size
        rows = []
        fed = []  # (window, its anchor's token index) of anchors the step before samples
        for i in window_rows:  # (a few hundred a step at high load: WindowRow by new_tuple)
            req, start, _, _, num_draft, is_continuation, _ = plan_rows[i]
            sp = req.sampling_params
            # (a continuation's anchor is written on the device: see _feed_continuations)
            anchor = PAD_TOKEN_ID if is_continuation else req.token_ids[start]
            if anchor == PENDING_TOKEN:  # (launched behind the plain step that samples it)
                fed.append((len(rows), cu[i]))
                anchor = PAD_TOKEN_ID
            top_k = sp.top_k if sp.top_k > 0 else vocab_size
            fields = (anchor, start, num_draft, cu[i], i, sp.temperature, top_k, sp.top_p, req.seed)
            rows.append(new_tuple(WindowRow, fields))
        mode = SamplingMode.of(rows, vocab_size)
        shaping = None  # the drafter's (an eager step's): verification's is built later
        if shaped:
            self.stats["spec_steps_logits_shaping"] += 1
            if graph_size is None:
                # slot k shaped by the outputs up to the anchor, then drafts 1..k-1
                # (sample/logits_shaping.py), as far as the host knows them
                reqs = [plan_rows[i].request for i in window_rows]
                shaping = build_shaping(reqs, [_known_end(plan_rows[i]) for i in window_rows],
                                        vocab_size, self.device)  # fmt: skip
        width, table = layout.window_width, self.buffers.np("block_table")
        trimmed = self._trimmed_tokens(plan, layout, rows, graph_size)
        if graph_size is not None:  # pad windows follow the plan's rows (a tail's too)
            self.spec.stage(rows, graph_size, pad_token_offset=cu[len(plan.rows)],
                            window_width=width, block_table=table)  # fmt: skip
            self._feed_continuations(plan, width, serials)
            self._feed_anchors(fed)
            self.stats["spec_graph_steps"] += 1
            self.stats["spec_graph_steps_mixed"] += bool(graph_tail)
            if graph_tail and len(self.graphs.tails) > 1:  # which of several sizes it took
                self.stats[f"spec_graph_steps_mixed_p{graph_tail}"] += 1
            self.stats["spec_graph_steps_trimmed"] += trimmed is not None
            if not shaped and grammar is None:
                return self.graphs.replay(graph_size, mode, graph_tail, trimmed)
            # verified again, eagerly, with what no graph holds (runner/spec_graphs.py)
            scored = self.graphs.replay_scored(graph_size, mode, graph_tail, trimmed)
            self.stats["spec_graph_steps_logits_shaping"] += shaped
            if grammar is not None:
                self.stats["spec_graph_steps_structured_output"] += 1
                grammar.copy_drafts(scored.block.tokens)
            return scored
        self.spec.stage(rows, len(rows), window_width=width, block_table=table)
        self._feed_continuations(plan, width, serials)
        self._feed_anchors(fed)
        self.stats["eager_spec_steps"] += 1
        if trimmed is not None:
            self.stats["spec_steps_trimmed_eager"] += 1
            target, cell = trimmed_target(self.buffers, self.spec, self.run_model, len(rows),
                                          trimmed, plan.trimmed_cell)  # fmt: skip
            return self._eager(len(rows), mode, target, None, cell, shaping, grammar)
        b, dev = self.buffers, self.device
        if layout.tail_rows:  # a mixed layout: windows in rows 0..R-1, their logits first
            target = self._target_step(layout, b.block_table)
            return self._eager(len(rows), mode, target, slice(0, layout.num_window_logits),
                               None, shaping, grammar)  # fmt: skip
        all_windows = window_rows == list(range(layout.num_rows))
        block_table = b.block_table
        window_index = None
        if not all_windows:  # mixed with plain rows: gather the windows' page rows and logits
            block_table = b.block_table[torch.tensor(window_rows, device=dev)]
            logit_rows, row0 = [], 0
            for r in plan.rows:
                if r.num_draft:
                    logit_rows += range(row0, row0 + r.num_tokens)
                row0 += r.num_tokens if r.num_draft else int(r.do_sample)
            window_index = torch.tensor(logit_rows, device=dev)
        target = self._target_step(layout, block_table)
        return self._eager(len(rows), mode, target, window_index, None, shaping, grammar)

    def _eager(
        self,
        num_rows: int,
        mode: SamplingMode,
        target: TargetStep,
        window_index: torch.Tensor | slice | None,
        cell: TrimmedCell | None,
        shaping: LogitsShaping | None,
        grammar: StepWindowGrammar | None,
    ) -> SpecStepOutput | Scored:
        """An eager speculative step; one with grammar windows or shaped rows up to its
        verification."""
        if grammar is None and shaping is None:
            return self.spec.step(num_rows, mode, target, window_index, cell)
        return self.spec.launch(num_rows, mode, target, window_index, cell, shaping, grammar)

    def _trimmed_tokens(
        self, plan: StepPlan, layout: StepLayout, rows: list[WindowRow], graph_size: int | None
    ) -> int | None:
        """V this step runs its trimmed cell with, or None (runner/chosen_lengths.py)."""
        captured = self.graphs.trimmed if self.graphs is not None else {}
        candidates = sum(r.verify_len for r in rows)
        reason, tokens = trimmed_tokens(plan, layout, rows, graph_size, self.trimmed_widths,
                                        captured, candidates)  # fmt: skip
        if reason is not None:
            self.stats[f"trimmed_fallback_{reason}"] += 1
        elif tokens is not None:
            g, v = plan.trimmed_cell
            if candidates < v - g:  # every candidate verified
                self.stats["spec_steps_trimmed_below_budget"] += 1
        return tokens

    def _feed_continuations(self, plan: StepPlan, width: int | None, serials: np.ndarray) -> None:
        """The continuation rows' anchors, from the previous step's verification on the device,
        into this step's staged inputs (after their upload, before the step runs). Each
        continuation's anchor comes from its request's window in that step: row src there.

          previous windows' serials [7, 4, 9], continuations' serials [4, 9, 7] -> src [1, 2, 0]
        """
        rows = [i for i, r in enumerate(plan.rows) if r.is_continuation]
        if not rows:
            return
        assert width is not None, "continuations only run in steps of uniform windows"
        src = index_of(self._next_anchor_serials, serials[rows])
        assert (src != NOT_FOUND).all(), "a continuation without a window in the step before"
        limits = [plan.rows[i].request.max_num_tokens for i in rows]
        rows, src, limits = host_to_device(np.array([rows, src, limits], dtype=np.int64),
                                           torch.int64, self.device)  # fmt: skip
        next_pos, next_tok = self._next_anchors
        b, sb = self.buffers, self.spec.buffers
        if self.device.type == "cuda":  # one launch instead of two dozen small ops
            from dspark.kernels.continuations_triton import write_continuations_triton

            write_continuations_triton(
                rows, src, next_pos, next_tok, b.block_table, b.input_ids, b.positions,
                b.slot_mapping, b.seq_lens, sb.anchors, sb.anchor_pos, sb.block_positions,
                sb.block_slots, sb.block_seq_lens, limits, sb.verify_len, sb.verify_cap, width,
                sb.K, sb.page_size,
            )  # fmt: skip
        else:
            write_continuations(b, sb, rows, next_pos[src], next_tok[src], limits, width)
        self.stats["continuation_windows"] += len(limits)

    def _feed_anchors(self, fed: list[tuple[int, int]]) -> None:
        """The drafter's anchors of windows launched behind the plain step that samples them:
        the token ModelRunner fed into the target's input there (`_feed_pending`), read back
        from it on the device.

          fed [(0, 0), (2, 16)] (window, its anchor's token index): anchors[[0, 2]] =
          input_ids[[0, 16]]
        """
        if not fed:
            return
        pairs = np.array(fed, dtype=np.int64).T.copy()  # [2, n]: windows, token indices
        windows, tokens = host_to_device(pairs, torch.int64, self.device)
        self.spec.buffers.anchors[windows] = self.buffers.input_ids[tokens]
        self.stats["fed_anchor_windows"] += len(fed)

    def _target_step(
        self,
        layout: StepLayout,
        block_table: torch.Tensor,
        logits_out: torch.Tensor | None = None,  # the graph set's logits (captured steps)
    ) -> TargetStep:
        b, t = self.buffers, layout.num_tokens
        return TargetStep(
            run=lambda: self.run_model(layout, self.spec.taps, logits_out),
            input_ids=b.input_ids[:t],
            positions=b.positions[:t],
            slot_mapping=b.slot_mapping[:t],
            block_table=block_table,
        )

    # ---- results ----------------------------------------------------------------------------

    def queue_results(
        self,
        step: InFlightStep,
        plan: StepPlan,
        layout: StepLayout,
        window_rows: list[int],
        out: SpecStepOutput,
    ) -> None:
        """Queue the host copies of the windows' results (live rows only) behind the step."""
        R = len(window_rows)
        step.window_rows = window_rows
        step.verify_len = [plan.rows[i].num_draft for i in window_rows]
        step.verified = to_host((out.tokens[:R], out.num_accepted[:R]))
        if out.verify_len is not None:  # a trimmed cell: the lengths the device chose
            step.device_verify_len = to_host(out.verify_len[:R])
        elif any(plan.rows[i].is_continuation for i in window_rows):  # (continuations.py)
            step.device_verify_len = to_host(self.spec.buffers.verify_len[:R])
        if out.survivals is not None:  # (R x K floats: the metrics' and the policy's)
            step.survivals = to_host(out.survivals[:R])
        if out.confidence_logits is not None and self.spec.observers:
            step.confidence = to_host(out.confidence_logits[:R].float())
        cu = layout.cu_num_tokens_cpu
        widths = [cu[i + 1] - cu[i] for i in window_rows]  # window tokens in window_logits
        wants = [plan.rows[i].request.sampling_params.logprobs for i in window_rows]
        step.window_logprobs = to_host(self._window_logprobs(wants, out, step.verify_len, widths))

    def assign(self, step: InFlightStep, results: list[SampledTokens | None]) -> None:
        """After the step's sync: each window row's emitted tokens (and logprobs) into results;
        the counters and observers see the step."""
        plan = step.plan
        emitted, accepted = (x.tolist() for x in step.verified)
        rows = plan.rows
        # what the host allowed; a trimmed cell, or a continuation near its request's end,
        # verified fewer (window logprobs are packed by these)
        caps = step.verify_len
        if step.device_verify_len is not None:
            step.verify_len = step.device_verify_len.tolist()
        survivals = None  # [R, K] calibrated in the step: the metrics' and the sinks'
        if step.survivals is not None:
            survivals = step.survivals.numpy().astype(np.float64)
        self.spec.record(step.verify_len, accepted, step.confidence, survivals)
        # (a trimmed cell's block reaches fewer than K slots: no evidence of the rest, so the
        # policy learns from it no more than from a plain step)
        if (
            self.confidence_sinks
            and survivals is not None
            and (survivals.shape[1] == self.spec.num_verify)
        ):
            # (an empty window's block drafted over scratch-page slots: no evidence)
            seen_rows, seen_accepted, verify_len = step.window_rows, accepted, step.verify_len
            if 0 in caps:
                seen = [j for j, v in enumerate(caps) if v]
                seen_rows, survivals = [seen_rows[j] for j in seen], survivals[seen]
                seen_accepted = [accepted[j] for j in seen]
                verify_len = [verify_len[j] for j in seen]
            ids = [rows[i].request.request_id for i in seen_rows]
            for sink in self.confidence_sinks:
                sink(ids, survivals, seen_accepted, verify_len)
        if step.verify_len != caps:  # (continuations near their requests' ends)
            self.stats["continuation_windows_shortened"] += sum(
                1 for j, i in enumerate(step.window_rows)
                if rows[i].is_continuation and step.verify_len[j] < caps[j]
            )  # fmt: skip
        wlp = None
        if step.window_logprobs is not None:
            wlp = [x.tolist() for x in step.window_logprobs]
        row0 = 0
        for j, i in enumerate(step.window_rows):
            toks = tuple(emitted[j][: accepted[j] + 1])
            logprobs = None
            if wlp is not None and (n := rows[i].request.sampling_params.logprobs) is not None:
                chosen, top_ids, top_vals = wlp
                logprobs = tuple(
                    TokenLogprobs(t, chosen[row0 + k], dict(zip(top_ids[row0 + k][:n],
                                  top_vals[row0 + k][:n], strict=True)))
                    for k, t in enumerate(toks)
                )  # fmt: skip
            verified = step.verify_len[j]
            fewer = None if verified == caps[j] else verified
            results[i] = new_tuple(SampledTokens, (toks, logprobs, fewer))
            row0 += 1 + caps[j]

    def _window_logprobs(
        self,
        wants: list[int | None],  # per window: its request's logprobs (None: not asked)
        out: SpecStepOutput,
        verify_len: list[int],
        widths: list[int],
    ):
        """The target's logprobs of each emittable window token, packed 1 + verify_len per
        window: emitted token i of a window is scored by window row i (the anchor's row scores
        the first). Window j's rows start at sum(widths[:j]) in window_logits. None if nobody
        asked.

          verify_len [2, 1], widths [4, 4] (K = 3): logit rows [0 1 2 | 4 5], owners [0 0 0 1 1]
        """
        if all(n is None for n in wants):
            return None
        lens = [1 + n for n in verify_len]
        total = sum(lens)
        dev = self.device
        owner = torch.repeat_interleave(
            torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev), output_size=total
        )
        packed = torch.tensor([0, *itertools.accumulate(lens[:-1])], device=dev)
        start = torch.tensor([0, *itertools.accumulate(widths[:-1])], device=dev)
        offset = torch.arange(total, device=dev) - packed[owner]
        tokens = out.tokens[owner, offset]  # [Tw] the token each window row would emit
        logits = out.window_logits[start[owner] + offset]
        return top_logprobs(logits, tokens, max(n or 0 for n in wants))

    # ---- graph capture ----------------------------------------------------------------------

    def _prepare_graph(self, size: int, tail: int = 0) -> None:
        """Fill the buffers with `size` pad windows, and a tail of `tail` pad tokens (capture
        inputs: the scratch page only)."""
        b, width = self.buffers, 1 + self.spec.num_verify
        if tail:
            layout = prepare_capture(b, size, width, tail, graph_tail_rows(tail))
        else:
            b.write_pad_rows(0, 0, size, width)
            b.np("logits_indices")[: size * width] = range(size * width)
            layout = window_layout(size, width)
        b.upload(layout)
        self.spec.stage([], size)

    def _graph_step(
        self, size: int, tail: int, trimmed: int | None, mode: SamplingMode
    ) -> tuple[SpecStepOutput, Scored]:
        width = 1 + self.spec.num_verify

        def logits(n: int) -> torch.Tensor | None:  # the set's buffer (cuda_graph.py)
            return None if self.graph_logits is None else self.graph_logits[:n]

        cell = None
        if trimmed is not None:
            target, cell = trimmed_target(self.buffers, self.spec, self.run_model, size, trimmed,
                                          (size, trimmed), logits(trimmed))  # fmt: skip
            index = None
        else:
            if tail:  # a mixed step: the windows' logits come first
                layout = capture_layout(size, width, tail, graph_tail_rows(tail))
                index = slice(0, size * width)
            else:
                layout, index = window_layout(size, width), None
            target = self._target_step(layout, self.buffers.block_table,
                                       logits(layout.num_logits))  # fmt: skip
        # (the scored half kept: a step with grammar windows verifies it again with masks)
        scored = self.spec.launch(size, mode, target, index, cell)
        return self.spec.verify_scored(scored), scored


def _shaped(scored: Scored, shaping: LogitsShaping) -> Scored:
    """A step's Scored half to verify with the live windows' shaping: min_p per window row,
    0 for a captured step's pad windows after them.

      4 windows, shaping.min_p [0.1, 0, 0.3] (3 live) -> st.min_p [0.1, 0, 0.3, 0]
    """
    st = scored.st
    if shaping.min_p is not None:
        min_p = shaping.min_p.new_zeros(scored.num_rows)
        min_p[: shaping.min_p.shape[0]] = shaping.min_p
        st = replace(st, min_p=min_p)
    return replace(scored, st=st, shaping=shaping)


def _known_end(row) -> int:
    """The end of a window row's outputs as the host knows them at launch: through its anchor,
    or up to it while the anchor is in flight (sampled by the plain step before), or up to the
    window in flight before a continuation. Drafts shaped by fewer outputs stay exact (the
    distribution each was drawn from is verification's q); verification's shaping is built
    once the step before is collected (verify_awaiting).

      token_ids [5, 6, 9], start 2 -> 3;  [5, 6, PENDING], start 2 -> 2;  [5, 6], continuation -> 2
    """
    tokens = row.request.token_ids
    if row.is_continuation:
        return len(tokens)
    return row.start + (tokens[row.start] != PENDING_TOKEN)


def _anchor_end(tokens: list[int]) -> int:
    """One past a window's anchor once every token before it is known: its last token that
    is not a placeholder. [5, 6, 9] -> 3;  [5, 6, 9, PENDING] (an empty window) -> 3"""
    end = len(tokens)
    while end and tokens[end - 1] == PENDING_TOKEN:
        end -= 1
    return end
