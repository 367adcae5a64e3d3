"""Plan -> device tensors -> forward -> sampled tokens. The CPU/GPU boundary of the engine.

The runner reads a StepPlan and never mutates requests: it returns one SampledToken (or None for
a prefill chunk that does not reach the end of its prompt) per plan row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.engine.kv_cache import SCRATCH_PAGE
from dspark.engine.scheduler import SampledToken, StepPlan
from dspark.layers.attention_metadata import AttentionMetadata
from dspark.models.llama import LlamaForCausalLM
from dspark.request import TokenLogprobs
from dspark.sample.sampler import SamplingTensors, sample, top_logprobs


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [N] last token of each sampling row
    sample_rows: tuple[int, ...]  # plan row of each logits index


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        page_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.device = device
        self.vocab_size = model.config.vocab_size

    def prepare(self, plan: StepPlan) -> StepInputs:
        """Lay the plan out as one ragged batch (see AttentionMetadata for the layout)."""
        input_ids, positions, slots, cu, seq_lens, logits_idx, sample_rows = (
            [],
            [],
            [],
            [0],
            [],
            [],
            [],
        )
        ps = self.page_size
        for i, row in enumerate(plan.rows):
            req = row.request
            input_ids.extend(req.token_ids[row.start : row.end])
            positions.extend(range(row.start, row.end))
            slots.extend(req.page_ids[p // ps] * ps + p % ps for p in range(row.start, row.end))
            cu.append(cu[-1] + row.num_tokens)
            seq_lens.append(row.end)
            if row.do_sample:
                logits_idx.append(cu[-1] - 1)
                sample_rows.append(i)
        max_pages = max(len(r.request.page_ids) for r in plan.rows)
        block_table = [
            r.request.page_ids + [SCRATCH_PAGE] * (max_pages - len(r.request.page_ids))
            for r in plan.rows
        ]
        dev = self.device
        attn = AttentionMetadata(
            cu_num_tokens=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_table=torch.tensor(block_table, dtype=torch.int32, device=dev),
            cu_num_tokens_cpu=tuple(cu),
            seq_lens_cpu=tuple(seq_lens),
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            attn=attn,
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64, device=dev),
            sample_rows=tuple(sample_rows),
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[SampledToken | None]:
        inputs = self.prepare(plan)
        out = self.model(
            inputs.input_ids, inputs.positions, inputs.attn, self.kv_caches, inputs.logits_indices
        )
        results: list[SampledToken | None] = [None] * len(plan.rows)
        if not inputs.sample_rows:
            return results
        rows = [plan.rows[i] for i in inputs.sample_rows]
        logits = out.logits  # [N, vocab] float32
        tokens = sample(self._ban_stop_tokens(logits, rows), self._sampling_tensors(rows))
        num_logprobs = max((r.request.sampling_params.logprobs or 0) for r in rows)
        wants_logprobs = any(r.request.sampling_params.logprobs is not None for r in rows)
        lp = top_logprobs(logits, tokens, num_logprobs) if wants_logprobs else None
        # sync: the one host synchronisation of the step; copies after it read finished work
        token_list = tokens.tolist()
        lp_lists = [t.tolist() for t in lp] if lp is not None else None
        for j, (i, tok) in enumerate(zip(inputs.sample_rows, token_list, strict=True)):
            n = plan.rows[i].request.sampling_params.logprobs
            logprobs = None
            if n is not None and lp_lists is not None:
                chosen, top_ids, top_vals = lp_lists
                top = dict(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
                logprobs = TokenLogprobs(tok, chosen[j], top)
            results[i] = SampledToken(tok, logprobs)
        return results

    def _sampling_tensors(self, rows) -> SamplingTensors:
        params = [r.request.sampling_params for r in rows]
        top_k = [p.top_k if p.top_k > 0 else self.vocab_size for p in params]
        dev = self.device
        return SamplingTensors(
            temperature=torch.tensor(
                [p.temperature for p in params], dtype=torch.float32, device=dev
            ),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=dev),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            seeds=torch.tensor([r.request.seed for r in rows], dtype=torch.int64, device=dev),
            positions=torch.tensor([r.end for r in rows], dtype=torch.int64, device=dev),
            all_greedy=all(p.is_greedy for p in params),
            any_top_k=any(k < self.vocab_size for k in top_k),
            any_top_p=any(p.top_p < 1.0 for p in params),
        )

    def _ban_stop_tokens(self, logits: torch.Tensor, rows) -> torch.Tensor:
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
