"""Prompt sources, the stable held-out split, chat rendering, and the refusal of held-out data."""

from __future__ import annotations

import json

import pytest

from dspark.models.loader import resolve_model
from dspark.models.tokenizer import load_tokenizer
from dspark.train.data import (
    REGENERATE_DONE_FILE,
    Record,
    SplitConfig,
    answer_seed,
    held_out_texts,
    load_file_prompts,
    make_prompts,
    prompt_key,
    shard_path,
    split_of,
    user_turn_prefix,
    write_prompts,
    write_shard,
)
from dspark.train.dataset import load_sequences


def test_split_is_a_pure_function_of_the_text():
    texts = [f"question {i}" for i in range(4000)]
    config = SplitConfig(eval_fraction=0.1, calib_fraction=0.05)
    prompts = make_prompts("gsm8k", texts, config)
    assert make_prompts("gsm8k", list(reversed(texts)) + texts[:10], config) == prompts
    counts = {s: sum(p.split == s for p in prompts) for s in ("train", "calib", "eval")}
    assert abs(counts["eval"] - 400) < 60 and abs(counts["calib"] - 200) < 45, counts
    # the key's leading 32 bits decide: 0x19999999 / 2^32 < 0.1 <= 0x1a000000 / 2^32
    assert split_of("1999999900000000", config) == "eval"
    assert split_of("1a00000000000000", config) == "calib"
    assert split_of("2700000000000000", config) == "train"
    assert prompt_key("abc") == "ba7816bf8f01cfea"  # sha256("abc")
    with pytest.raises(ValueError, match="must leave a train split"):
        SplitConfig(eval_fraction=0.6, calib_fraction=0.4)


def test_file_sources_and_held_out_slices():
    from dspark.benchmarks.prompts import default_prompts_dir

    prompts = load_file_prompts(default_prompts_dir(), SplitConfig())
    sources = {p.source for p in prompts}
    assert sources == {"gsm8k", "vicuna", "alpaca", "humaneval"}
    assert len({p.key for p in prompts}) == len(prompts)
    held = held_out_texts(prompts, "eval")
    assert set(held) == sources  # every source has an eval slice
    n_vicuna = sum(p.source == "vicuna" for p in prompts)
    assert 0 < len(held["vicuna"]) < n_vicuna // 4
    train = {p.text for p in prompts if p.split == "train"}
    assert not train & {t for rows in held.values() for t in rows}


def test_user_turn_prefix_and_seeds(tiny_llama_dir):
    tok = load_tokenizer(resolve_model(str(tiny_llama_dir)))  # SmolLM2's tokenizer and template
    prefix = tok.decode(user_turn_prefix(tok), skip_special_tokens=False)
    assert prefix.endswith("<|im_start|>user\n") and prefix.startswith("<|im_start|>system\n")
    assert answer_seed(0, "gsm8k", "ab", 1) == answer_seed(0, "gsm8k", "ab", 1)
    assert answer_seed(0, "gsm8k", "ab", 1) != answer_seed(0, "gsm8k", "ab", 2)
    assert 0 <= answer_seed(7, "self", "", 0) < 2**60


def _data_dir(tmp_path, record_key_split: str):
    config = SplitConfig(eval_fraction=0.5, calib_fraction=0.0)
    prompts = make_prompts("gsm8k", [f"q{i}" for i in range(20)], config)
    p = next(p for p in prompts if p.split == record_key_split)
    tmp_path.mkdir()
    write_prompts(tmp_path, prompts)
    write_shard(shard_path(tmp_path, 0), [
        Record("gsm8k", p.key, 0, 1, [1, 2, 3], [4, 5, 6], "stop"),
        Record("gsm8k", p.key, 1, 2, [1, 2, 3], [4], "stop"),  # one response token: no anchor
    ])  # fmt: skip
    return tmp_path


def test_training_refuses_held_out_prompts_and_unfinished_data(tmp_path):
    train_dir = _data_dir(tmp_path / "train", "train")
    with pytest.raises(FileNotFoundError, match="regenerate stage has not finished"):
        load_sequences(train_dir, 64)
    (train_dir / REGENERATE_DONE_FILE).write_text(json.dumps({}))
    seqs, per_source = load_sequences(train_dir, 64)
    assert [s.token_ids for s in seqs] == [[1, 2, 3, 4, 5, 6]] and seqs[0].response_start == 3
    assert per_source == {"gsm8k": 1}
    eval_dir = _data_dir(tmp_path / "eval", "eval")
    (eval_dir / REGENERATE_DONE_FILE).write_text(json.dumps({}))
    with pytest.raises(ValueError, match="held-out prompts are never trained on"):
        load_sequences(eval_dir, 64)
