"""Checkpoints named on the Hugging Face Hub ("org/name"), fetched through `huggingface_hub`.

Only what the engine reads is downloaded: the configs, the tokenizer files and the safetensors
weights (a repository's PyTorch .bin or GGUF copies are skipped). The hub client's own settings
apply unchanged: its cache (HF_HOME, HF_HUB_CACHE), HF_HUB_OFFLINE=1 (the cache only, no
network) and HF_TOKEN for gated repositories.
"""

from __future__ import annotations

import re
from pathlib import Path

# the files a target or a drafter needs; a pattern matching nothing is fine
HUB_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "*.calibration.json",
    "calibration.json",
)

# "org/name" as the Hub spells a repository: one slash, no path-like prefix
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_name(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not Path(name).expanduser().exists()


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of `repo_id` at `revision` (default: main), downloading
    what the cache lacks. Raises FileNotFoundError naming the repository when it cannot be had
    (offline and not cached, no such repository or revision, gated without a token)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_PATTERNS))
    except (OSError, HFValidationError, ValueError) as e:  # the hub's errors derive from these
        at = f" at revision {revision!r}" if revision else ""
        raise FileNotFoundError(
            f"model {repo_id!r}{at} could not be had from the Hugging Face Hub or its local "
            f"cache ({type(e).__name__}: {e}); with HF_HUB_OFFLINE=1 only the cache is read, "
            "a gated repository needs HF_TOKEN"
        ) from e
    return Path(path)
