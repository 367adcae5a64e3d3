"""Megatron-style tensor-parallel layers: each rank holds a slice of a weight.

A decoder layer costs two all-reduces and no other communication:

    x [T, d] (same on every rank)
      qkv_proj    column-parallel: this rank's heads     [T, (nh + 2 nkv) hd / tp]   (Linear)
      attention   per head, so per rank
      o_proj      row-parallel: partial sums             [T, d]  -> all-reduce
      gate_up     column-parallel: this rank's I / tp    [T, 2 I / tp]                (Linear)
      down_proj   row-parallel                           [T, d]  -> all-reduce

A column-parallel projection is a plain Linear with fewer output rows (models/sharding.py cuts
the checkpoint), so only the row-parallel side and the vocabulary need classes of their own.
The vocabulary is cut into equal shards of ceil(V / tp) rows, the last padded with zero rows:

    V = 10, tp = 2, shard 5:   rank 0 rows 0..4, rank 1 rows 5..9
    V = 9,  tp = 2, shard 5:   rank 1 rows 5..8 and one zero row (its logit cut after gather)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.distributed.parallel_state import TensorParallel
from dspark.layers.linear import Linear


def vocab_shard_size(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size)


class RowParallelLinear(Linear):
    """Input features split across ranks; the partial products summed by one all-reduce."""

    def __init__(
        self, in_features: int, out_features: int, use_triton: bool, tp: TensorParallel
    ) -> None:
        super().__init__(in_features, out_features, False, use_triton)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        return self.tp.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; a token outside them looks up zeros, and the
    all-reduce leaves each token the one row its owner found."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.shard = vocab_shard_size(vocab_size, tp.size)
        self.start = tp.rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden_size))
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, d]
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, d]
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Module):
    """This rank's vocabulary rows of the head; the logits gathered, so every rank samples from
    the same full [N, V] (and so draws the same tokens with the same uniforms)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_shard_size(vocab_size, tp.size), hidden_size))
        self.tp = tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [N, d] -> [N, V]
        return self.tp.all_gather_last(F.linear(h, self.weight))[..., : self.vocab_size]
