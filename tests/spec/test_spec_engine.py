"""Fixed-K speculation end to end on the CPU: greedy output equals plain decoding exactly."""

from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.models.dspark_drafter import DrafterConfig, DSparkDrafter, target_identity
from dspark.models.llama import build_model
from dspark.models.loader import checkpoint_hash, load_checkpoint, resolve_model

K = 4


def _make_drafter(target_dir, out_dir, taps, seed=0):
    source = resolve_model(str(target_dir))
    config, weights = load_checkpoint(source)
    target = build_model(config, weights, torch.float32, torch.device("cpu"))
    h = checkpoint_hash(source)
    torch.manual_seed(seed)
    cfg = DrafterConfig(target_identity(target, h), draft_len=K, target_layers=taps, num_layers=2,
                        markov_rank=8)  # fmt: skip
    drafter = DSparkDrafter(cfg, target, h)
    with torch.no_grad():
        drafter.mask_embedding.normal_()
    drafter.save(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def vocab_drafter(tiny_vocab_dir, tmp_path_factory):
    return _make_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter12"), taps=(0,))


@pytest.fixture(scope="module")
def llama_drafter(tiny_llama_dir, tmp_path_factory):
    return _make_drafter(tiny_llama_dir, tmp_path_factory.mktemp("drafter_llama"), taps=(0, 1))


def _outputs(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


PROMPTS12 = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 2, 3, 4, 5], [9], [4, 4, 4, 4, 4, 4, 4], [3, 5]]


@pytest.mark.parametrize("kv_pages,budget", [(128, 64), (8, 16)])  # the second preempts
def test_greedy_speculation_equals_plain_decoding(tiny_vocab_dir, vocab_drafter, kv_pages, budget):
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, use_speculation=(i != 3))
        for i, n in enumerate([20, 13, 31, 17, 9])
    ]
    kw = dict(dtype="float32", device="cpu", num_kv_pages=kv_pages, max_num_batched_tokens=budget,
              max_num_seqs=8, max_model_len=64)  # fmt: skip
    plain = _outputs(LLM(str(tiny_vocab_dir), **kw), PROMPTS12, params)
    spec_llm = LLM(str(tiny_vocab_dir), speculative_config={"model": str(vocab_drafter),
                   "num_speculative_tokens": K}, **kw)  # fmt: skip
    assert _outputs(spec_llm, PROMPTS12, params) == plain
    m = spec_llm.engine.get_metrics()
    assert m["num_drafts"] > 0 and m["num_accepted_tokens"] > 0, m
    assert m["mean_acceptance_length"] > 1.0
    e = spec_llm.engine
    assert e.allocator.num_free == e.allocator.num_usable
    if kv_pages == 8:
        assert e.scheduler.num_preemptions > 0


def test_greedy_speculation_on_a_large_vocabulary(tiny_llama_dir, llama_drafter):
    prompts = ["Hello there", "The quick brown fox jumps over the lazy dog", "1 2 3"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", num_kv_pages=64)
    plain = _outputs(LLM(str(tiny_llama_dir), **kw), prompts, params)
    spec_llm = LLM(str(tiny_llama_dir), speculative_config={"model": str(llama_drafter)}, **kw)
    assert _outputs(spec_llm, prompts, params) == plain
    assert spec_llm.engine.get_metrics()["num_drafts"] > 0


def test_speculative_config_errors(tiny_vocab_dir, vocab_drafter, tiny_llama_dir):
    kw = dict(dtype="float32", device="cpu", num_kv_pages=16)
    with pytest.raises(ValueError, match="unknown speculative method 'eagle'"):
        LLM(str(tiny_vocab_dir), speculative_config={"method": "eagle", "model": "x"}, **kw)
    with pytest.raises(ValueError, match="num_speculative_tokens 9 exceeds the drafter's"):
        LLM(str(tiny_vocab_dir), speculative_config={"model": str(vocab_drafter),
            "num_speculative_tokens": 9}, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="trained for another target"):
        LLM(str(tiny_llama_dir), speculative_config={"model": str(vocab_drafter)}, **kw)
