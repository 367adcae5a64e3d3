"""On the GPU with the default model in float32: greedy speculative output (the shipped drafter,
the drafting policy, CUDA graphs, steps launched ahead) equals plain decoding on 64 held-out
prompts. Needs CUDA and the default model."""

from __future__ import annotations

import gc

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.benchmarks.prompts import default_prompts_dir, load_prompts
from dspark.models.loader import resolve_model
from dspark.models.tokenizer import load_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
NUM_PROMPTS = 64


def _greedy(speculative_config: dict | None, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(dtype="float32", max_num_seqs=NUM_PROMPTS, speculative_config=speculative_config)
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    metrics = llm.get_metrics() if speculative_config else {}
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    if speculative_config:
        assert metrics["num_accepted_tokens"] > 0, metrics  # the drafter did draft
    return tokens


def test_greedy_speculation_equals_plain_decoding_on_held_out_prompts():
    conversations = load_prompts(default_prompts_dir(), split="eval")[:NUM_PROMPTS]
    tokenizer = load_tokenizer(resolve_model("default"))
    prompts = [tokenizer.apply_chat_template(c) for c in conversations]
    plain = _greedy(None, prompts)
    spec = _greedy({"method": "dspark"}, prompts)
    differing = [i for i, (a, b) in enumerate(zip(plain, spec, strict=True)) if a != b]
    assert not differing, f"{len(differing)} of {NUM_PROMPTS} prompts differ: {differing}"
