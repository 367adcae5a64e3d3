"""Dropping an LLM frees its tensors at once: `shutdown()`, leaving `with LLM(...)`, or `del`
leave no reference (and no reference cycle) holding the model's weights or the KV cache, so a
second engine in the same process finds the memory free without a gc.collect()."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from dspark import LLM, SamplingParams
from tests.tiny_models import make_tiny_drafter


@pytest.fixture
def no_collector():
    """The cyclic collector off: what is freed is freed by reference counting alone."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if was_enabled:
        gc.enable()


def _engine_refs(llm: LLM) -> list[weakref.ref]:
    engine = llm.engine
    params = list(engine.runner.model.parameters())
    refs = [weakref.ref(p) for p in params[:3]] + [weakref.ref(engine.runner.model)]
    return refs + [weakref.ref(engine), weakref.ref(engine.runner)]


def _used(llm: LLM) -> None:
    out = llm.generate(["Hello there", "The quick brown"], SamplingParams(max_tokens=4),
                       use_tqdm=False)  # fmt: skip
    assert all(o.outputs[0].token_ids for o in out)


def _build(model_dir, speculative_config: dict | None = None) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", num_kv_pages=64,
               max_model_len=128, speculative_config=speculative_config)  # fmt: skip


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_del_frees_the_engines_tensors_without_the_collector(
    tiny_llama_dir, tmp_path, no_collector, speculative
):
    spec = None
    if speculative:
        drafter = make_tiny_drafter(tiny_llama_dir, tmp_path / "drafter", (0, 1))
        spec = {"method": "dspark", "model": str(drafter), "num_speculative_tokens": 4}
    llm = _build(tiny_llama_dir, spec)
    _used(llm)
    refs = _engine_refs(llm)
    del llm
    alive = [r() for r in refs if r() is not None]
    assert not alive, [type(a).__name__ for a in alive]


def test_shutdown_frees_the_tensors_and_refuses_later_use(tiny_llama_dir, no_collector):
    llm = _build(tiny_llama_dir)
    _used(llm)
    refs = _engine_refs(llm)
    llm.shutdown()
    assert all(r() is None for r in refs)
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("Hi", use_tqdm=False)


def test_leaving_the_with_block_frees_the_tensors(tiny_llama_dir, no_collector):
    with _build(tiny_llama_dir) as llm:
        _used(llm)
        refs = _engine_refs(llm)
    assert all(r() is None for r in refs)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["shutdown", "del"])
def test_dropping_an_llm_returns_its_gpu_memory(tiny_llama_dir, no_collector, caplog, how):
    """With CUDA graphs captured (decode and mixed): `del` alone frees it (no reference cycle),
    and shutdown() finds nothing left for the collector (no warning)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    llm = LLM(str(tiny_llama_dir), device="cuda", max_model_len=128, kv_cache_memory_gb=0.5)
    _used(llm)
    assert torch.cuda.memory_allocated() > before
    if how == "shutdown":
        llm.shutdown()
    else:
        del llm
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert "outlived its engine" not in caplog.text
