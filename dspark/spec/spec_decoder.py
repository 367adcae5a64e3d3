"""The speculative half of a step, for the rows that carry a window [anchor, drafts].

Order inside one step (the runner calls these around the target forward):
  1. draft():    drafter block forward over [anchor, MASK x (K-1)] for every window row, then the
                 Markov loop; the first verify_len drafts of each row are scattered into the
                 target's input ids on the device (no host sync).
  2. (the target forward runs on all rows, returning logits at every window token and the
     tap layers' hidden states)
  3. append_context(): the tap features of EVERY token of the step go into the drafter cache at
                 the target's slots. Rows past a window's accepted prefix are stale but harmless:
                 the next block writes exactly those slots before anything reads them.
  4. verify():   target distributions per window token (each token's owner row's sampling
                 parameters), then lossless rejection sampling.

Window rows of a step, worked example (verify_len [2, 1], K = 3, anchors at positions 9, 4):
  target tokens:   [a0 d0 d1 | a1 d0]   at positions [9 10 11 | 4 5]
  drafter block:   rows of K = 3 slots  at positions [9 10 11 | 4 5 6]
  draft scatter:   input_ids[t0 + 1 + k] = drafts[j, k] for k < verify_len[j]
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from dspark.layers.attention_metadata import AttentionMetadata
from dspark.models.dspark_drafter import DSparkDrafter
from dspark.sample.sampler import SamplingTensors, sampling_probs
from dspark.spec.drafting import DraftBlock, draft_block
from dspark.spec.verifier import VerifyInput, VerifyOutput, verify


@dataclass(frozen=True)
class WindowRows:
    """The window rows of a step, as the host laid them out (plan order)."""

    anchors: list[int]  # token id at each row's anchor position
    anchor_positions: list[int]
    verify_len: list[int]
    token_offsets: list[int]  # index of each row's anchor in the step's token layout
    page_ids: list[list[int]]


class SpecDecoder:
    def __init__(
        self,
        drafter: DSparkDrafter,
        kv_caches: list[torch.Tensor],
        page_size: int,
        device,
        num_verify: int | None = None,  # K verified per window (<= draft_len; default all)
    ) -> None:
        self.drafter = drafter
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.device = device
        self.draft_len = drafter.config.draft_len
        self.num_verify = num_verify or self.draft_len
        self.taps = drafter.config.target_layers
        self.metrics: Counter[str] = Counter()
        self.accepted_per_position = [0] * self.draft_len

    # ---- 1. draft ---------------------------------------------------------------------------

    def draft(self, rows: WindowRows, st: SamplingTensors, input_ids: torch.Tensor) -> DraftBlock:
        K, ps, dev = self.draft_len, self.page_size, self.device
        R = len(rows.anchors)
        positions = [p + k for p in rows.anchor_positions for k in range(K)]
        slots = [
            pages[pos // ps] * ps + pos % ps
            for pages, p in zip(rows.page_ids, rows.anchor_positions, strict=True)
            for pos in range(p, p + K)
        ]
        width = max(len(p) for p in rows.page_ids)
        block_table = [p + [0] * (width - len(p)) for p in rows.page_ids]
        seq_lens = [p + K for p in rows.anchor_positions]
        attn = AttentionMetadata(
            cu_num_tokens=torch.arange(0, (R + 1) * K, K, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_table=torch.tensor(block_table, dtype=torch.int32, device=dev),
            cu_num_tokens_cpu=tuple(range(0, (R + 1) * K, K)),
            seq_lens_cpu=tuple(seq_lens),
            causal=False,
        )
        anchors = torch.tensor(rows.anchors, dtype=torch.int64, device=dev)
        anchor_pos = torch.tensor(rows.anchor_positions, dtype=torch.int64, device=dev)
        hidden = self.drafter.block_hidden(
            anchors, torch.tensor(positions, device=dev), attn, self.kv_caches
        )
        block = draft_block(self.drafter, hidden, anchors, anchor_pos, st)
        dst, src_row, src_k = [], [], []
        for j, (t0, n) in enumerate(zip(rows.token_offsets, rows.verify_len, strict=True)):
            dst += range(t0 + 1, t0 + 1 + n)
            src_row += [j] * n
            src_k += range(n)
        if dst:
            input_ids[torch.tensor(dst, device=dev)] = block.tokens[
                torch.tensor(src_row, device=dev), torch.tensor(src_k, device=dev)
            ]
        return block

    # ---- 3. context -------------------------------------------------------------------------

    def append_context(
        self,
        hidden_states: dict[int, torch.Tensor],  # tap layer -> [T, d]
        positions: torch.Tensor,  # [T]
        slot_mapping: torch.Tensor,  # [T]
    ) -> None:
        features = torch.cat([hidden_states[i] for i in self.taps], dim=-1)  # [T, m d]
        self.drafter.append_context(features, positions, slot_mapping, self.kv_caches)

    # ---- 4. verify --------------------------------------------------------------------------

    def verify(
        self,
        window_logits: torch.Tensor,  # [Tw, V] target logits at every window token
        rows: WindowRows,
        st: SamplingTensors,  # per window row
        block: DraftBlock,
    ) -> VerifyOutput:
        dev = self.device
        windows = torch.tensor([1 + n for n in rows.verify_len], device=dev)
        owner = torch.repeat_interleave(torch.arange(len(windows), device=dev), windows)
        per_token = SamplingTensors(
            temperature=st.temperature[owner], top_k=st.top_k[owner], top_p=st.top_p[owner],
            seeds=st.seeds[owner], positions=st.positions[owner], all_greedy=st.all_greedy,
            any_top_k=st.any_top_k, any_top_p=st.any_top_p,
        )  # fmt: skip
        cu = torch.zeros(len(windows) + 1, dtype=torch.int64, device=dev)
        cu[1:] = windows.cumsum(0)
        return verify(
            VerifyInput(
                target_probs=sampling_probs(window_logits, per_token),
                draft_probs=block.probs,
                draft_tokens=block.tokens,
                verify_len=windows - 1,
                cu_num_tokens=cu,
                anchor_positions=torch.tensor(rows.anchor_positions, device=dev),
                seeds=st.seeds,
                is_greedy=st.temperature == 0,
            )
        )

    def record(self, verify_len: list[int], num_accepted: list[int]) -> None:
        """vLLM's counters: drafts (windows), drafted tokens, accepted tokens, per position."""
        self.metrics["num_drafts"] += len(verify_len)
        self.metrics["num_draft_tokens"] += sum(verify_len)
        self.metrics["num_accepted_tokens"] += sum(num_accepted)
        for n in num_accepted:
            for k in range(n):
                self.accepted_per_position[k] += 1
