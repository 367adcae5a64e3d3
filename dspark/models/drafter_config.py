"""A drafter checkpoint's description: its config (this engine's layout), the identity of the
target it was trained for, and the check that a loaded target is that one. Below both the
drafter network (dspark_drafter.py) and DeepSeek's layout (deepspec_format.py), which read it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# sharded checkpoints (HF's layout): {"metadata": {...}, "weight_map": {tensor name: shard file}}
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


class DrafterMismatchError(ValueError):
    """A drafter checkpoint was made for another target model."""


@dataclass(frozen=True)
class TargetIdentity:
    architecture: str
    vocab_size: int
    hidden_size: int
    weights_hash: str  # sha256 over the target's parameter names, shapes and a value sample


@dataclass(frozen=True)
class DrafterConfig:
    target: TargetIdentity
    draft_len: int = 7  # K: drafted slots per block
    target_layers: tuple[int, ...] = (1, 10, 19, 28)  # taps: decoder layers whose output is read
    num_layers: int = 2
    markov_rank: int = 64  # 0: a plain DFlash-style drafter (no Markov head)
    use_confidence: bool = True
    mask_token_id: int = -1  # unused: MASK is a trainable embedding; kept for the file format
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        d = dict(d)
        d["target"] = TargetIdentity(**d["target"])
        d["target_layers"] = tuple(d["target_layers"])
        return cls(**d)


def check_identity(expected: TargetIdentity, live: TargetIdentity) -> None:
    for name in ("architecture", "vocab_size", "hidden_size", "weights_hash"):
        want, got = getattr(expected, name), getattr(live, name)
        if want != got:
            raise DrafterMismatchError(
                f"this drafter was trained for another target: {name} is {want!r} in the drafter "
                f"checkpoint but {got!r} in the loaded target model"
            )


def read_drafter_config(directory: Path) -> dict:
    """A drafter directory's config.json: this engine's DrafterConfig, or DeepSpec's."""
    if not (directory / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{directory} is not a DSpark drafter (no {CONFIG_FILE})")
    return json.loads((directory / CONFIG_FILE).read_text())
