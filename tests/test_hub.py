"""Hub names ("org/name") resolve through huggingface_hub's cache, laid out on disk here exactly
as the client writes it, with HF_HUB_OFFLINE=1: the network is never touched."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dspark import LLM, SamplingParams
from dspark.models.hub import is_hub_name
from dspark.models.loader import resolve_model
from tests.tiny_models import make_tiny_llama

MAIN = "a" * 40
OTHER = "b" * 40


def lay_hub_cache(cache: Path, repo_id: str, revision: str, files_from: Path, main=True) -> Path:
    """models--org--name/snapshots/<revision>/<files> and refs/main -> revision, as
    huggingface_hub lays a downloaded snapshot out (blobs left out: snapshots may hold files)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    shutil.copytree(files_from, snapshot)
    if main:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # the client reads both when it is imported: set what it already read too
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_hub_names_are_told_from_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_name("Qwen/Qwen3-8B") and is_hub_name("deepseek-ai/dspark_qwen3_8b_block7")
    assert not is_hub_name("default") and not is_hub_name("./a/b") and not is_hub_name("/a/b")
    assert not is_hub_name("a/b/c")
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert not is_hub_name("org/local")  # an existing directory wins


def test_model_by_hub_name_equals_its_directory(tmp_path, offline_cache, smollm_hf_tokenizer):
    d = make_tiny_llama(tmp_path / "qwen3", smollm_hf_tokenizer, "qwen3")
    lay_hub_cache(offline_cache, "tiny-org/tiny-qwen3", MAIN, d)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = {}
    for name in (str(d), "tiny-org/tiny-qwen3"):
        llm = LLM(model=name, dtype="float32", device="cpu", num_kv_pages=32)
        got[name] = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got[str(d)] == got["tiny-org/tiny-qwen3"]


def test_revision_picks_its_snapshot(tmp_path, offline_cache, smollm_hf_tokenizer):
    d = make_tiny_llama(tmp_path / "m", smollm_hf_tokenizer, "qwen3")
    main = lay_hub_cache(offline_cache, "tiny-org/m", MAIN, d)
    other = lay_hub_cache(offline_cache, "tiny-org/m", OTHER, d, main=False)
    assert resolve_model("tiny-org/m").directory == main
    assert resolve_model("tiny-org/m", revision=OTHER).directory == other


def test_missing_repository_names_it(offline_cache):
    with pytest.raises(FileNotFoundError, match=r"'tiny-org/absent'.*HF_HUB_OFFLINE=1"):
        resolve_model("tiny-org/absent")
