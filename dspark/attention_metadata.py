"""The one object that tells attention what every token of a step may see.

A step is a ragged batch of R requests. Request r contributes the query tokens
cu_num_tokens[r] .. cu_num_tokens[r+1]: a prefill chunk, one decode token, or a verify window
(anchor + drafts). Its KV after this step's writes has seq_lens[r] tokens, stored in the pages
block_table[r, :]. The query tokens are the last ones of the request, so query j of a request
with q_len tokens sits at position seq_lens[r] - q_len + j and may see KV positions 0 .. that
position (causal within the request, full over its earlier context).

  windows:        [3, 1, 2]         (a 3-token chunk, a decode token, a 2-token window)
  cu_num_tokens:  [0, 3, 4, 6]
  seq_lens:       [10, 5, 2]        -> query positions [7, 8, 9 | 4 | 0, 1]
  slot_mapping:   one KV slot per query token (page * page_size + offset)

The `_cpu` lists are host mirrors the scheduler already knew; the reference attention loops over
them, a GPU kernel reads the device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    cu_num_tokens: torch.Tensor  # [R+1] int32, leading zero
    seq_lens: torch.Tensor  # [R] int32, KV length after this step's writes
    slot_mapping: torch.Tensor  # [T] int64, where each query token's K/V is written
    block_table: torch.Tensor  # [R, max_pages] int32, page ids per request
    cu_num_tokens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    # False: every query sees all seq_lens[r] keys of its request (the drafter's block attends
    # to itself both ways); True: causal within the request, as above
    causal: bool = True

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.cu_num_tokens_cpu[-1]


def single_prefill_metadata(
    num_tokens: int, page_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    """One request prefilling `num_tokens` tokens into pages 1, 2, ... (page 0 is scratch).

    Used to measure a step's memory at start-up and by tests that run the model directly.
    """
    num_pages = -(-num_tokens // page_size)
    pages = list(range(1, num_pages + 1))
    slots = [pages[p // page_size] * page_size + p % page_size for p in range(num_tokens)]
    return AttentionMetadata(
        cu_num_tokens=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_table=torch.tensor([pages], dtype=torch.int32, device=device),
        cu_num_tokens_cpu=(0, num_tokens),
        seq_lens_cpu=(num_tokens,),
    )
