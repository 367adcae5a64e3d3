"""Writing a trained drafter in its shipped form: config.json and bf16 safetensors shards.

The repository ships the SmolLM2 drafter (about 15M parameters, 29 MB in bf16), and a file in
it may hold at most 15 MiB, so the weights go into shards in HF's layout, read back by
DSparkDrafter.load:

  model-00001-of-00002.safetensors, model-00002-of-00002.safetensors
  model.safetensors.index.json   {"metadata": {"total_size": bytes}, "weight_map": {name: file}}

Tensors are assigned in name order, a new shard starting when the next tensor would overflow
max_shard_bytes (a single tensor larger than that is refused: it cannot be shipped).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark.models.drafter_config import CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE
from dspark.models.dspark_drafter import DSparkDrafter

MAX_SHARD_BYTES = 15 * 2**20


def shard_tensors(
    tensors: dict[str, torch.Tensor], max_shard_bytes: int
) -> list[dict[str, torch.Tensor]]:
    """Split in name order into groups of at most max_shard_bytes each."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if nbytes > max_shard_bytes:
            raise ValueError(f"tensor {name} has {nbytes} bytes, more than a shard may hold")
        if size + nbytes > max_shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def export_drafter(
    drafter: DSparkDrafter,
    directory: Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[Path]:
    """Write config.json and the weight shards (plus their index); returns the files written."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    for stale in [*directory.glob("model*.safetensors"), directory / WEIGHTS_INDEX_FILE]:
        stale.unlink(missing_ok=True)  # a previous export with another shard count
    (directory / CONFIG_FILE).write_text(json.dumps(drafter.config.to_dict(), indent=1))
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in drafter.state_dict().items()}
    shards = shard_tensors(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, directory / WEIGHTS_FILE)
        return [directory / CONFIG_FILE, directory / WEIGHTS_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, directory / name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / WEIGHTS_INDEX_FILE).write_text(json.dumps(index, indent=1))
    return [
        directory / CONFIG_FILE,
        directory / WEIGHTS_INDEX_FILE,
        *(directory / n for n in names),
    ]
