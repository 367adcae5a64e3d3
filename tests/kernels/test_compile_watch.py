"""kernels/compile_watch.py: a step's Triton compiles are counted on the engine that stepped and
logged; compiles outside a step are not; hooks set before it still run."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

from dspark.kernels.compile_watch import CompileWatch

SPEC = "_gemv_kernel[num_warps=2, num_ctas=1, num_stages=3](x_ptr: *bf16, s_x: i32)"


def test_a_compile_in_a_step_counts_on_that_engine_and_is_logged(caplog):
    watch, stats = CompileWatch(), Counter()
    watch.before_compile(repr=SPEC)  # start-up: nobody steps
    watch.after_compile(repr=SPEC)
    assert not stats
    watch.stats = stats
    with caplog.at_level(logging.INFO, logger="dspark.kernels.compile_watch"):
        assert watch.before_compile(repr=SPEC) is False  # (False: Triton compiles it)
        watch.after_compile(repr=SPEC)
    assert stats["triton_compiles"] == 1 and stats["triton_compile_ms"] >= 0
    assert "_gemv_kernel[num_warps=2" in caplog.text and "x_ptr" not in caplog.text
    watch.after_compile(repr="a load without a compile before it")
    assert stats["triton_compiles"] == 1


def test_hooks_set_before_it_are_chained(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append("before"))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append("after"))
    watch = CompileWatch()
    assert watch.install() and watch.install()  # (once)
    assert knobs.runtime.jit_cache_hook == watch.before_compile
    watch.stats = Counter()
    assert knobs.runtime.jit_cache_hook(repr=SPEC) is False
    knobs.runtime.jit_post_compile_hook(repr=SPEC)
    assert calls == ["before", "after"] and watch.stats["triton_compiles"] == 1


@pytest.mark.gpu
def test_a_new_specialisation_in_a_step_is_counted_on_the_gpu(monkeypatch):
    """A real compile: the GEMV at a row count no earlier test launched is a new
    specialisation, compiled while `stats` is set."""
    from triton import knobs

    from dspark.kernels.gemv_triton import gemv

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    watch = CompileWatch()
    assert watch.install()
    watch.stats = Counter()
    x = torch.randn(7, 96, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(40, 96, device="cuda", dtype=torch.bfloat16)
    gemv(x, w)
    torch.cuda.synchronize()
    assert watch.stats["triton_compiles"] >= 1


def test_the_engine_counts_a_steps_compiles_on_its_runner(tiny_llm, monkeypatch):
    """engine.step hands the watch its runner's stats for the step, and takes them back."""
    from dspark import SamplingParams
    from dspark.kernels.compile_watch import WATCH

    engine, seen = tiny_llm.engine, []
    inner = engine._step
    monkeypatch.setattr(engine, "_step", lambda: seen.append(WATCH.stats) or inner())
    tiny_llm.generate(["Hi"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert seen and all(s is engine.runner.stats for s in seen)
    assert WATCH.stats is None
