"""Which slice of each weight a tensor-parallel rank holds (layers/parallel_linear.py).

A rank's model is built from its shard's config: the same model with nh / tp query heads,
max(1, nkv / tp) KV heads and I / tp intermediate rows, so its Attention, MLP, KV cache and
page sizes follow without knowing about ranks. Fewer KV heads than ranks: each KV head is
replicated on tp / nkv consecutive ranks, which is where its query heads went.

    nh 8, nkv 2, tp 4:  rank r has q heads 2r, 2r+1 and kv head r // 2
      q head j uses kv head j // (nh / nkv) = j // 4:   heads 0..3 -> 0, 4..7 -> 1   (same)

Checkpoint tensors are cut here, one at a time as they stream in, before load_weights copies
them (the model never holds the whole weight).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from dspark.layers.parallel_linear import vocab_shard_size
from dspark.models.model_config import ModelConfig


def allowed_tp_sizes(config: ModelConfig) -> list[int]:
    """Sizes that split the heads, the KV heads (or replicate them) and the MLP evenly."""
    return [n for n in range(1, config.num_heads + 1) if _divides(config, n)]


def _divides(config: ModelConfig, n: int) -> bool:
    nkv = config.num_kv_heads
    kv_ok = nkv % n == 0 if nkv >= n else n % nkv == 0
    return config.num_heads % n == 0 and kv_ok and config.intermediate_size % n == 0


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    if not _divides(config, tp_size):
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not split {config.architecture}'s "
            f"{config.num_heads} attention heads, {config.num_kv_heads} KV heads and "
            f"{config.intermediate_size} MLP rows evenly; allowed: {allowed_tp_sizes(config)}"
        )


def shard_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The config of one rank's shard (tp_size 1: `config` itself)."""
    check_tp_size(config, tp_size)
    if tp_size == 1:
        return config
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // tp_size,
        num_kv_heads=max(1, config.num_kv_heads // tp_size),
        intermediate_size=config.intermediate_size // tp_size,
    )


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, rank: int, tp_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's slice) for HF-named or fused-named (name, full tensor) pairs."""
    for name, w in weights:
        yield name, shard_tensor(name, w, config, rank, tp_size)


def shard_tensor(
    name: str, w: torch.Tensor, config: ModelConfig, rank: int, tp_size: int
) -> torch.Tensor:
    parts = name.split(".")
    proj = parts[-2] if len(parts) >= 2 else ""
    hd = config.head_dim
    if proj == "q_proj":
        return _rows(w, config.num_heads * hd // tp_size, rank)
    if proj in ("k_proj", "v_proj"):
        return _kv_rows(w, config, rank, tp_size)
    if proj == "qkv_proj":  # fused [q; k; v] (a drafter's state dict)
        q, k, v = w.split([config.q_size, config.kv_size, config.kv_size])
        return torch.cat([_rows(q, q.shape[0] // tp_size, rank),
                          _kv_rows(k, config, rank, tp_size),
                          _kv_rows(v, config, rank, tp_size)])  # fmt: skip
    if proj in ("gate_proj", "up_proj"):
        return _rows(w, config.intermediate_size // tp_size, rank)
    if proj == "gate_up_proj":  # fused [gate; up]
        gate, up = w.chunk(2)
        return torch.cat([_rows(gate, gate.shape[0] // tp_size, rank),
                          _rows(up, up.shape[0] // tp_size, rank)])  # fmt: skip
    if proj in ("o_proj", "down_proj"):  # row-parallel: a slice of the input columns
        n = w.shape[1] // tp_size
        return w[:, rank * n : (rank + 1) * n]
    if proj in ("embed_tokens", "lm_head"):
        return _vocab_rows(w, vocab_shard_size(config.vocab_size, tp_size), rank)
    return w  # norms, the rest of a drafter: replicated


def _rows(w: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    return w[rank * n : (rank + 1) * n]


def _kv_rows(w: torch.Tensor, config: ModelConfig, rank: int, tp_size: int) -> torch.Tensor:
    nkv, hd = config.num_kv_heads, config.head_dim
    if nkv >= tp_size:
        return _rows(w, nkv // tp_size * hd, rank)
    return _rows(w, hd, rank // (tp_size // nkv))  # replicated on tp / nkv ranks


def _vocab_rows(w: torch.Tensor, shard: int, rank: int) -> torch.Tensor:
    rows = w[rank * shard : (rank + 1) * shard]
    if rows.shape[0] == shard:
        return rows
    return torch.cat([rows, rows.new_zeros(shard - rows.shape[0], *rows.shape[1:])])
