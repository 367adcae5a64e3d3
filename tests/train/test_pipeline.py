"""The whole pipeline on the tiny model (CPU): regenerate -> train -> calibrate -> evaluate, the
DFlash ablation on the same data, resumability and the `dspark train` / `dspark calibrate` CLI."""

from __future__ import annotations

import json

import pytest

from dspark import LLM, SamplingParams
from dspark.cli import main
from dspark.spec.calibration import load_calibration
from dspark.train.data import (
    REGENERATE_DONE_FILE,
    SplitConfig,
    read_jsonl,
    read_prompts,
    shard_path,
)
from dspark.train.evaluate import EvalConfig
from dspark.train.pipeline import EVAL_FILE, LOG_FILE, PipelineConfig, run_pipeline
from dspark.train.regenerate import RegenerateConfig
from dspark.train.rollouts import record_confidences
from dspark.train.trainer import TrainConfig

K = 7
COUNTS = {"gsm8k": 4, "vicuna": 2, "alpaca": 2, "humaneval": 2, "self": 3}


def _prompts_dir(root):
    import itertools

    from dspark.benchmarks.prompts import default_prompts_dir, read_source_rows

    src, dst = default_prompts_dir(), root / "prompts"
    dst.mkdir()
    for name, n in [("gsm8k_train", 12), ("vicuna_bench_questions", 8), ("alpaca_seed_tasks", 8)]:
        rows = itertools.islice(read_source_rows(src / f"{name}.jsonl"), n)
        lines = [json.dumps(row) for row in rows]
        (dst / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return dst


def _config(tiny_llama_dir, root, work, markov_rank=16, data_dir=None):
    return PipelineConfig(
        work_dir=root / work, data_dir=data_dir, target=str(tiny_llama_dir),
        prompts_dir=root / "prompts", device="cpu", dtype="float32",
        engine={"num_kv_pages": 400, "max_num_seqs": 16},
        regenerate=RegenerateConfig(counts=COUNTS, max_tokens=20, self_max_tokens=10,
                                    self_require_stop=False, max_prompt_tokens=200, shard_size=4,
                                    split=SplitConfig(0.3, 0.3)),
        train=TrainConfig(draft_len=K, markov_rank=markov_rank, batch_size=2, anchors_per_seq=4,
                          total_steps=3, warmup_steps=1, max_seq_len=256),
        calib_prompts_per_source=2, calib_max_tokens=20,
        eval=EvalConfig(max_tokens=16, prompts_per_source=1), progress=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    _prompts_dir(root)
    config = _config(tiny_llama_dir, root, "dspark")
    assert run_pipeline(config)
    return config


def test_regenerate_writes_train_answers_only(run):
    data = run.data
    prompts = {p.key: p for p in read_prompts(data)}
    assert {p.source for p in prompts.values()} == {"gsm8k", "vicuna", "alpaca", "humaneval",
                                                     "self"}  # fmt: skip
    # one answer per self-written train prompt (of the 3 sampled turns), the counts otherwise
    num_self = sum(p.source == "self" and p.split == "train" for p in prompts.values())
    expected = {**COUNTS, "self": num_self}
    total = sum(expected.values())
    records = [r for i in range(-(-total // 4)) for r in read_jsonl(shard_path(data, i))]
    assert len(records) == total and not shard_path(data, -(-total // 4)).exists()
    assert all(prompts[r["key"]].split == "train" for r in records)
    assert {s: sum(r["source"] == s for r in records) for s in COUNTS} == expected
    assert len({r["seed"] for r in records}) == len(records)
    assert all(1 <= len(r["output_ids"]) <= 20 for r in records)
    assert json.loads((data / REGENERATE_DONE_FILE).read_text())["num_answers"] == total


def test_a_repeated_shard_is_identical(run):
    """Resume after an interruption: a missing shard is regenerated, token for token."""
    data = run.data
    before = shard_path(data, 1).read_text()
    shard_path(data, 1).unlink()
    (data / REGENERATE_DONE_FILE).unlink()
    assert run_pipeline(run, ("regenerate",))
    assert shard_path(data, 1).read_text() == before


def test_train_calibrate_evaluate_outputs(run):
    drafter = run.drafter_dir
    assert json.loads((drafter / "config.json").read_text())["markov_rank"] == 16
    assert json.loads((run.work_dir / "train" / "train.json").read_text())["steps"] == 3
    cal = json.loads((drafter / "calibration.json").read_text())
    assert cal["method"] == "sts" and len(cal["temperatures"]) == K and cal["num_blocks"] > 0
    greedy = cal["greedy"]  # fitted on greedy rollouts of the same prompts
    assert greedy["sampling_temperature"] == 0.0 and greedy["num_blocks"] > 0
    assert load_calibration(drafter, K, greedy=True) == greedy["temperatures"]
    results = json.loads((run.work_dir / EVAL_FILE).read_text())
    for temp in ("T=0", "T=1"):
        per_source = results[temp]
        sources = [s for s in per_source if s not in ("macro_tau", "ece")]
        assert set(sources) <= set(COUNTS) and len(sources) >= 3
        for s in sources:
            acc = per_source[s]
            assert acc["num_drafts"] > 0 and 1.0 <= acc["tau"] <= 1 + K
            assert len(acc["acceptance_per_pos"]) == K
            assert acc["tau"] == pytest.approx(1 + acc["num_accepted_tokens"] / acc["num_drafts"])
        assert per_source["ece"]["num_blocks"] > 0 and len(per_source["ece"]["calibrated"]) == K
    log = json.loads((run.work_dir / LOG_FILE).read_text())
    assert {r["stage"] for r in log["runs"] if r["completed"]} == {
        "regenerate", "train", "calibrate", "evaluate"}  # fmt: skip
    assert set(log["seconds_per_stage"]) == {"regenerate", "train", "calibrate", "evaluate"}
    # everything is complete: a rerun does nothing (and logs no stage run)
    n = len(log["runs"])
    assert run_pipeline(run)
    assert len(json.loads((run.work_dir / LOG_FILE).read_text())["runs"]) == n


def test_dflash_ablation_on_the_same_data(run, tiny_llama_dir, capsys):
    ablation = _config(tiny_llama_dir, run.work_dir.parent, "dflash", markov_rank=0,
                       data_dir=run.data)  # fmt: skip
    ablation = PipelineConfig(**{**ablation.__dict__, "baseline_work_dir": run.work_dir,
                                 "eval": EvalConfig(temperatures=(0.0,), max_tokens=16,
                                                    prompts_per_source=1)})  # fmt: skip
    assert run_pipeline(ablation, ("regenerate", "train", "calibrate", "evaluate"))
    config = json.loads((ablation.drafter_dir / "config.json").read_text())
    assert config["markov_rank"] == 0 and not config["use_confidence"]
    assert not (ablation.drafter_dir / "calibration.json").exists()  # nothing to calibrate
    results = json.loads((ablation.work_dir / EVAL_FILE).read_text())
    assert "ece" not in results["T=0"] and results["T=0"]["macro_tau"] >= 1.0
    assert "tau: this run vs baseline" in capsys.readouterr().out


def test_recorded_labels_pair_with_the_engines_counters(run, tiny_llama_dir):
    spec = {"model": str(run.drafter_dir)}
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_pages=200,
              use_cuda_graphs=False, speculative_config=spec)  # fmt: skip
    params = SamplingParams(temperature=1.0, max_tokens=30, seed=3, ignore_eos=True)
    with record_confidences(llm) as recorder:
        llm.generate(["Hello there", "1 2 3 4", "Tell me a story"], params, use_tqdm=False)
    logits, labels = recorder.blocks()
    m = llm.get_metrics()
    assert logits.shape[0] + recorder.num_censored == m["num_drafts"]
    assert recorder.num_censored > 0  # windows near max_tokens are shortened and dropped
    assert (labels[:, 1:] <= labels[:, :-1]).all()  # prefix labels never rise
    # per position, the full-block rows' accepted counts are part of the engine's
    per_pos = labels.sum(dim=0)
    assert all(per_pos[k] <= m["num_accepted_tokens_per_pos"][k] for k in range(K))
    llm.generate(["after the recorder"], params, use_tqdm=False)  # detached: nothing recorded
    assert recorder.blocks()[0].shape == logits.shape


def test_cli_calibrate_and_train_arguments(run, tiny_llama_dir, capsys):
    rc = main(["calibrate", "--drafter", str(run.drafter_dir), "--target", str(tiny_llama_dir),
               "--data-dir", str(run.data), "--device", "cpu", "--dtype", "float32",
               "--prompts-per-source", "1", "--max-tokens", "16", "--kv-cache-memory-gb", "0.02",
               "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "ECE before" in out and "calibration.json" in out
    assert "greedy (rollouts at temperature 0)" in out
    rc = main(["train", "--work-dir", str(run.work_dir), "--stage", "regenerate", "--redo"])
    assert rc == 2 and "--redo applies to --stage calibrate or evaluate" in capsys.readouterr().err
    from dspark.cli import build_parser
    from dspark.train.cli import pipeline_config

    args = build_parser().parse_args(["train", "--work-dir", "w", "--markov-rank", "0",
                                      "--num-gsm8k", "10", "--taps", "1,5", "--total-steps",
                                      "40", "--eval-temperatures", "0,0.7"])  # fmt: skip
    cfg = pipeline_config(args)
    assert cfg.train.markov_rank == 0 and not cfg.train.use_confidence
    assert cfg.train.target_layers == (1, 5) and cfg.train.total_steps == 40
    assert cfg.regenerate.counts["gsm8k"] == 10 and cfg.eval.temperatures == (0.0, 0.7)
    assert str(cfg.data) == "w/data" and cfg.max_minutes == 9.0


def test_a_missing_prompt_source_is_an_error_before_generating(tiny_llama_dir, tmp_path):
    config = _config(tiny_llama_dir, tmp_path, "w")  # tmp_path has no prompts directory
    with pytest.raises(FileNotFoundError, match=r"no prompts for source\(s\) \['gsm8k', "):
        run_pipeline(config, ("regenerate",))
    assert not (config.data / "self_prompts.jsonl").exists()


def test_training_a_drafter_for_a_qwen3_target(tmp_path, smollm_hf_tokenizer):
    """regenerate -> train -> calibrate -> evaluate for a tiny Qwen3 target (q/k norm in the
    drafter's training forward too); the drafter it writes serves losslessly."""
    from tests.tiny_models import make_tiny_llama

    target = make_tiny_llama(tmp_path / "qwen3", smollm_hf_tokenizer, "qwen3")
    _prompts_dir(tmp_path)
    config = _config(target, tmp_path, "qwen3_run")
    assert run_pipeline(config)
    drafter = config.drafter_dir
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kwargs = dict(dtype="float32", device="cpu", num_kv_pages=64)
    plain = LLM(model=str(target), **kwargs).generate([[5, 6, 7, 8]], params, use_tqdm=False)
    spec = {"model": str(drafter), "num_speculative_tokens": 3}
    got = LLM(model=str(target), speculative_config=spec, **kwargs).generate(
        [[5, 6, 7, 8]], params, use_tqdm=False
    )
    assert got[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
