"""Plan -> device tensors -> forward -> sampled tokens. The CPU/GPU boundary of the engine.

The runner reads a StepPlan and never mutates requests: it returns one SampledTokens (or None for
a prefill chunk that does not reach the end of its prompt) per plan row. A step whose rows all
decode one token replays a captured CUDA graph when one fits; any other step runs eagerly on
the same persistent buffers. Which path ran is counted in `stats`.

With speculation, window rows [anchor, drafts] go through SpecDecoder.step: drafted first (the
drafts are written into the input buffer on the device), every window token scored, the tap
features of all tokens appended to the drafter cache, the windows verified; plain rows sample
as usual. A step of only full windows replays a captured speculative graph (SpecGraphs).
Both results come to the host in the step's one synchronisation (`_collect`).
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from dataclasses import dataclass

import torch

from dspark.engine.kv_cache import pages_for
from dspark.engine.scheduler import SampledTokens, ScheduledRow, StepPlan
from dspark.models.llama import LlamaForCausalLM
from dspark.request import PENDING_TOKEN, TokenLogprobs
from dspark.runner.cuda_graph import DecodeGraphs
from dspark.runner.input_buffers import InputBuffers, StepLayout, host_to_device
from dspark.runner.spec_graphs import SpecGraphs, window_layout
from dspark.sample.sampler import SamplingTensors, sample, top_logprobs
from dspark.spec.spec_buffers import SamplingMode, WindowRow
from dspark.spec.spec_decoder import SpecDecoder, SpecStepOutput, TargetStep

logger = logging.getLogger(__name__)


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
    confidence: torch.Tensor | None = None  # [R, K] raw confidence logits (for observers)
    window_logprobs: tuple[torch.Tensor, ...] | None = None
    done: torch.cuda.Event | None = None  # None on the CPU: the results are ready at once


def _to_host(x):
    """Queue device -> pinned host copies (a tensor or a tuple of them); None stays None."""
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(t.to("cpu", non_blocking=True) for t in x)
    return x.to("cpu", non_blocking=True)


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
    ) -> None:
        self.model = model
        self.spec = spec
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.device = device
        self.vocab_size = model.config.vocab_size
        max_rows = max([max_num_seqs, *(graph_sizes or [])])
        self.buffers = InputBuffers(
            max(max_num_tokens, max_rows), max_rows, pages_for(max_model_len, page_size), device
        )
        self.stats: Counter[str] = Counter()
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
        self.spec_graphs = None
        if self.graph_sizes and capture_graphs and spec is None:
            self.graphs = DecodeGraphs(self._forward, self.buffers, self.graph_sizes)
        elif self.graph_sizes and spec is not None:
            # Fixed-K windows replay captured speculative steps. Plain decode steps (every row
            # opted out or near its end) run eagerly: the decode graphs do not produce the
            # drafter's tap features yet.
            width = 1 + spec.num_verify
            capacity = self.buffers.input_ids.shape[0]
            sizes = [g for g in self.graph_sizes if g * width <= capacity]
            if capture_graphs and sizes:
                self.spec_graphs = SpecGraphs(self._spec_graph_step, self._prepare_spec_graph,
                                              sizes)  # fmt: skip
            self.graph_sizes = []

    # ---- staging --------------------------------------------------------------------------

    def _stage(self, plan: StepPlan) -> tuple[StepLayout, int | None]:
        """Write the plan into the host staging buffers; returns the layout and graph size.

        Per-token values are gathered in Python lists and written with one numpy assignment
        each (per-row numpy calls cost more than the data at decode batch sizes).
        """
        b, ps = self.buffers, self.page_size
        b.wait_for_upload()
        ids, positions, slots, cu, seq_lens, logits_idx = [], [], [], [0], [], []
        fed_dst, fed_src = [], []  # input tokens still on the device (async scheduling)
        for i, row in enumerate(plan.rows):
            req, start, end = row.request, row.start, row.end
            pages = req.page_ids
            if end - start == 1 and not row.num_draft:  # a decode token: the common case
                token = req.token_ids[start]
                if token == PENDING_TOKEN:
                    fed_dst.append(cu[-1])
                    fed_src.append(self._last_index[req.request_id])
                ids.append(token)
                positions.append(start)
                slots.append(pages[start // ps] * ps + start % ps)
                if row.do_sample:  # (a 1-token prefill chunk short of the prompt's end does not)
                    logits_idx.append(cu[-1])
            else:
                if row.num_draft:  # [anchor, drafts]: the drafts are scattered in on the device
                    ids += [req.token_ids[start]] + [0] * row.num_draft
                    logits_idx += range(cu[-1], cu[-1] + row.num_tokens)  # all scored
                else:
                    ids += req.token_ids[start:end]
                    assert PENDING_TOKEN not in req.token_ids[start:end], (
                        f"request {req.request_id}: a pending token can only feed a decode row"
                    )
                    if row.do_sample:
                        logits_idx.append(cu[-1] + row.num_tokens - 1)
                positions += range(start, end)
                slots += [pages[p // ps] * ps + p % ps for p in range(start, end)]
            cu.append(cu[-1] + end - start)
            seq_lens.append(end)
            b.write_block_row(i, (req.request_id, req.num_preemptions, len(pages)), pages)
        b.np("feed_dst")[: len(fed_dst)] = fed_dst
        b.np("feed_src")[: len(fed_src)] = fed_src
        t, num_rows, n = cu[-1], len(plan.rows), len(logits_idx)
        b.np("input_ids")[:t] = ids
        b.np("positions")[:t] = positions
        b.np("slot_mapping")[:t] = slots
        b.np("cu_num_tokens")[: num_rows + 1] = cu
        b.np("seq_lens")[:num_rows] = seq_lens
        b.np("logits_indices")[:n] = logits_idx
        graph_size = self._graph_size(plan)
        width = 1
        if graph_size is None and self.spec_graphs is not None:
            graph_size = self._spec_graph_size(plan)
            width = 1 + self.spec.num_verify
        if graph_size is not None:  # pad to the captured size; every token is scored
            pad = graph_size - num_rows
            b.write_pad_rows(num_rows, t, pad, width)
            b.np("logits_indices")[: t + pad * width] = range(t + pad * width)
            cu += range(t + width, t + pad * width + 1, width)
            seq_lens += [width] * pad
            t, num_rows = t + pad * width, graph_size
            n = t
        layout = StepLayout(t, num_rows, n, tuple(cu), tuple(seq_lens), num_fed=len(fed_dst))
        return layout, graph_size

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
            b.write_block_row(0, ("warm-up", n), pages)
            b.np("logits_indices")[:1] = n - 1
            layout = StepLayout(n, 1, 1, (0, n), (n,))
            b.upload(layout)
            self._forward(layout)
        torch.cuda.synchronize(self.device)

    def _graph_size(self, plan: StepPlan) -> int | None:
        """The captured size a pure-decode step pads to, or None (eager, reason counted)."""
        if not self.graph_sizes:
            return None
        if not all(r.num_tokens == 1 and r.do_sample and not r.num_draft for r in plan.rows):
            self.stats["eager_steps_not_decode"] += 1
            return None
        i = bisect.bisect_left(self.graph_sizes, len(plan.rows))
        if i == len(self.graph_sizes):
            self.stats["eager_steps_batch_too_large"] += 1
            return None
        return self.graph_sizes[i]

    def _spec_graph_size(self, plan: StepPlan) -> int | None:
        """The captured size a fixed-K speculative step pads to, or None (eager, counted)."""
        if not all(r.num_draft == self.spec.num_verify for r in plan.rows):
            self.stats["eager_spec_steps_not_all_full_windows"] += 1
            return None
        i = bisect.bisect_left(self.spec_graphs.sizes, len(plan.rows))
        if i == len(self.spec_graphs.sizes):
            self.stats["eager_spec_steps_batch_too_large"] += 1
            return None
        return self.spec_graphs.sizes[i]

    def _forward(self, layout: StepLayout) -> torch.Tensor:  # [N, vocab]
        return self._run_model(layout).logits

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
        layout, graph_size = self._stage(plan)
        self.buffers.upload(layout)
        self._feed_pending(layout)
        window_rows = [i for i, r in enumerate(plan.rows) if r.num_draft]
        spec_out = None
        if window_rows:
            spec_out = self._speculate(plan, layout, window_rows, graph_size)
            logits = spec_out.logits
        elif graph_size is not None and self.graphs is not None:
            logits = self.graphs.replay(graph_size)
            self.stats["graph_steps"] += 1
        else:
            out = self._run_model(layout, self.spec.taps if self.spec else ())
            logits = out.logits
            self.stats["eager_steps"] += 1
            if self.spec is not None:  # plain rows feed the drafter's context too
                b, t = self.buffers, layout.num_tokens
                self.spec.append_context(out.hidden_states, b.positions[:t], b.slot_mapping[:t])
        plain, logit_row = [], 0
        for i, row in enumerate(plan.rows):
            if row.num_draft:
                logit_row += row.num_tokens
            elif row.do_sample:
                plain.append((i, logit_row))
                logit_row += 1
        step = InFlightStep(plan, [i for i, _ in plain])
        if plain:
            logit_rows = [r for _, r in plain]
            if logit_rows[-1] == len(logit_rows) - 1:  # rows 0..n-1: a view, no gather
                plain_logits = logits[: len(logit_rows)]
            else:
                plain_logits = logits[host_to_device(logit_rows, torch.int64, self.device)]
            tokens, lp = self._sample(plain_logits, [plan.rows[i] for i in step.plain])
            self._last_tokens = tokens
            self._last_index = {plan.rows[i].request.request_id: j
                                for j, i in enumerate(step.plain)}  # fmt: skip
            step.tokens = self._tokens_to_host(tokens)
            step.logprobs = _to_host(lp)
        if spec_out is not None:
            R = len(window_rows)
            step.window_rows = window_rows
            step.verify_len = [plan.rows[i].num_draft for i in window_rows]
            step.verified = _to_host((spec_out.tokens[:R], spec_out.num_accepted[:R]))
            if self.spec.observers and spec_out.confidence_logits is not None:
                step.confidence = _to_host(spec_out.confidence_logits[:R].float())
            step.window_logprobs = _to_host(self._window_logprobs(plan, spec_out, step.verify_len))
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()
        return step

    def _tokens_to_host(self, tokens: torch.Tensor) -> torch.Tensor:
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
        results: list[SampledTokens | None] = [None] * len(plan.rows)
        # sync: the one host synchronisation of the step; the host copies were queued behind it
        if step.done is not None:
            step.done.synchronize()
        if step.verified is not None:
            emitted, accepted = (x.tolist() for x in step.verified)
            self.spec.record(step.verify_len, accepted, step.confidence)
            wlp = None
            if step.window_logprobs is not None:
                wlp = [x.tolist() for x in step.window_logprobs]
            row0 = 0
            for j, i in enumerate(step.window_rows):
                toks = tuple(emitted[j][: accepted[j] + 1])
                n = plan.rows[i].request.sampling_params.logprobs
                logprobs = None
                if n is not None and wlp is not None:
                    chosen, top_ids, top_vals = wlp
                    logprobs = tuple(
                        TokenLogprobs(t, chosen[row0 + k], dict(zip(top_ids[row0 + k][:n],
                                      top_vals[row0 + k][:n], strict=True)))
                        for k, t in enumerate(toks)
                    )  # fmt: skip
                results[i] = SampledTokens(toks, logprobs)
                row0 += 1 + step.verify_len[j]
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

    def _window_logprobs(self, plan: StepPlan, out: SpecStepOutput, verify_len: list[int]):
        """The target's logprobs of each emitted window token: emitted token i of a window is
        scored by window row i (the anchor's row scores the first). None if nobody asked."""
        wants = [r.request.sampling_params.logprobs for r in plan.rows if r.num_draft]
        if all(n is None for n in wants):
            return None
        lens = [1 + n for n in verify_len]
        total = sum(lens)  # the live window tokens (a padded graph step has more rows after)
        dev = self.device
        owner = torch.repeat_interleave(
            torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev), output_size=total
        )
        start = torch.tensor([sum(lens[:j]) for j in range(len(lens))], device=dev)
        offset = torch.arange(total, device=dev) - start[owner]
        tokens = out.tokens[owner, offset]  # [Tw] the token each window row would emit
        return top_logprobs(out.window_logits[:total], tokens, max(n or 0 for n in wants))

    # ---- speculation ------------------------------------------------------------------------

    def _speculate(
        self, plan: StepPlan, layout: StepLayout, window_rows: list[int], graph_size: int | None
    ) -> SpecStepOutput:
        """Stage the windows and run the speculative step: a captured graph when the step is
        all full windows of a captured size, else eagerly (mixed batches, short windows)."""
        cu = layout.cu_num_tokens_cpu
        rows = []
        for i in window_rows:
            r = plan.rows[i]
            req, sp = r.request, r.request.sampling_params
            rows.append(WindowRow(
                anchor=req.token_ids[r.start], anchor_pos=r.start, verify_len=r.num_draft,
                token_offset=cu[i], page_ids=req.page_ids, temperature=sp.temperature,
                top_k=sp.top_k if sp.top_k > 0 else self.vocab_size, top_p=sp.top_p,
                seed=req.seed,
            ))  # fmt: skip
        mode = SamplingMode.of(rows, self.vocab_size)
        if graph_size is not None:  # every plan row is a full window: pad rows follow them
            self.spec.stage(rows, graph_size, pad_token_offset=cu[len(rows)])
            self.stats["spec_graph_steps"] += 1
            return self.spec_graphs.replay(graph_size, mode)
        self.spec.stage(rows, len(rows))
        self.stats["eager_spec_steps"] += 1
        b, dev = self.buffers, self.device
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
        return self.spec.step(len(rows), mode, self._target_step(layout, block_table), window_index)

    def _target_step(self, layout: StepLayout, block_table: torch.Tensor) -> TargetStep:
        b, t = self.buffers, layout.num_tokens
        return TargetStep(
            run=lambda: self._run_model(layout, self.spec.taps),
            input_ids=b.input_ids[:t],
            positions=b.positions[:t],
            slot_mapping=b.slot_mapping[:t],
            block_table=block_table,
        )

    def _prepare_spec_graph(self, size: int) -> None:
        """Fill the buffers with `size` pad windows (capture inputs: the scratch page only)."""
        b, width = self.buffers, 1 + self.spec.num_verify
        b.write_pad_rows(0, 0, size, width)
        b.np("logits_indices")[: size * width] = range(size * width)
        b.upload(window_layout(size, width))
        self.spec.stage([], size)

    def _spec_graph_step(self, size: int, mode: SamplingMode) -> SpecStepOutput:
        layout = window_layout(size, 1 + self.spec.num_verify)
        return self.spec.step(size, mode, self._target_step(layout, self.buffers.block_table), None)

    def _sample(self, logits: torch.Tensor, rows: list[ScheduledRow]):
        """Tokens [N] (and logprobs) of the rows that sample one token, still on the device."""
        masked = self._ban_stop_tokens(logits, rows)
        if all(r.request.sampling_params.is_greedy for r in rows):
            tokens = masked.argmax(dim=-1)  # no sampling tensors to build or upload
        else:
            tokens = sample(masked, self._sampling_tensors(rows))
        wants = [r.request.sampling_params.logprobs for r in rows]
        lp = None
        if any(n is not None for n in wants):
            lp = top_logprobs(logits, tokens, max(n or 0 for n in wants))
        return tokens, lp

    def _sampling_tensors(self, rows: list[ScheduledRow]) -> SamplingTensors:
        params = [r.request.sampling_params for r in rows]
        top_k = [p.top_k if p.top_k > 0 else self.vocab_size for p in params]
        dev = self.device
        return SamplingTensors(
            temperature=host_to_device([p.temperature for p in params], torch.float32, dev),
            top_k=host_to_device(top_k, torch.int64, dev),
            top_p=host_to_device([p.top_p for p in params], torch.float32, dev),
            seeds=host_to_device([r.request.seed for r in rows], torch.int64, dev),
            positions=host_to_device([r.end for r in rows], torch.int64, dev),
            all_greedy=all(p.is_greedy for p in params),
            any_top_k=any(k < self.vocab_size for k in top_k),
            any_top_p=any(p.top_p < 1.0 for p in params),
        )

    def _ban_stop_tokens(self, logits: torch.Tensor, rows: list[ScheduledRow]) -> torch.Tensor:
        """min_tokens: a request may not stop (EOS, stop token ids) before its minimum."""
        banned_rows, banned_ids = [], []
        for j, row in enumerate(rows):
            req, sp = row.request, row.request.sampling_params
            if row.end - req.num_prompt_tokens >= sp.min_tokens:  # outputs before this one
                continue
            ids = list(sp.stop_token_ids)
            if req.eos_token_id is not None and not sp.ignore_eos:
                ids.append(req.eos_token_id)
            banned_rows.extend([j] * len(ids))
            banned_ids.extend(ids)
        if not banned_rows:
            return logits
        logits = logits.clone()
        index = host_to_device([banned_rows, banned_ids], torch.int64, self.device)
        logits[index[0], index[1]] = float("-inf")
        return logits
