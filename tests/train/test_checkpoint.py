"""The exported (shipped) drafter format: bf16 shards with an index, round trip, identity check."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dspark.models.drafter_config import WEIGHTS_INDEX_FILE, DrafterMismatchError
from dspark.models.dspark_drafter import DSparkDrafter
from dspark.models.llama import build_model
from dspark.models.model_config import ModelConfig
from dspark.train.export import export_drafter, shard_tensors
from dspark.train.trainer import TrainConfig, build_drafter
from tests.tiny_models import _llama_config, save_random_model

HASH = "0123456789abcdef"


def _target(tmp_path, vocab=96, seed=0):
    hf = _llama_config(vocab, hidden_size=32, intermediate_size=64)
    d = save_random_model(tmp_path / f"target{vocab}_{seed}", hf, seed=seed)
    config = ModelConfig.from_hf_dict(hf.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    return build_model(config, load_file(d / "model.safetensors"), torch.float32,
                       torch.device("cpu"))  # fmt: skip


def test_sharded_export_round_trip(tmp_path):
    target = _target(tmp_path)
    drafter = build_drafter(target, HASH, TrainConfig(draft_len=4, markov_rank=8))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p))  # so a dropped or swapped tensor would show
    files = export_drafter(drafter, tmp_path / "out", max_shard_bytes=20_000)
    shards = [f for f in files if f.name.startswith("model-")]
    assert len(shards) > 2 and all(f.stat().st_size <= 20_000 + 1_000 for f in shards)
    index = json.loads((tmp_path / "out" / WEIGHTS_INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(drafter.state_dict())
    loaded = DSparkDrafter.load(tmp_path / "out", target, HASH)
    for name, value in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value.to(torch.bfloat16).float())
    # a re-export with one shard replaces the shards (no stale file is read)
    export_drafter(drafter, tmp_path / "out")
    assert not (tmp_path / "out" / WEIGHTS_INDEX_FILE).exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "model.safetensors"]  # fmt: skip
    DSparkDrafter.load(tmp_path / "out", target, HASH)


def test_a_drafter_for_another_target_is_refused(tmp_path):
    target = _target(tmp_path)
    drafter = build_drafter(target, HASH, TrainConfig(draft_len=4, markov_rank=8))
    export_drafter(drafter, tmp_path / "d", max_shard_bytes=50_000)
    expected = "weights_hash is '0123456789abcdef' in the drafter checkpoint but 'ffffffffffffffff'"
    with pytest.raises(DrafterMismatchError, match=expected):
        DSparkDrafter.load(tmp_path / "d", target, "ffffffffffffffff")
    other_vocab = _target(tmp_path, vocab=120)
    expected = "vocab_size is 96 in the drafter checkpoint but 120 in the loaded target model"
    with pytest.raises(DrafterMismatchError, match=expected):
        DSparkDrafter.load(tmp_path / "d", other_vocab, HASH)


def test_shards_keep_tensors_whole():
    tensors = {"a": torch.zeros(10), "b": torch.zeros(30), "c": torch.zeros(5), "d": torch.zeros(1)}
    shards = shard_tensors(tensors, max_shard_bytes=4 * 30)
    assert [sorted(s) for s in shards] == [["a"], ["b"], ["c", "d"]]
    with pytest.raises(ValueError, match="more than a shard may hold"):
        shard_tensors({"big": torch.zeros(100)}, max_shard_bytes=100)


def test_default_taps_spread_over_depth():
    from dspark.train.trainer import default_taps

    assert default_taps(30) == (1, 10, 19, 28)  # docs/SPECULATION.md 2.1's example for SmolLM2
    assert default_taps(2) == (0, 1)
    assert default_taps(12) == (1, 4, 7, 10)


def test_training_can_start_from_a_saved_drafter(tmp_path):
    target = _target(tmp_path)
    first = build_drafter(target, HASH, TrainConfig(draft_len=4, markov_rank=8))
    with torch.no_grad():
        for p in first.parameters():
            p.add_(torch.randn_like(p))
    export_drafter(first, tmp_path / "d")
    again = build_drafter(target, HASH, TrainConfig(draft_len=4, markov_rank=8,
                                                    init_from=str(tmp_path / "d")))  # fmt: skip
    for name, value in first.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], value.to(torch.bfloat16).float())
    assert again.training and all(p.dtype == torch.float32 for p in again.parameters())
    with pytest.raises(ValueError, match="its markov_rank is 8, this run's is 16"):
        build_drafter(target, HASH, TrainConfig(draft_len=4, markov_rank=16,
                                                init_from=str(tmp_path / "d")))  # fmt: skip
