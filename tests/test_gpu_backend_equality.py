"""The GPU fast path (Triton kernels, CUDA graphs, asynchronous scheduling) against the PyTorch
reference backend run eagerly on the same GPU: the default model's greedy fp32 tokens are equal
at batch 1, 3 and 16 (batches of several prompt lengths, so that graph padding and ragged
attention are exercised on the real shapes)."""

from __future__ import annotations

import pytest

from dspark import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

COMMON = dict(dtype="float32", device="cuda", max_model_len=1024, kv_cache_memory_gb=2.0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def _prompts(batch: int) -> list[list[int]]:
    return [[100 + 37 * i + j for j in range(5 + 11 * i)] for i in range(batch)]


def test_fast_path_equals_reference_backend_on_the_default_model():
    fast = LLM("default", **COMMON)
    ref = LLM(
        "default",
        attention_backend="torch",
        use_cuda_graphs=False,
        async_scheduling=False,
        **COMMON,
    )
    for batch in (1, 3, 16):
        prompts = [{"prompt_token_ids": p} for p in _prompts(batch)]
        got = [o.outputs[0].token_ids for o in fast.generate(prompts, GREEDY, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == want, f"batch {batch}"
    assert fast.engine.runner.stats["graph_steps"] > 0
