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
Both results come to the host in the step's one synchronisation (`collect`).

Staging (the plan into the host staging buffers, padded to the captured shape a step fits) is
runner/staging.py's StepStager; the runner uploads what it staged, runs or replays the forward,
samples, and reads the results back.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import replace

import numpy as np
import torch

from dspark.models.llama import LlamaForCausalLM
from dspark.request import PENDING_TOKEN, Request, TokenLogprobs
from dspark.runner.cuda_graph import DecodeGraphs
from dspark.runner.grammar_masks import GrammarMasks
from dspark.runner.input_buffers import InputBuffers, StepLayout, host_to_device, to_host
from dspark.runner.mixed_layout import graph_tail_rows, max_tail_rows
from dspark.runner.persistent_batch import NOT_FOUND, PersistentBatch, index_of
from dspark.runner.sampled_decode_graphs import SampledDecodeGraphs, sampled_decode_graphs_enabled
from dspark.runner.spec_runner import AwaitingHost, SpecRunner
from dspark.runner.staging import Staged, StepStager
from dspark.sample.logits_shaping import apply_shaping
from dspark.sample.sampler import SamplingTensors, sample, takes_fused_path, top_logprobs
from dspark.sample.sampling_rows import SamplingRows
from dspark.sample.token_bitmask import apply_token_bitmask
from dspark.spec.spec_decoder import SpecDecoder
from dspark.step_plan import InFlightStep, SampledTokens, StepPlan, new_tuple, pages_for

logger = logging.getLogger(__name__)


class ModelForward:
    """The target's forward on the runner's persistent buffers.

    Its own object, not the runner's methods: the decode graphs and the speculative runner keep
    it, and a bound method of the runner kept by what the runner owns is a reference cycle, so
    a dropped engine (and its weights and KV cache) would wait for the cyclic collector."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        buffers: InputBuffers,
        spec: SpecDecoder | None,
    ) -> None:
        self.model, self.kv_caches, self.buffers, self.spec = model, kv_caches, buffers, spec

    def __call__(
        self, layout: StepLayout, logits_out: torch.Tensor | None = None
    ) -> torch.Tensor:  # [N, vocab]
        """A plain step's logits; with speculation, its tokens also join the drafter's context
        (pad rows write to the scratch page)."""
        if self.spec is None:
            return self.run_model(layout, (), logits_out).logits
        out = self.run_model(layout, self.spec.taps, logits_out)
        b, t = self.buffers, layout.num_tokens
        self.spec.append_context(out.features, b.positions[:t], b.slot_mapping[:t])
        return out.logits

    def run_model(
        self,
        layout: StepLayout,
        hidden_layers: tuple[int, ...] = (),
        logits_out: torch.Tensor | None = None,  # a graph set's shared logits (cuda_graph.py)
    ):
        b = self.buffers
        return self.model(
            b.input_ids[: layout.num_tokens],
            b.positions[: layout.num_tokens],
            b.metadata(layout),
            self.kv_caches,
            b.logits_indices[: layout.num_logits],
            hidden_layers,
            logits_out=logits_out,
        )


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
        mixed_tails: tuple[int, ...] = (),  # P of the captured mixed steps (mixed_layout.py)
        trimmed_widths: tuple[int, ...] = (),  # w of the trimmed cells (G, w G) (spec/ragged.py)
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
        most_tail_tokens = max([decode_tail_tokens, *mixed_tails])
        buffer_rows = max_rows + (graph_tail_rows(most_tail_tokens) if has_tails else 0)
        self.buffers = InputBuffers(
            max(max_num_tokens, max_rows), buffer_rows, pages_for(max_model_len, page_size),
            device,
        )  # fmt: skip
        self.stats: Counter[str] = Counter()
        # wall seconds spent waiting in each step's one host synchronisation (collect): the
        # part of a step period the host was not the bottleneck (the policy trace reports it)
        self.sync_wait_s = 0.0
        # the rows' block tables and sampling parameters, applied by their changes each step
        self.sampling_rows = SamplingRows(max_rows, self.vocab_size, device)
        self.batch = PersistentBatch(self.buffers, self.sampling_rows)
        # structured output: the grammar rows' masks (runner/grammar_masks.py)
        self.grammar_masks = GrammarMasks(self.vocab_size, device, self.stats)
        forward = ModelForward(model, kv_caches, self.buffers, spec)
        self._forward, self._run_model = forward, forward.run_model
        # the previous launch's sampled tokens on the device: pending inputs are fed from them
        self._last_tokens: torch.Tensor | None = None
        # sampled tokens come back through two persistent pinned buffers, alternately: under
        # async scheduling one holds the step being read while the next step's copy is queued
        self._token_host = None
        if device.type == "cuda":
            self._token_host = [torch.empty(max_rows, dtype=torch.int64, pin_memory=True)
                                for _ in range(2)]  # fmt: skip
        self._token_parity = 0
        graph_sizes = sorted(graph_sizes or [])
        if device.type == "cuda":
            self._warm_up_eager(max_num_tokens)
        self.spec_runner = None
        if spec is not None:
            # Fixed-K windows replay captured speculative steps; plain decode steps (drafting
            # off, every row opted out) replay decode graphs that also feed the drafter's
            # context, so drafting can resume on an up-to-date cache.
            ladder = graph_sizes if capture_graphs else []
            self.spec_runner = SpecRunner(
                spec, self.buffers, self._run_model, self.vocab_size, self.stats, ladder,
                mixed_tails, trimmed_widths, self.grammar_masks,
            )  # fmt: skip
        graphs = None
        self.sampled_graphs: SampledDecodeGraphs | None = None
        if graph_sizes and capture_graphs:
            tail = decode_tail_tokens
            if tail and max(graph_sizes) + tail > self.buffers.input_ids.shape[0]:
                logger.warning("mixed decode graphs: %d rows + %d tail tokens exceed the %d-token"
                               " buffers: steps that admit run eagerly", max(graph_sizes),
                               tail, self.buffers.input_ids.shape[0])  # fmt: skip
                tail = 0
            graphs = DecodeGraphs(self._forward, self.buffers, graph_sizes, self.vocab_size, tail)
            if sampled_decode_graphs_enabled():  # (off under DSPARK_REFERENCE_OPS)
                self.sampled_graphs = SampledDecodeGraphs(graphs, self.sampling_rows)
        # staging owns the ladder and the decode graphs (it picks the graph a step fits; launch
        # replays it) and the serials the last launch sampled for (launch records them)
        self.stager = StepStager(self.buffers, self.batch, page_size, self.stats, graph_sizes,
                                 graphs, spec, self.spec_runner)  # fmt: skip

    @property
    def decode_mixed_limits(self) -> tuple[int, int] | None:
        """(tail rows, tail tokens) of the captured mixed decode steps, for the scheduler's cap
        on the prefill a plain step carries; None without them."""
        graphs = self.stager.graphs
        if graphs is None or not graphs.tail_tokens:
            return None
        return max_tail_rows(graphs.tail_tokens), graphs.tail_tokens

    # ---- the forward ----------------------------------------------------------------------

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

    # ---- the step -------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> list[SampledTokens | None]:
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> InFlightStep:
        """Queue the step's device work and the copies of its results; returns without waiting.

        A row whose input is the previous launch's still-pending token (async scheduling) gets
        it on the device: input_ids[t] = last_tokens[j], j its row among those that sampled.
        """
        staged = self.stager.stage(plan)
        layout, graph_size = staged.layout, staged.graph_size
        sampling = self._stage_sampling(staged)  # (before upload: its fence covers the copies)
        self.buffers.upload(layout)
        self._feed_pending(layout)
        window_rows = list(staged.window_rows)
        spec_out = None
        decode_graph = None  # the G of a replayed decode graph without a tail: its sampling graph
        if window_rows:
            spec_out = self.spec_runner.run(plan, layout, window_rows, graph_size,
                                            staged.graph_tail, staged.serials)  # fmt: skip
            logits = spec_out.logits
        elif graph_size is not None and self.stager.graphs is not None:
            logits = self.stager.graphs.replay(graph_size, staged.graph_tail)
            if staged.is_decode and not staged.graph_tail:
                decode_graph = graph_size
            self.stats["graph_steps"] += 1
            self.stats["graph_steps_mixed"] += bool(staged.graph_tail)
        else:  # (plain rows feed the drafter's context too)
            logits = self._forward(layout)
            self.stats["eager_steps"] += 1
        sampled = staged.sampled_rows
        step = InFlightStep(plan, sampled.tolist())
        # (a mixed step is not: a step behind it defers its tail's requests, engine/ahead.py)
        step.windows_first = bool(window_rows) and layout.window_width is not None
        step.is_uniform = step.windows_first and not layout.tail_rows
        if sampled.size:
            plain_logits = self._plain_logits(plan, logits, staged)
            masks = None  # (filled while the forward runs)
            if plan.grammar_rows:
                masks = self.grammar_masks.plain_masks(plan, sampled, staged.reqs)
            tokens, lp = self._sample(plain_logits, staged, sampling, decode_graph, masks)
            self._last_tokens = tokens
            serials = staged.serials if staged.is_decode else staged.serials[sampled]
            self.stager.last_sampled = step.sampled_serials = serials
            step.tokens = self._tokensto_host(tokens)
            step.logprobs = to_host(lp)
        if staged.prompt_scored:
            self._queue_prompt_logprobs(step, staged, logits)
        if isinstance(spec_out, AwaitingHost):  # verified once the host has filled it in
            step.awaiting = spec_out
            return step
        if spec_out is not None:
            self.spec_runner.queue_results(step, plan, layout, window_rows, spec_out)
        self._record_done(step)
        return step

    @torch.inference_mode()
    def verify_awaiting(self, step: InFlightStep) -> None:
        """The second half of a launched step (step.awaiting): its grammar rows' masks and
        shaped rows' shaping filled in, verification launched, the results' copies queued
        (SpecRunner.verify_awaiting)."""
        awaiting, step.awaiting = step.awaiting, None
        out = self.spec_runner.verify_awaiting(awaiting)
        self.spec_runner.queue_results(step, step.plan, awaiting.layout, awaiting.window_rows,
                                       out)  # fmt: skip
        self._record_done(step)

    def wait_with(self, previous: InFlightStep, step: InFlightStep) -> None:
        """`step` was launched behind `previous` up to its verification: let previous's one
        wait cover the drafts its grammar rows' masks need (runner/grammar_masks.py: their
        copy is queued after previous's results)."""
        awaiting = step.awaiting
        self.stats["spec_steps_verified_after_previous"] += 1
        if awaiting.grammar is None:
            return
        if awaiting.grammar.copied is not None:
            previous.done = awaiting.grammar.copied
        awaiting.grammar.waited = True
        self.stats["structured_output_steps_behind"] += 1

    def _record_done(self, step: InFlightStep) -> None:
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()

    def _queue_prompt_logprobs(
        self, step: InFlightStep, staged: Staged, logits: torch.Tensor
    ) -> None:
        """prompt_logprobs: the raw-model logprob of each scored token's next prompt token and
        the top alternatives, from the logits rows after the sampled ones
        (staging._prompt_scored), queued to the host."""
        m = len(staged.prompt_next_ids)
        scored = logits[staged.layout.num_logits - m : staged.layout.num_logits]  # [m, V]
        most = max(staged.reqs[i].sampling_params.prompt_logprobs for i, _, _ in
                   staged.prompt_scored)  # fmt: skip
        next_ids = host_to_device(list(staged.prompt_next_ids), torch.int64, self.device)
        step.prompt_scored = staged.prompt_scored
        step.prompt_logprobs = to_host(top_logprobs(scored.float(), next_ids, most))

    def prompt_logprobs(self, step: InFlightStep) -> list[tuple[Request, int, dict[int, float]]]:
        """After `collect(step)`: (request, prompt index, {token: logprob}) per scored prompt
        token, the token itself first, then its position's top alternatives."""
        if step.prompt_logprobs is None:
            return []
        chosen, top_ids, top_values = (x.tolist() for x in step.prompt_logprobs)
        entries, j = [], 0
        for i, p0, count in step.prompt_scored:
            req = step.plan.rows[i].request
            k = req.sampling_params.prompt_logprobs
            for p in range(p0, p0 + count):
                entry = {req.token_ids[p + 1]: chosen[j]}
                for token, value in zip(top_ids[j][:k], top_values[j][:k], strict=True):
                    entry.setdefault(token, value)
                entries.append((req, p + 1, entry))
                j += 1
        return entries

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

    def can_feed(self, plan: StepPlan, previous: InFlightStep) -> bool:
        """May `plan` launch before `previous` is collected? A pending token may only be the
        one input of a decode row, or the anchor of a window (not a continuation) in a step
        that lays its windows out first (a step may launch behind it), fed from `previous` (a
        preempted request re-admitted at once would need its pending token on the host). Nor
        may a plain row whose request's penalties, bad words or grammar read its outputs
        (sample/logits_shaping.py and runner/grammar_masks.py build them on the host at
        launch); a window's are built once the step before is collected
        (SpecRunner.verify_awaiting)."""
        for r in plan.rows:
            req = r.request
            if req.reads_outputs and not (r.num_draft or r.empty_window):
                if PENDING_TOKEN in req.token_ids[-2:]:
                    return False
        if plan.is_decode:
            pending = [r.request.serial for r in plan.rows
                       if r.request.token_ids[r.start] == PENDING_TOKEN]  # fmt: skip
        else:
            pending, windows, fed_rows = [], False, False
            for row in plan.rows:
                tokens = row.request.token_ids
                if row.num_draft or row.empty_window:
                    if row.is_continuation:
                        return False
                    windows = True
                    if tokens[row.start] == PENDING_TOKEN:
                        pending.append(row.request.serial)
                elif row.num_tokens == 1:
                    if tokens[row.start] == PENDING_TOKEN:
                        pending.append(row.request.serial)
                        fed_rows = True
                elif PENDING_TOKEN in tokens[row.start : row.end]:
                    return False
            # a drafting step: its plain rows are its tail (host inputs only), and a step
            # launched ahead lays its windows out first (a step may launch behind it)
            if windows and (fed_rows or not self.stager.lays_windows_first(plan)):
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
        tokens into this step's inputs, on the device (indices staged by StepStager._stage_feed)."""
        n, b = layout.num_fed, self.buffers
        if n:
            fed = self._last_tokens.index_select(0, b.feed_src[:n])
            b.input_ids.index_copy_(0, b.feed_dst[:n], fed)

    def collect(self, step: InFlightStep) -> list[SampledTokens | None]:
        """Wait for a launched step and assign its results to plan rows."""
        plan = step.plan
        # sync: the one host synchronisation of the step; the host copies were queued behind it
        if step.done is not None:
            start = time.perf_counter()
            step.done.synchronize()
            self.sync_wait_s += time.perf_counter() - start
        if step.plain and step.logprobs is None and len(step.plain) == len(plan.rows):
            # a decode step: one token per row, each SampledTokens((tok,)) built by new_tuple
            # (the NamedTuple's generated __new__ is a Python call, 256 times per step)
            return [new_tuple(SampledTokens, ((tok,), None)) for tok in step.tokens.tolist()]
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

    def _stage_sampling(self, staged: Staged) -> SamplingTensors | None:
        """The sampling tensors of the rows that sample one token (SamplingRows.stage); None
        when there are none or every one is greedy (an argmax needs no parameters)."""
        rows = staged.sampled_rows
        if not rows.size or self.sampling_rows.all_greedy(rows):
            return None
        # (the token sampled at index `end` of its request: its position)
        return self.sampling_rows.stage(rows, staged.sampled_ends)

    def _sample(
        self,
        logits: torch.Tensor,
        staged: Staged,
        sampling: SamplingTensors | None,
        decode_graph: int | None = None,  # G: a decode graph without a tail made `logits`
        masks: tuple[torch.Tensor, torch.Tensor] | None = None,  # grammar rows' (bitmask, index)
    ):
        """Tokens [N] (and logprobs) of the rows that sample one token, still on the device.
        Their parameters are the persistent sampling rows (written by PersistentBatch.sync),
        staged for this step by _stage_sampling (None: every row greedy). After a decode graph
        whose sampling is captured too, its sampling graph draws them (no row banned from
        stopping, none with top-k or top-p, no grammar: runner/sampled_decode_graphs.py).
        Grammar rows are masked first (runner/grammar_masks.py), then shaped and sampled."""
        rows, ends, params = staged.sampled_rows, staged.sampled_ends, self.sampling_rows
        banned = params.banned(rows, ends, staged.reqs)
        shaping = params.shaping(rows, ends, staged.reqs, self.device)
        graphs = self.sampled_graphs
        raw = logits  # (logprobs are the model's raw distribution, as vLLM's by default)
        if masks is not None:
            self.stats["pytorch_sampling_steps_structured_output"] += 1
            logits = apply_token_bitmask(logits, *masks)
        if shaping is not None:  # (PyTorch: no kernel or graph takes the shaping tensors)
            self.stats["pytorch_sampling_steps_logits_shaping"] += 1
            shaped = apply_shaping(self._ban_stop_tokens(logits, banned), shaping)
            if sampling is None:
                tokens = shaped.argmax(dim=-1)
            else:
                tokens = sample(shaped, replace(sampling, min_p=shaping.min_p))
        elif sampling is None:
            tokens = self._ban_stop_tokens(logits, banned).argmax(dim=-1)  # no parameters
        elif (graphs and decode_graph and not banned[0] and masks is None
              and takes_fused_path(sampling)):  # fmt: skip
            tokens = graphs.replay(decode_graph, rows.size)
            self.stats["sampled_graph_steps"] += 1
        else:
            tokens = sample(self._ban_stop_tokens(logits, banned), sampling)
        num_top = params.max_logprobs(rows)
        lp = None if num_top is None else top_logprobs(raw, tokens, num_top)
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
