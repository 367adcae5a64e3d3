"""Checkpoint loading: GGUF tensor types against transformers, HF dirs, and broken files."""

from __future__ import annotations

import json
import logging
import shutil

import gguf
import pytest
import torch

from dspark.models import file_cache, gguf_file
from dspark.models.gguf_file import INDEX_VERSION, CheckpointError
from dspark.models.llama import build_model
from dspark.models.loader import load_checkpoint, resolve_model
from dspark.models.model_config import UnsupportedModelError
from tests.gguf_writer import write_llama_gguf
from tests.helpers import full_logits

Q = gguf.GGMLQuantizationType
IDS = [5, 6, 7, 8, 100, 3, 9]


def _ours(path) -> torch.nn.Module:
    config, weights = load_checkpoint(resolve_model(str(path)))
    return build_model(config, weights, torch.float32, torch.device("cpu"))


def test_f32_gguf_equals_the_hf_checkpoint_it_came_from(tiny_dir):
    # also proves the q/k row permutation of llama.cpp is undone exactly
    d, config, weights = tiny_dir
    path = write_llama_gguf(d / "f32.gguf", config, weights, Q.F32)
    got = full_logits(_ours(path), IDS).logits
    want = full_logits(_ours(d), IDS).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_gguf_matches_transformers(tiny_dir, qtype):
    from transformers import AutoModelForCausalLM

    d, config, weights = tiny_dir
    path = write_llama_gguf(d / f"{qtype.name}.gguf", config, weights, qtype)
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(full_logits(_ours(path), IDS).logits, want, atol=1e-4, rtol=1e-4)


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="no/such/model"):
        resolve_model("no/such/model")


def test_truncated_and_corrupt_gguf(tmp_path, tiny_dir):
    d, config, weights = tiny_dir
    good = write_llama_gguf(d / "q8.gguf", config, weights, Q.Q8_0).read_bytes()
    for name, data in [
        ("trunc.gguf", good[: len(good) // 2]),
        ("tiny.gguf", good[:100]),
        ("garbage.gguf", b"not a gguf file at all"),
    ]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(CheckpointError, match=name):
            load_checkpoint(resolve_model(str(tmp_path / name)))


def test_the_gguf_index_is_cached_and_rebuilt_when_unreadable(tmp_path, tiny_dir, monkeypatch,
                                                               caplog):  # fmt: skip
    d, config, weights = tiny_dir
    monkeypatch.setattr(file_cache, "CACHE_ROOT", tmp_path / "cache")
    path = write_llama_gguf(tmp_path / "q8.gguf", config, weights, Q.Q8_0)
    want_config, want = load_checkpoint(resolve_model(str(path)))
    (cached,) = (tmp_path / "cache" / "gguf").iterdir()
    assert json.loads(cached.read_text())["fields"]["llama.block_count"] == config.num_hidden_layers

    def parse(*args, **kwargs):
        raise AssertionError("the index was parsed again")

    def same(got):
        assert got[0] == want_config and got[1].keys() == want.keys()
        assert all(torch.equal(got[1][k], want[k]) for k in want)

    with monkeypatch.context() as m:  # the second load reads the cached index
        m.setattr(gguf_file, "scan_gguf", parse)
        same(load_checkpoint(resolve_model(str(path))))
    for bad in ("{ not json", json.dumps({"version": 0, "fields": {}, "tensors": []})):
        cached.write_text(bad)
        with caplog.at_level(logging.WARNING, logger="dspark.models.gguf_file"):
            same(load_checkpoint(resolve_model(str(path))))
        assert f"GGUF index cache {cached} is unreadable" in caplog.text
        assert json.loads(cached.read_text())["version"] == INDEX_VERSION  # rebuilt
        caplog.clear()


def test_corrupt_safetensors_and_bad_config(tmp_path, tiny_dir):
    d, _, _ = tiny_dir
    bad = tmp_path / "bad"
    shutil.copytree(d, bad, ignore=shutil.ignore_patterns("*.gguf"))
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(resolve_model(str(bad)))
    (bad / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(resolve_model(str(bad)))


def test_unsupported_architecture(tmp_path, tiny_dir):
    d, config, weights = tiny_dir
    other = tmp_path / "gpt2"
    shutil.copytree(d, other, ignore=shutil.ignore_patterns("*.gguf"))
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_checkpoint(resolve_model(str(other)))
    path = write_llama_gguf(tmp_path / "falcon.gguf", config, weights, Q.F32, arch="falcon")
    with pytest.raises(UnsupportedModelError, match="falcon"):
        load_checkpoint(resolve_model(str(path)))


@pytest.mark.slow
def test_default_model_config(default_gguf):
    config, _ = load_checkpoint(resolve_model("default"))
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.rope_theta == 100000.0 and config.eos_token_ids == (2,)


def _sharded_bf16(tmp_path, tokenizer, max_shard_size: str):
    """A tiny Qwen3 saved as bf16 in shards of at most `max_shard_size`, with an index file."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import make_tiny_llama

    d = make_tiny_llama(tmp_path / "f32", tokenizer, "qwen3", tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    out = tmp_path / "bf16"
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return out


def test_sharded_bf16_loads_shard_by_shard_without_float32_copies(tmp_path, smollm_hf_tokenizer):
    """Each tensor goes from its shard into its bf16 parameter: no float32 tensor bigger than
    the rotary frequencies is ever created, and no tensor (safetensors' byte views of a
    shard's storage included) bigger than the largest parameter.
    The shards give the same model as one file."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dspark.models.safetensors_weights import SafetensorsWeights

    sharded = _sharded_bf16(tmp_path, smollm_hf_tokenizer, "100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    config, weights = load_checkpoint(resolve_model(str(sharded)))
    assert isinstance(weights, SafetensorsWeights)
    created: list[tuple[torch.dtype, int, str]] = []  # (dtype, bytes, op)

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    created.append((t.dtype, t.numel() * t.element_size(), str(func)))
            return out

    with Allocations():
        model = build_model(config, weights, torch.bfloat16, torch.device("cpu"))
    largest = max(p.numel() * p.element_size() for p in model.parameters())  # bytes
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert max(n for dtype, n, _ in created if dtype == torch.float32) <= 4 * config.head_dim // 2
    assert max(n for _, n, _ in created) <= largest, sorted(created, key=lambda c: -c[1])[:3]
    single = tmp_path / "single"
    shutil.copytree(sharded, single, ignore=shutil.ignore_patterns("*.safetensors*"))
    from safetensors.torch import save_file

    save_file(dict(weights.items()), single / "model.safetensors")
    one = build_model(*load_checkpoint(resolve_model(str(single))), torch.bfloat16,
                      torch.device("cpu"))  # fmt: skip
    assert torch.equal(full_logits(model, IDS).logits, full_logits(one, IDS).logits)


def test_missing_fused_part_is_named(tmp_path, smollm_hf_tokenizer):
    from safetensors.torch import load_file, save_file

    d = _sharded_bf16(tmp_path, smollm_hf_tokenizer, "100MB")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    config, weights = load_checkpoint(resolve_model(str(d)))
    with pytest.raises(ValueError, match=r"missing tensors: \['layers.1.self_attn.qkv_proj"):
        build_model(config, weights, torch.bfloat16, torch.device("cpu"))
