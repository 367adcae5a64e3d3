"""The sweep's prompt ids: chat-rendered, truncated keeping their tail, cycled to a level's count.
prompts.py loads the conversations they come from."""

from __future__ import annotations

from pathlib import Path

from dspark.benchmarks.offline_config import BenchConfig
from dspark.benchmarks.prompts import default_prompts_dir
from dspark.models.tokenizer import Tokenizer

# Truncation keeps a prompt's last tokens: the end of the user turn and the assistant header
# the chat template writes there must survive, or the model would continue the user's text.
TRUNCATION_TAIL = 16


def truncate(ids: list[int], max_len: int) -> list[int]:
    """Keep the head and the last TRUNCATION_TAIL tokens (see TRUNCATION_TAIL)."""
    if len(ids) <= max_len:
        return ids
    tail = min(TRUNCATION_TAIL, max_len // 2)
    return ids[: max_len - tail] + ids[len(ids) - tail :]


def render(tokenizer: Tokenizer, conversations: list[list[dict]], max_len: int) -> list[list[int]]:
    return [truncate(tokenizer.apply_chat_template(c), max_len) for c in conversations]


def cycle(items: list, count: int) -> list:
    """items[0:count], wrapping around when count exceeds len(items)."""
    return [items[i % len(items)] for i in range(count)]


def resolve_prompts_dir(config: BenchConfig) -> Path:
    """The user's --prompts-dir, else the prompt files this package ships."""
    return config.prompts_dir or default_prompts_dir()
