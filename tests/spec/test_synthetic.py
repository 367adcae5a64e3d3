"""Synthetic acceptance (spec/synthetic.py), a benchmark mode: drafts kept by a profile's
conditional rates, drawn per (seed, position); the confidences calibrated to the same profile;
refused wherever a user gets text; every result marked."""

from __future__ import annotations

import json

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.cli import main as cli_main
from dspark.config import EngineConfig
from dspark.engine.engine import LLMEngine
from dspark.policy.survival import survival
from dspark.server.cli import read_config_file
from dspark.spec.synthetic import (
    PROFILES,
    SyntheticAcceptance,
    synthetic_confidence_logits,
    synthetic_verify,
)
from tests.tiny_models import make_tiny_drafter

K = 3


def _windows(rates, num_rows: int, verify_len: int = K, seed: int = 0):
    """num_rows full windows of K drafts, request r seeded r, anchors at 10; the target's argmax
    at window token t is t % 5 (a recognisable final token)."""
    synthetic = SyntheticAcceptance(tuple(rates), seed)
    window = verify_len + 1
    logits = torch.zeros(num_rows * window, 8)
    logits[torch.arange(num_rows * window), torch.arange(num_rows * window) % 5] = 1.0
    drafts = torch.full((num_rows, K), 7, dtype=torch.int64)
    lengths = torch.full((num_rows,), verify_len, dtype=torch.int64)
    cu = torch.arange(num_rows + 1, dtype=torch.int64) * window
    rates_ = synthetic.device_rates(K, torch.device("cpu"))
    anchors = torch.full((num_rows,), 10)
    out = synthetic_verify(
        rates_, seed, logits, drafts, lengths, cu, torch.arange(num_rows), anchors
    )
    return out, cu


def test_all_ones_keep_every_draft_and_all_zeros_none():
    out, cu = _windows([1.0], 50)
    assert out.num_accepted.tolist() == [K] * 50
    # all kept: the drafts, then the target's argmax after the last (window token K)
    assert out.tokens[0].tolist() == [7, 7, 7, int(cu[0] + K) % 5]
    out, cu = _windows([0.0], 50)
    assert out.num_accepted.tolist() == [0] * 50
    assert out.tokens[:, 0].tolist() == [int(c) % 5 for c in cu[:-1]]
    # never past verify_len
    out, _ = _windows([1.0], 10, verify_len=2)
    assert out.num_accepted.tolist() == [2] * 10


def test_the_mean_acceptance_length_matches_the_profile():
    """Over 20,000 seeded windows the mean tokens per window is within 0.03 of the profile's
    tau (its standard error is about 0.007), and each position's survival within 0.02."""
    rates = (0.8, 0.5, 0.9)
    out, _ = _windows(rates, 20_000)
    synthetic = SyntheticAcceptance(rates)
    assert synthetic.expected_tau(K) == pytest.approx(1 + 0.8 + 0.4 + 0.36)
    tau = 1 + out.num_accepted.double().mean().item()
    assert tau == pytest.approx(synthetic.expected_tau(K), abs=0.03)
    for k, s in enumerate(synthetic.survival(K)):
        assert (out.num_accepted > k).double().mean().item() == pytest.approx(s, abs=0.02)
    # seeded: the same windows again give the same draws, another profile seed others
    again, _ = _windows(rates, 20_000)
    assert torch.equal(again.num_accepted, out.num_accepted)
    other, _ = _windows(rates, 20_000, seed=1)
    assert not torch.equal(other.num_accepted, out.num_accepted)


def test_confidences_are_calibrated_to_the_profile():
    synthetic = SyntheticAcceptance((0.9, 0.5, 1.0))
    temps = torch.tensor([[1.0, 1.0, 1.0], [0.7, 1.3, 2.0]])  # [R, K] a row's STS fit
    logits = synthetic_confidence_logits(synthetic.unit_logits(K, torch.device("cpu")), temps)
    expected = torch.tensor(synthetic.survival(K)).expand(2, K)
    assert torch.allclose(survival(logits, temps), expected, atol=1e-5)


def test_named_profiles_have_the_papers_and_the_shipped_drafters_tau():
    def tau(name: str) -> float:
        return SyntheticAcceptance.parse(name).expected_tau(7)

    assert tau("qwen3-8b-gsm8k") == pytest.approx(6.2, abs=0.05)
    assert tau("qwen3-8b-mtbench") == pytest.approx(3.7, abs=0.05)
    # docs/DRAFTER.md: tau 3.53 greedy on the gsm8k slice
    assert tau("smollm2") == pytest.approx(3.55, abs=0.05)
    assert SyntheticAcceptance.parse("0.9,0.5").rates_for(4) == [0.9, 0.5, 0.5, 0.5]
    for bad in ("fast", "0.9,1.5", "", "0.9,x"):
        with pytest.raises(ValueError, match="comma-separated conditional rates in"):
            SyntheticAcceptance.parse(bad)
    assert set(PROFILES) == {"qwen3-8b-gsm8k", "qwen3-8b-mtbench", "smollm2"}


@pytest.fixture(scope="module")
def drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter_syn"), taps=(0,))


KW = dict(dtype="float32", device="cpu", num_kv_pages=256, max_num_seqs=4, max_model_len=256)


def _engine(tiny_vocab_dir, drafter, profile: str) -> LLM:
    spec = {"model": str(drafter), "num_speculative_tokens": K}
    config = EngineConfig(model=str(tiny_vocab_dir), speculative_config=spec, **KW)
    return LLM.from_engine(LLMEngine(config, synthetic=SyntheticAcceptance.parse(profile)))


@pytest.mark.parametrize("profile, mean_length", [("1.0", K + 1), ("0.0", 1)])
def test_the_engine_keeps_drafts_by_the_profile(tiny_vocab_dir, drafter, profile, mean_length):
    llm = _engine(tiny_vocab_dir, drafter, profile)
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    out = llm.generate([[2, 3, 4], [5, 6, 7, 8]], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [33, 33]
    metrics = llm.get_metrics()
    assert metrics["num_drafts"] > 0
    # (1.0: every window but a request's last, shortened near max_tokens, keeps all K)
    assert metrics["mean_acceptance_length"] == pytest.approx(mean_length, abs=0.35)
    assert metrics["synthetic"]["rates"] == [float(profile)] * K


def test_the_mode_is_refused_wherever_a_user_gets_text(tiny_vocab_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="synthetic_acceptance is a benchmark mode"):
        LLM(str(tiny_vocab_dir), synthetic_acceptance="smollm2", **KW)
    config = tmp_path / "serve.yaml"
    config.write_text("model: default\nsynthetic_acceptance: smollm2\n")
    with pytest.raises(ValueError, match="LLM, dspark generate and dspark serve refuse it"):
        read_config_file(config)
    for command in (["generate", "hi"], ["serve"]):
        with pytest.raises(SystemExit) as exit_:
            cli_main([*command, "--synthetic-acceptance", "smollm2"])
        assert exit_.value.code == 2
        assert "unrecognized arguments: --synthetic-acceptance" in capsys.readouterr().err


def test_bench_results_say_synthetic(tmp_path):
    from dspark.benchmarks.offline_config import BenchConfig
    from dspark.benchmarks.offline_sweep import metadata
    from dspark.benchmarks.report import synthetic_banner

    config = BenchConfig(model="default", synthetic_acceptance="qwen3-8b-mtbench")
    record = metadata(config, torch.device("cpu"), torch.float32, "dspark bench", {})
    assert record["synthetic"]["profile"] == "qwen3-8b-mtbench"
    assert record["synthetic"]["expected_tau_by_k"]["7"] == pytest.approx(3.72, abs=0.01)
    assert record["synthetic"]["expected_tau_by_k"]["1"] == pytest.approx(1.83)
    json.dumps(record)
    assert synthetic_banner(record).startswith("SYNTHETIC acceptance qwen3-8b-mtbench")
    assert metadata(BenchConfig(model="default"), torch.device("cpu"), torch.float32, "", {})[
        "synthetic"] is None  # fmt: skip
    with pytest.raises(ValueError, match="comma-separated conditional rates"):
        BenchConfig(synthetic_acceptance="1.2")


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_captured_steps_keep_drafts_by_the_profile(tiny_vocab_dir, drafter, temperature):
    """On the GPU the draws run inside the captured speculative steps (no eager fallback), and
    over many windows the mean acceptance length is the profile's tau within 0.15."""
    spec = {"model": str(drafter), "num_speculative_tokens": K}
    kw = dict(KW, device="cuda", max_num_seqs=8, max_model_len=256)
    synthetic = SyntheticAcceptance((0.8, 0.5, 0.9))
    llm = LLM.from_engine(LLMEngine(EngineConfig(model=str(tiny_vocab_dir),
                                                 speculative_config=spec, **kw),
                                    synthetic=synthetic))  # fmt: skip
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=150, ignore_eos=True)
              for i in range(8)]  # fmt: skip
    llm.generate([[2 + i, 3, 4] for i in range(8)], params, use_tqdm=False)
    metrics = llm.get_metrics()
    assert metrics["steps"]["spec_graph_steps"] > 0 and not metrics["fallbacks"], metrics
    tau = metrics["mean_acceptance_length"]
    assert tau == pytest.approx(synthetic.expected_tau(K), abs=0.15)
    # the confidences the host reads are the profile's survival
    windows = metrics.get("num_survival_windows", 0)
    if windows:
        predicted = [p / windows for p in metrics["predicted_survival_per_pos"]]
        assert predicted == pytest.approx(synthetic.survival(K), abs=1e-3)


def test_a_profile_under_synthetic_acceptance_says_so(tiny_vocab_dir, drafter, tmp_path,
                                                      monkeypatch):  # fmt: skip
    import dspark.policy.cost_table as cost_table

    monkeypatch.setattr(cost_table, "flatness_reason", lambda table: None)  # (a tiny model)
    out = tmp_path / "table.json"
    rc = cli_main(["profile", "--model", str(tiny_vocab_dir), "--device", "cpu", "--dtype",
                   "float32", "--max-model-len", "256", "--max-num-seqs", "2", "--batch", "1,2",
                   "--steps", "5", "--warmup", "1", "--rounds", "1", "--greedy-only",
                   "--synthetic-acceptance", "smollm2", "--out", str(out), "--speculative-config",
                   json.dumps({"model": str(drafter), "num_speculative_tokens": K})])  # fmt: skip
    assert rc == 0
    measured = json.loads(out.read_text())["measured"]
    assert measured["synthetic"]["profile"] == "smollm2"
    assert measured["synthetic"]["rates"] == [0.77, 0.78, 0.74]
