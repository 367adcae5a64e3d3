"""Plan -> device tensors -> forward -> sampled tokens. The CPU/GPU boundary of the engine.

The runner reads a StepPlan and never mutates requests: it returns one SampledTokens (or None for
a prefill chunk that does not reach the end of its prompt) per plan row. A step whose rows all
decode one token replays a captured CUDA graph when one fits; any other step runs eagerly on
the same persistent buffers. Which path ran is counted in `stats`.

With speculation, window rows [anchor, drafts] are drafted first (SpecDecoder.draft writes the
drafts into the input buffer on the device), every window token is scored, the tap features of
all tokens go to the drafter cache, and the windows are verified; plain rows sample as usual.
Both results come to the host in the step's one synchronisation (`_collect`).
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter

import torch

from dspark.engine.kv_cache import pages_for
from dspark.engine.scheduler import SampledTokens, ScheduledRow, StepPlan
from dspark.models.llama import LlamaForCausalLM
from dspark.request import TokenLogprobs
from dspark.runner.cuda_graph import DecodeGraphs
from dspark.runner.input_buffers import InputBuffers, StepLayout
from dspark.sample.sampler import SamplingTensors, sample, top_logprobs
from dspark.spec.spec_decoder import SpecDecoder, WindowRows

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
        self.graph_sizes = sorted(graph_sizes or [])
        if device.type == "cuda":
            self._warm_up_eager(max_num_tokens)
        self.graphs = None
        if self.graph_sizes and capture_graphs and spec is None:
            self.graphs = DecodeGraphs(self._forward, self.buffers, self.graph_sizes)
        elif self.graph_sizes and spec is not None:
            # the decode graphs do not produce the drafter's tap features yet
            logger.warning("speculation runs eagerly for now: decode CUDA graphs are off")
            self.graph_sizes = []

    # ---- staging --------------------------------------------------------------------------

    def _stage(self, plan: StepPlan) -> tuple[StepLayout, int | None]:
        """Write the plan into the host staging buffers; returns the layout and graph size.

        Per-token values are gathered in Python lists and written with one numpy assignment
        each (per-row numpy calls cost more than the data at decode batch sizes).
        """
        b, ps = self.buffers, self.page_size
        ids, positions, slots, cu, seq_lens, logits_idx = [], [], [], [0], [], []
        for i, row in enumerate(plan.rows):
            req, span = row.request, range(row.start, row.end)
            pages = req.page_ids
            if row.num_draft:  # [anchor, drafts]: the drafts are scattered in on the device
                ids += [req.token_ids[row.start]] + [0] * row.num_draft
            else:
                ids += req.token_ids[row.start : row.end]
            positions += span
            slots += [pages[p // ps] * ps + p % ps for p in span]
            cu.append(cu[-1] + row.num_tokens)
            seq_lens.append(row.end)
            if row.num_draft:  # every window token is scored
                logits_idx += range(cu[-2], cu[-1])
            elif row.do_sample:
                logits_idx.append(cu[-1] - 1)
            b.write_block_row(i, (req.request_id, req.num_preemptions, len(pages)), pages)
        t, num_rows, n = cu[-1], len(plan.rows), len(logits_idx)
        b.np("input_ids")[:t] = ids
        b.np("positions")[:t] = positions
        b.np("slot_mapping")[:t] = slots
        b.np("cu_num_tokens")[: num_rows + 1] = cu
        b.np("seq_lens")[:num_rows] = seq_lens
        b.np("logits_indices")[:n] = logits_idx
        graph_size = self._graph_size(plan)
        if graph_size is not None:  # pad to the captured size; every row is scored
            b.write_pad_rows(num_rows, t, graph_size - num_rows)
            b.np("logits_indices")[:graph_size] = range(graph_size)
            pad = graph_size - num_rows
            cu += range(t + 1, t + pad + 1)
            seq_lens += [1] * pad
            t, n, num_rows = graph_size, graph_size, graph_size
        return StepLayout(t, num_rows, n, tuple(cu), tuple(seq_lens)), graph_size

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

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[SampledTokens | None]:
        layout, graph_size = self._stage(plan)
        self.buffers.upload(layout)
        windows, window_st, block = self._draft(plan)
        if graph_size is not None and self.graphs is not None:
            logits = self.graphs.replay(graph_size)
            self.stats["graph_steps"] += 1
        else:
            out = self._run_model(layout, self.spec.taps if self.spec else ())
            logits = out.logits
            self.stats["eager_steps"] += 1
            if self.spec is not None:
                b, t = self.buffers, layout.num_tokens
                self.spec.append_context(out.hidden_states, b.positions[:t], b.slot_mapping[:t])
        plain, window_logit_rows, logit_row = [], [], 0
        for i, row in enumerate(plan.rows):
            if row.num_draft:
                window_logit_rows += range(logit_row, logit_row + row.num_tokens)
                logit_row += row.num_tokens
            elif row.do_sample:
                plain.append((i, logit_row))
                logit_row += 1
        plain_rows = [plan.rows[i] for i, _ in plain]
        tokens, lp = None, None
        if plain:
            tokens, lp = self._sample(logits[[r for _, r in plain]], plain_rows)
        verified, window_lp = None, None
        if windows is not None:
            window_logits = logits[window_logit_rows]
            verified = self.spec.verify(window_logits, windows, window_st, block)
            window_lp = self._window_logprobs(plan, window_logits, windows, verified)
        return self._collect(plan, plain, plain_rows, tokens, lp, windows, verified, window_lp)

    def _window_logprobs(self, plan: StepPlan, window_logits, windows, verified):
        """The target's logprobs of each emitted window token: emitted token i of a window is
        scored by window row i (the anchor's row scores the first). None if nobody asked."""
        wants = [r.request.sampling_params.logprobs for r in plan.rows if r.num_draft]
        if all(n is None for n in wants):
            return None
        lens = torch.tensor([1 + n for n in windows.verify_len], device=self.device)
        owner = torch.repeat_interleave(torch.arange(len(lens), device=self.device), lens)
        start = torch.cumsum(lens, 0) - lens
        offset = torch.arange(int(lens.sum()), device=self.device) - start[owner]
        tokens = verified.tokens[owner, offset]  # [Tw] the token each window row would emit
        return top_logprobs(window_logits, tokens, max(n or 0 for n in wants))

    def _draft(self, plan: StepPlan):
        """Draft every window row (before the target forward, which verifies the drafts)."""
        idx = [i for i, r in enumerate(plan.rows) if r.num_draft]
        if not idx:
            return None, None, None
        rows = [plan.rows[i] for i in idx]
        cu = self.buffers.np("cu_num_tokens")
        windows = WindowRows(
            anchors=[r.request.token_ids[r.start] for r in rows],
            anchor_positions=[r.start for r in rows],
            verify_len=[r.num_draft for r in rows],
            token_offsets=[int(cu[i]) for i in idx],
            page_ids=[r.request.page_ids for r in rows],
        )
        st = self._sampling_tensors(rows)
        return windows, st, self.spec.draft(windows, st, self.buffers.input_ids)

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

    def _collect(self, plan, plain, plain_rows, tokens, lp, windows, verified, window_lp):
        """Bring the step's results to the host and assign them to plan rows."""
        results: list[SampledTokens | None] = [None] * len(plan.rows)
        # sync: the one host synchronisation of the step; copies after it read finished work
        token_list = tokens.tolist() if tokens is not None else []
        if verified is not None:
            emitted, accepted = verified.tokens.tolist(), verified.num_accepted.tolist()
            self.spec.record(windows.verify_len, accepted)
            wlp = [x.tolist() for x in window_lp] if window_lp is not None else None
            idx = [i for i, r in enumerate(plan.rows) if r.num_draft]
            row0 = 0
            for j, i in enumerate(idx):
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
                row0 += 1 + windows.verify_len[j]
        lp_lists = [x.tolist() for x in lp] if lp is not None else None
        for j, ((i, _), tok) in enumerate(zip(plain, token_list, strict=True)):
            n = plain_rows[j].request.sampling_params.logprobs
            logprobs = None
            if n is not None and lp_lists is not None:
                chosen, top_ids, top_vals = lp_lists
                top = dict(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
                logprobs = (TokenLogprobs(tok, chosen[j], top),)
            results[i] = SampledTokens((tok,), logprobs)
        return results

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
