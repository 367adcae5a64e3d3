"""Plan -> device tensors -> forward -> sampled tokens. The CPU/GPU boundary of the engine.

The runner reads a StepPlan and never mutates requests: it returns one SampledToken (or None for
a prefill chunk that does not reach the end of its prompt) per plan row. A step whose rows all
decode one token replays a captured CUDA graph when one fits; any other step runs eagerly on
the same persistent buffers. Which path ran is counted in `stats`.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter

import torch

from dspark.engine.kv_cache import SCRATCH_PAGE, pages_for
from dspark.engine.scheduler import SampledToken, ScheduledRow, StepPlan
from dspark.models.llama import LlamaForCausalLM
from dspark.request import TokenLogprobs
from dspark.runner.cuda_graph import DecodeGraphs
from dspark.runner.input_buffers import InputBuffers, StepLayout
from dspark.sample.sampler import SamplingTensors, sample, top_logprobs

logger = logging.getLogger(__name__)


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
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.device = device
        self.vocab_size = model.config.vocab_size
        max_rows = max([max_num_seqs, *(graph_sizes or [])])
        self.buffers = InputBuffers(
            max(max_num_tokens, max_rows), max_rows, pages_for(max_model_len, page_size), device
        )
        self.stats: Counter[str] = Counter()
        self.graph_sizes = sorted(graph_sizes or [])
        self.graphs = None
        if self.graph_sizes and capture_graphs:
            self.graphs = DecodeGraphs(self._forward, self.buffers, self.graph_sizes)

    # ---- staging --------------------------------------------------------------------------

    def _stage(self, plan: StepPlan) -> tuple[StepLayout, int | None]:
        """Write the plan into the host staging buffers; returns the layout and graph size."""
        b = self.buffers
        ids, pos, slots, bt = (
            b.np("input_ids"),
            b.np("positions"),
            b.np("slot_mapping"),
            b.np("block_table"),
        )
        cu, seq_lens, logits_idx = b.np("cu_num_tokens"), b.np("seq_lens"), b.np("logits_indices")
        ps = self.page_size
        t, n = 0, 0
        cu[0] = 0
        for i, row in enumerate(plan.rows):
            req, k = row.request, row.num_tokens
            pages = req.page_ids
            ids[t : t + k] = req.token_ids[row.start : row.end]
            pos[t : t + k] = range(row.start, row.end)
            slots[t : t + k] = [pages[p // ps] * ps + p % ps for p in range(row.start, row.end)]
            bt[i, : len(pages)] = pages
            bt[i, len(pages) :] = SCRATCH_PAGE
            t += k
            cu[i + 1] = t
            seq_lens[i] = row.end
            if row.do_sample:
                logits_idx[n] = t - 1
                n += 1
        num_rows = len(plan.rows)
        graph_size = self._graph_size(plan)
        if graph_size is not None:  # pad to the captured size; every row is scored
            b.write_pad_rows(num_rows, t, graph_size - num_rows)
            logits_idx[:graph_size] = range(graph_size)
            t, n, num_rows = graph_size, graph_size, graph_size
        layout = StepLayout(
            t, num_rows, n, tuple(cu[: num_rows + 1].tolist()), tuple(seq_lens[:num_rows].tolist())
        )
        return layout, graph_size

    def _graph_size(self, plan: StepPlan) -> int | None:
        """The captured size a pure-decode step pads to, or None (eager, reason counted)."""
        if not self.graph_sizes:
            return None
        if not all(r.num_tokens == 1 and r.do_sample for r in plan.rows):
            self.stats["eager_steps_not_decode"] += 1
            return None
        i = bisect.bisect_left(self.graph_sizes, len(plan.rows))
        if i == len(self.graph_sizes):
            self.stats["eager_steps_batch_too_large"] += 1
            return None
        return self.graph_sizes[i]

    def _forward(self, layout: StepLayout) -> torch.Tensor:  # [N, vocab]
        b = self.buffers
        out = self.model(
            b.input_ids[: layout.num_tokens],
            b.positions[: layout.num_tokens],
            b.metadata(layout),
            self.kv_caches,
            b.logits_indices[: layout.num_logits],
        )
        return out.logits

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[SampledToken | None]:
        layout, graph_size = self._stage(plan)
        self.buffers.upload(layout)
        if graph_size is not None and self.graphs is not None:
            logits = self.graphs.replay(graph_size)
            self.stats["graph_steps"] += 1
        else:
            logits = self._forward(layout)
            self.stats["eager_steps"] += 1
        sample_rows = [i for i, r in enumerate(plan.rows) if r.do_sample]
        results: list[SampledToken | None] = [None] * len(plan.rows)
        if sample_rows:
            rows = [plan.rows[i] for i in sample_rows]
            tokens = self._sample(logits[: len(rows)], rows)
            for i, token in zip(sample_rows, tokens, strict=True):
                results[i] = token
        return results

    def _sample(self, logits: torch.Tensor, rows: list[ScheduledRow]) -> list[SampledToken]:
        tokens = sample(self._ban_stop_tokens(logits, rows), self._sampling_tensors(rows))
        wants = [r.request.sampling_params.logprobs for r in rows]
        lp = None
        if any(n is not None for n in wants):
            lp = top_logprobs(logits, tokens, max(n or 0 for n in wants))
        # sync: the one host synchronisation of the step; copies after it read finished work
        token_list = tokens.tolist()
        if lp is None:
            return [SampledToken(t) for t in token_list]
        chosen, top_ids, top_vals = (x.tolist() for x in lp)
        out = []
        for j, (tok, n) in enumerate(zip(token_list, wants, strict=True)):
            logprobs = None
            if n is not None:
                top = dict(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
                logprobs = TokenLogprobs(tok, chosen[j], top)
            out.append(SampledToken(tok, logprobs))
        return out

    def _sampling_tensors(self, rows: list[ScheduledRow]) -> SamplingTensors:
        params = [r.request.sampling_params for r in rows]
        top_k = [p.top_k if p.top_k > 0 else self.vocab_size for p in params]
        dev = self.device
        return SamplingTensors(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32).to(
                dev, non_blocking=True
            ),
            top_k=torch.tensor(top_k, dtype=torch.int64).to(dev, non_blocking=True),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32).to(
                dev, non_blocking=True
            ),
            seeds=torch.tensor([r.request.seed for r in rows], dtype=torch.int64).to(
                dev, non_blocking=True
            ),
            positions=torch.tensor([r.end for r in rows], dtype=torch.int64).to(
                dev, non_blocking=True
            ),
            all_greedy=all(p.is_greedy for p in params),
            any_top_k=any(k < self.vocab_size for k in top_k),
            any_top_p=any(p.top_p < 1.0 for p in params),
        )

    def _ban_stop_tokens(self, logits: torch.Tensor, rows: list[ScheduledRow]) -> torch.Tensor:
        """min_tokens: a request may not stop (EOS, stop token ids) before its minimum."""
        banned_rows, banned_ids = [], []
        for j, row in enumerate(rows):
            req, sp = row.request, row.request.sampling_params
            if req.num_output_tokens >= sp.min_tokens:
                continue
            ids = list(sp.stop_token_ids)
            if req.eos_token_id is not None and not sp.ignore_eos:
                ids.append(req.eos_token_id)
            banned_rows.extend([j] * len(ids))
            banned_ids.extend(ids)
        if not banned_rows:
            return logits
        logits = logits.clone()
        logits[banned_rows, banned_ids] = float("-inf")
        return logits
