"""The drafter shipped for the default target: its files, its default loading, its calibration."""

from __future__ import annotations

import json
import logging

import pytest

from dspark import LLM, SamplingParams
from dspark.drafters import SHIPPED, shipped_drafter
from dspark.models.drafter_config import DrafterConfig
from dspark.models.loader import ModelSource, checkpoint_hash
from dspark.policy.cost_table import COST_TABLES_DIR, parse_table
from dspark.spec.calibration import load_calibration
from dspark.train.export import MAX_SHARD_BYTES
from tests.tiny_models import make_tiny_drafter


@pytest.mark.parametrize("weights_hash", sorted(SHIPPED))
def test_shipped_files(weights_hash):
    """Each shipped drafter names the weights it is registered for, fits the repository's size
    limits (shards <= 15 MiB, <= 30 MB in all) and carries a valid STS calibration."""
    directory = shipped_drafter(weights_hash)
    config = DrafterConfig.from_dict(json.loads((directory / "config.json").read_text()))
    assert config.target.weights_hash == weights_hash
    shards = sorted(directory.glob("*.safetensors"))
    assert shards and all(f.stat().st_size <= MAX_SHARD_BYTES for f in shards)
    assert sum(f.stat().st_size for f in directory.iterdir()) <= 30e6
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    temps = load_calibration(directory, config.draft_len)
    assert temps is not None and len(temps) == config.draft_len
    greedy = load_calibration(directory, config.draft_len, greedy=True)
    assert greedy is not None and len(greedy) == config.draft_len
    # shipped cost tables describe these weights: retraining the drafter means re-profiling
    for path in sorted((directory / COST_TABLES_DIR).glob("*.json")):
        table = parse_table(path.read_text())
        assert table.fingerprint["target_hash"] == weights_hash, path
        assert table.fingerprint["drafter_hash"] == checkpoint_hash(ModelSource(directory)), path
        assert table.fingerprint["draft_len"] == config.draft_len, path


def test_no_shipped_drafter_for_another_target(tiny_vocab_dir):
    assert shipped_drafter("0000000000000000") is None
    with pytest.raises(ValueError, match='no "model" and no drafter ships for'):
        LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=16,
            speculative_config={"method": "dspark"})  # fmt: skip
    with pytest.raises(ValueError, match='"model" must be a drafter directory, got 3'):
        LLM(str(tiny_vocab_dir), speculative_config={"method": "dspark", "model": 3})


def test_uncalibrated_drafter_is_logged(tiny_vocab_dir, tmp_path, caplog):
    """A drafter without calibration.json runs with T = 1 and says so."""
    drafter = make_tiny_drafter(tiny_vocab_dir, tmp_path / "d", taps=(0,))
    with caplog.at_level(logging.WARNING, logger="dspark.engine.spec_setup"):
        llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=16,
                  speculative_config={"model": str(drafter)})  # fmt: skip
    assert "its confidences are used uncalibrated" in caplog.text
    assert not llm.engine.spec.calibrated
    assert llm.engine.spec.confidence_temperatures.tolist() == [1.0] * llm.engine.spec.draft_len


@pytest.mark.slow
def test_default_target_takes_the_shipped_drafter():
    """{"method": "dspark"} on the default model loads the shipped drafter with its STS
    temperatures, drafts tokens the target accepts, and keeps greedy output unchanged."""
    kw = dict(dtype="float32", device="cpu", max_num_seqs=4)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = LLM(speculative_config={"method": "dspark"}, **kw)
    assert spec.engine.spec.calibrated
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert spec.get_metrics()["num_accepted_tokens"] > 0
    del spec
    plain = LLM(**kw)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == want
