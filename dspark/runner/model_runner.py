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
from dspark.runner.input_buffers import (
    PAD_TOKEN_ID,
    InputBuffers,
    StepLayout,
    host_to_device,
    to_host,
)
from dspark.runner.spec_runner import SpecRunner
from dspark.sample.sampler import SamplingTensors, sample, top_logprobs
from dspark.spec.spec_decoder import SpecDecoder

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
    is_uniform: bool = False  # all rows windows laid out K + 1 wide: a step may launch behind it
    done: torch.cuda.Event | None = None  # None on the CPU: the results are ready at once


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
        self.spec_runner = None
        if spec is not None:
            # Fixed-K windows replay captured speculative steps; plain decode steps (drafting
            # off, every row opted out) replay decode graphs that also feed the drafter's
            # context, so drafting can resume on an up-to-date cache.
            ladder = self.graph_sizes if capture_graphs else []
            self.spec_runner = SpecRunner(
                spec, self.buffers, self._run_model, self.vocab_size, self.stats, ladder
            )
        if self.graph_sizes and capture_graphs:
            self.graphs = DecodeGraphs(self._forward, self.buffers, self.graph_sizes)

    # ---- staging --------------------------------------------------------------------------

    def _stage(self, plan: StepPlan) -> tuple[StepLayout, int | None]:
        """Write the plan into the host staging buffers; returns the layout and graph size.

        Per-token values are gathered in Python lists and written with one numpy assignment
        each (per-row numpy calls cost more than the data at decode batch sizes).
        """
        b, ps = self.buffers, self.page_size
        b.wait_for_upload()
        # every window K + 1 tokens wide when the step can replay a speculative graph
        window_width = self.spec_runner.window_width(plan) if self.spec_runner else None
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
            cu.append(cu[-1] + end - start)
            seq_lens.append(end)
            b.write_block_row(i, (req.serial, req.num_preemptions, len(pages)), pages)
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
        layout = StepLayout(t, num_rows, n, tuple(cu), tuple(seq_lens), num_fed=len(fed_dst),
                            window_width=window_width)  # fmt: skip
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
        if not self.graph_sizes or any(r.num_draft for r in plan.rows):
            return None  # (a step with windows is the speculative runner's to count)
        if not all(r.num_tokens == 1 and r.do_sample for r in plan.rows):
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
        layout, graph_size = self._stage(plan)
        self.buffers.upload(layout)
        self._feed_pending(layout)
        window_rows = [i for i, r in enumerate(plan.rows) if r.num_draft]
        spec_out = None
        if window_rows:
            spec_out = self.spec_runner.run(plan, layout, window_rows, graph_size)
            logits = spec_out.logits
        elif graph_size is not None and self.graphs is not None:
            logits = self.graphs.replay(graph_size)
            self.stats["graph_steps"] += 1
        else:  # (plain rows feed the drafter's context too)
            logits = self._forward(layout)
            self.stats["eager_steps"] += 1
        plain, logit_row = [], 0
        for i, row in enumerate(plan.rows):
            if row.num_draft:
                logit_row += row.num_tokens
            elif row.do_sample:
                plain.append((i, logit_row))
                logit_row += 1
        step = InFlightStep(plan, [i for i, _ in plain])
        step.is_uniform = bool(window_rows) and layout.window_width is not None
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
            step.tokens = self._tokensto_host(tokens)
            step.logprobs = to_host(lp)
        if spec_out is not None:
            self.spec_runner.queue_results(step, plan, layout, window_rows, spec_out)
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()
        return step

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
        results: list[SampledTokens | None] = [None] * len(plan.rows)
        # sync: the one host synchronisation of the step; the host copies were queued behind it
        if step.done is not None:
            step.done.synchronize()
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
            if not sp.min_tokens or row.end - req.num_prompt_tokens >= sp.min_tokens:
                continue  # (outputs before this one reach the minimum)
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
