"""A Hugging Face directory's safetensors shards, read one tensor at a time, shard by shard.

The engine never holds the checkpoint in host memory: `items()` opens one shard (memory-mapped),
yields its tensors in their stored dtype (bf16 for the released checkpoints), and closes it
before the next, so each tensor goes straight into its parameter on the device, already in the
target dtype (models/llama.py's build_model). Host memory stays near one tensor above the
process's base; the page cache holds what was read. Opening every shard's header up front
catches a truncated or corrupt file before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.models.gguf_file import CheckpointError


def _open(path: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """Tensor name -> tensor over the shards `files`, each tensor read when asked for."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self._shard_of: dict[str, Path] = {}
        for f in files:
            with _open(f) as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if name in self._shard_of:
                        raise CheckpointError(
                            f"tensor {name!r} is in {self._shard_of[name]} and {f}"
                        )
                    self._shard_of[name] = f
        self.nbytes = sum(f.stat().st_size for f in files)

    def __getitem__(self, name: str) -> torch.Tensor:
        with _open(self._shard_of[name]) as shard:
            return shard.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shard_of)

    def __len__(self) -> int:
        return len(self._shard_of)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        """(name, tensor) shard by shard, with a progress bar in bytes on a terminal."""
        with tqdm(total=self.nbytes, unit="B", unit_scale=True, desc="loading weights",
                  disable=None) as bar:  # fmt: skip
            for f in self.files:
                with _open(f) as shard:
                    for name in shard.keys():  # noqa: SIM118
                        tensor = shard.get_tensor(name)
                        yield name, tensor
                        bar.update(tensor.numel() * tensor.element_size())
