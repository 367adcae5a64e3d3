"""Training sequences from the regenerated shards, and a resumable batch order.

Only train-split prompts are used, checked against prompts.jsonl (a held-out prompt in a shard
is a bug, not a data choice). A sequence is prompt + response cut to max_seq_len; one without two
response tokens has no anchor and is dropped.

Batch order: the sequences of step s are a pure function of (seed, s), so a resumed run sees
exactly the batches an uninterrupted one would. Sample g = s * B + j is sequence
perm_e[g mod N] of epoch e = g // N, where perm_e is a seeded permutation:

  N = 5, B = 2:  step 0 -> perm_0[0, 1]   step 2 -> perm_0[4], perm_1[0]
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch

from dspark.train.anchors import Sequence
from dspark.train.data import iter_records, read_prompts

logger = logging.getLogger(__name__)


def load_sequences(data_dir: Path, max_seq_len: int) -> tuple[list[Sequence], Counter[str]]:
    """Train sequences and the number kept per source."""
    split = {p.key: p.split for p in read_prompts(data_dir)}
    seqs: list[Sequence] = []
    per_source: Counter[str] = Counter()
    for r in iter_records(data_dir):
        if split.get(r.key) != "train":
            raise ValueError(
                f"shard answer to prompt {r.key} ({r.source}) is not a train prompt "
                f"(split {split.get(r.key)!r}): held-out prompts are never trained on"
            )
        ids = (r.prompt_ids + r.output_ids)[:max_seq_len]
        if len(ids) - len(r.prompt_ids) < 2:
            continue
        seqs.append(Sequence(ids, len(r.prompt_ids)))
        per_source[r.source] += 1
    if not seqs:
        raise ValueError(f"no training sequences in {data_dir} (max_seq_len {max_seq_len})")
    return seqs, per_source


class BatchOrder:
    def __init__(self, num_sequences: int, batch_size: int, seed: int) -> None:
        self.num_sequences = num_sequences
        self.batch_size = batch_size
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perms = {epoch: torch.randperm(self.num_sequences, generator=g).tolist()}
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        """Sequence indices of a step's batch (worked example in the module docstring)."""
        n = self.num_sequences
        out = []
        for g in range(step * self.batch_size, (step + 1) * self.batch_size):
            out.append(self._perm(g // n)[g % n])
        return out

    def epoch(self, step: int) -> float:
        return step * self.batch_size / self.num_sequences
