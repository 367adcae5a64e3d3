"""The frozen target on a training batch: tap features and what the L1 loss compares with (the
target's logits, or its final normed hidden states for the chunked loss, vocab_loss.py).

Features are computed on the fly, one target forward per step, instead of cached: a cache of
4 taps x 576 values per token in bf16 is 4.6 KB a token, terabytes for a real data set, while
the forward costs about as much as the drafter's own step.

The batch runs as one ragged prefill through the engine's own model (dspark.models.llama), each
sequence a request with its own pages (page 0 stays the scratch page):

  lengths [5, 3], page_size 4:  cu_num_tokens [0, 5, 8]
                                pages seq0 [1, 2], seq1 [3]
                                slots [4 5 6 7 8 | 12 13 14]
  logits row of (b, anchor i, slot k): cu[b] + min(i + k, len_b - 1)   (predicts x_{i+k+1};
                                the clamp only touches slots the prefix mask drops)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.attention_metadata import AttentionMetadata
from dspark.engine.kv_cache import allocate_kv_caches
from dspark.models.llama import LlamaForCausalLM
from dspark.step_plan import pages_for
from dspark.train.anchors import Blocks, Sequence

PAGE_SIZE = 16


@dataclass(frozen=True)
class TargetBatch:
    features: torch.Tensor  # [B, L, m d] tap features, zero past each sequence's end
    # [B, A, K, V] float32, target logits predicting each block label; None with final_hidden
    logits: torch.Tensor | None
    # [B, A, K, d] the target's final normed hidden states there (run(..., logits=False))
    final_hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class PackedLayout:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    cu_num_tokens: list[int]  # [B + 1], leading zero
    num_pages: int  # pages the batch needs, scratch page included


def pack(seqs: list[Sequence], device: torch.device, page_size: int = PAGE_SIZE) -> PackedLayout:
    """The batch as one ragged prefill (worked example in the module docstring)."""
    ids, positions, slots, cu, block_table = [], [], [], [0], []
    next_page = 1  # page 0 is the scratch page
    for seq in seqs:
        n = len(seq.token_ids)
        pages = list(range(next_page, next_page + pages_for(n, page_size)))
        next_page += len(pages)
        ids += seq.token_ids
        positions += range(n)
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(n)]
        cu.append(cu[-1] + n)
        block_table.append(pages)
    width = max(len(p) for p in block_table)
    table = [p + [0] * (width - len(p)) for p in block_table]
    seq_lens = [len(s.token_ids) for s in seqs]
    attn = AttentionMetadata(
        cu_num_tokens=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        cu_num_tokens_cpu=tuple(cu),
        seq_lens_cpu=tuple(seq_lens),
    )
    return PackedLayout(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        attn=attn,
        cu_num_tokens=cu,
        num_pages=next_page,
    )


def logits_rows(blocks: Blocks, cu_num_tokens: list[int], lengths: list[int]) -> torch.Tensor:
    """Packed row of the target logits judging each block slot: [B, A, K] int64."""
    K = blocks.labels.shape[-1]
    start = torch.tensor(cu_num_tokens[:-1])[:, None, None]  # [B, 1, 1]
    last = torch.tensor(lengths)[:, None, None] - 1
    pos = blocks.anchor_positions[..., None] + torch.arange(K)  # [B, A, K]
    return start + torch.minimum(pos, last)


class TargetRunner:
    """Runs the frozen target on training batches (one KV cache per call, freed after)."""

    def __init__(self, target: LlamaForCausalLM, taps: tuple[int, ...]) -> None:
        self.target = target
        self.taps = taps
        self.device = target.embed_tokens.weight.device
        self.dtype = target.embed_tokens.weight.dtype

    @torch.no_grad()
    def run(self, seqs: list[Sequence], blocks: Blocks, logits: bool = True) -> TargetBatch:
        layout = pack(seqs, self.device)
        lengths = [len(s.token_ids) for s in seqs]
        rows = logits_rows(blocks, layout.cu_num_tokens, lengths).to(self.device)  # [B, A, K]
        kv = allocate_kv_caches(
            self.target.config, layout.num_pages, PAGE_SIZE, self.dtype, self.device
        )
        out = self.target(
            layout.input_ids, layout.positions, layout.attn, kv, rows.reshape(-1), self.taps,
            lm_head=logits,
        )  # fmt: skip
        packed = out.features  # [T, m d], the taps side by side
        features = self._pad(packed, layout.cu_num_tokens, lengths)
        if not logits:
            return TargetBatch(features, None, out.final_hidden.view(*rows.shape, -1))
        return TargetBatch(features, out.logits.view(*rows.shape, -1))

    def _pad(self, packed: torch.Tensor, cu: list[int], lengths: list[int]) -> torch.Tensor:
        """[T, m d] ragged -> [B, L, m d], zeros past each end (never attended to)."""
        padded = packed.new_zeros(len(lengths), max(lengths), packed.shape[-1])
        for b, n in enumerate(lengths):
            padded[b, :n] = packed[cu[b] : cu[b + 1]]
        return padded
