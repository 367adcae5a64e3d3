"""Fixed-K speculation end to end on the CPU: greedy output equals plain decoding exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark import LLM, SamplingParams
from tests.helpers import assert_matches_distribution
from tests.tiny_models import make_tiny_drafter

K = 4


@pytest.fixture(scope="module")
def vocab_drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter12"), taps=(0,))


@pytest.fixture(scope="module")
def llama_drafter(tiny_llama_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_llama_dir, tmp_path_factory.mktemp("drafter_llama"), taps=(0, 1))


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
    # the per-position and per-length counters add up to the totals (SpecDecoder.record)
    spec = spec_llm.engine.spec
    counts = spec.verify_len_counts
    assert sum(spec.accepted_per_position) == m["num_accepted_tokens"]
    per_position = spec.accepted_per_position.tolist()
    assert per_position == sorted(per_position, reverse=True)
    assert sum(v * n for v, n in enumerate(counts)) == m["num_draft_tokens"]
    assert sum(counts[1:]) == m["num_drafts"]
    e = spec_llm.engine
    assert e.allocator.num_free == e.allocator.num_usable
    if kv_pages == 8:
        assert e.scheduler.num_preemptions > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "temperature"])
def test_drafting_computes_only_the_slots_a_window_verifies(tiny_vocab_dir, vocab_drafter,
                                                            temperature):  # fmt: skip
    """K = 2 of a drafter block of 4: the backbone runs over the block, the LM head over two
    slots a row (the vocabulary logits of slots no window verifies are never made), its input
    contiguous, and the output equals plain decoding (greedy) or runs (sampled). (A
    non-contiguous [R, K, d] input, the block's first K slots as a view, makes F.linear
    broadcast the weight over the rows: a batched matmul reading the vocabulary weight once a
    row.)"""
    kw = dict(dtype="float32", device="cpu", num_kv_pages=128, max_num_seqs=8, max_model_len=64)
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=16, ignore_eos=True)
    llm = LLM(str(tiny_vocab_dir), speculative_config={"model": str(vocab_drafter),
              "num_speculative_tokens": 2}, **kw)  # fmt: skip
    spec = llm.engine.spec
    assert (spec.draft_len, spec.num_verify) == (4, 2)
    blocks = []  # the drafter's LM head inputs: [R, slots, d] (the target's are [T, d])
    hook = spec.drafter.target.lm_head.register_forward_hook(
        lambda module, args, out: blocks.append((tuple(args[0].shape), args[0].is_contiguous()))
        if args[0].dim() == 3 else None
    )  # fmt: skip
    got = _outputs(llm, PROMPTS12, params)
    hook.remove()
    assert blocks and all(shape[1] == 2 and contiguous for shape, contiguous in blocks), blocks
    assert llm.engine.get_metrics()["num_drafts"] > 0
    if temperature == 0:
        assert got == _outputs(LLM(str(tiny_vocab_dir), **kw), PROMPTS12, params)


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


def _exact_pair_distribution(model, prompt, temperature, top_p, first=2):
    """P(x_first, x_first+1) under the target with the same sampling transform, by
    enumerating the tokens before them (x1, or x1 and x2 when first is 3)."""
    from dspark.sample.sampler import SamplingTensors, sampling_probs
    from tests.helpers import full_logits

    def probs(ids):
        st = SamplingTensors(torch.tensor([temperature]), torch.tensor([12]), torch.tensor([top_p]),
                             torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                             False, False, top_p < 1.0)  # fmt: skip
        return sampling_probs(full_logits(model, ids).logits[-1:], st)[0]

    assert first in (2, 3), first
    prefixes = [(prompt, 1.0)]  # (the tokens so far, their probability)
    for _ in range(first - 2):  # the tokens before x1's pair partner, marginalized
        prefixes = [(ids + [x], w * float(q[x])) for ids, w in prefixes
                    for q in [probs(ids)] for x in range(12) if q[x] > 0]  # fmt: skip
    joint = torch.zeros(12, 12)
    for ids, w in prefixes:
        p1 = probs(ids)
        for x1 in range(12):
            if p1[x1] == 0:
                continue
            p2 = probs(ids + [x1])
            for x2 in range(12):
                if p2[x2] > 0:
                    joint[x2] += w * p1[x1] * p2[x2] * probs(ids + [x1, x2])
    return joint.reshape(-1)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_sampled_speculation_keeps_the_target_distribution(
    tiny_vocab_dir, vocab_drafter, temperature, top_p
):
    """Tokens 2 and 3 of 6,000 seeded requests: token 1 comes from the prefill, then one
    window of 1 draft (max_tokens 3) verifies token 2 and may emit token 3 as its bonus."""
    n, prompt = 6000, [2, 3, 4]
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=2048,
              speculative_config={"model": str(vocab_drafter)})  # fmt: skip
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=s, max_tokens=3,
                             ignore_eos=True) for s in range(n)]  # fmt: skip
    outs = _outputs(llm, [prompt] * n, params)
    assert llm.engine.get_metrics()["num_accepted_tokens"] > 0
    pairs = torch.tensor([o[1] * 12 + o[2] for o in outs])
    counts = torch.bincount(pairs, minlength=144).float()
    expected = _exact_pair_distribution(llm.engine.model, prompt, temperature, top_p) * n
    assert_matches_distribution(counts, expected)


def test_logprobs_with_speculation_equal_plain_logprobs(tiny_vocab_dir, vocab_drafter):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    kw = dict(dtype="float32", device="cpu", num_kv_pages=64)
    plain = LLM(str(tiny_vocab_dir), **kw).generate(PROMPTS12, params, use_tqdm=False)
    spec_llm = LLM(str(tiny_vocab_dir), speculative_config={"model": str(vocab_drafter)}, **kw)
    spec = spec_llm.generate(PROMPTS12, params, use_tqdm=False)
    assert spec_llm.engine.get_metrics()["num_accepted_tokens"] > 0
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t] == pytest.approx(lb[t], abs=1e-4)


def test_stops_inside_accepted_drafts_and_min_tokens(tiny_vocab_dir, vocab_drafter):
    """EOS can land inside a window: the request ends there, nothing after it is emitted."""
    kw = dict(dtype="float32", device="cpu", num_kv_pages=256)
    plain_llm = LLM(str(tiny_vocab_dir), **kw)
    spec_llm = LLM(str(tiny_vocab_dir), speculative_config={"model": str(vocab_drafter)}, **kw)
    eos = spec_llm.engine.eos_token_id
    for extra in ({}, {"min_tokens": 6}, {"stop_token_ids": [5]}):
        params = [SamplingParams(temperature=0, max_tokens=24, **extra)] * 4
        prompts = [[2, 3, 4], [7, 8], [11, 10, 9], [6]]
        plain = plain_llm.generate(prompts, params, use_tqdm=False)
        spec = spec_llm.generate(prompts, params, use_tqdm=False)
        for a, b in zip(plain, spec, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
            if "min_tokens" in extra:
                assert eos not in b.outputs[0].token_ids[:6]


def test_bench_reports_speculation_per_level(tiny_llama_dir, llama_drafter, tmp_path):
    import argparse
    import json

    from dspark.benchmarks.offline import add_bench_parser

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "spec.json"
    args = parser.parse_args(
        ["bench", "--model", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32",
         "--concurrency", "1,2", "--output-len", "6", "--max-prompt-len", "48",
         "--sources", "gsm8k,vicuna", "--no-plot", "--out", str(out),
         "--speculative-config", json.dumps({"model": str(llama_drafter)})]
    )  # fmt: skip
    assert args.func(args) == 0
    levels = json.loads(out.read_text())["dspark"]["levels"]
    for lv in levels:
        assert lv["output_tokens"] == 6 * lv["concurrency"]
        assert lv["speculation"]["num_drafts"] > 0


def test_cli_generate_with_speculation(tiny_llama_dir, llama_drafter, capsys):
    import json

    from dspark.cli import main

    rc = main(["generate", "Hello", "--model", str(tiny_llama_dir), "--device", "cpu",
               "--dtype", "float32", "--max-tokens", "6", "--kv-cache-memory-gb", "0.01",
               "--speculative-config", json.dumps({"model": str(llama_drafter)})])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0 and "speculation: mean acceptance length" in err


def test_the_steps_survivals_are_the_calibrated_confidences(tiny_vocab_dir, vocab_drafter):
    """A step's survivals come from the device (SpecStepOutput.survivals): every recorded
    window's equal the host's calibration of the raw confidences the observers get, and the
    raw confidences are copied only while an observer wants them."""
    from dspark.policy.survival import host_survivals

    spec_config = {"model": str(vocab_drafter), "num_speculative_tokens": K}
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=128,
              speculative_config=spec_config)  # fmt: skip
    spec = llm.engine.spec
    temperatures = {g: t.double().numpy() for g, t in spec.survival_temperatures.items()}
    record, seen = spec.record, []

    def recording(verify_len, num_accepted, confidence_logits=None, survivals=None):
        seen.append((confidence_logits, survivals))
        return record(verify_len, num_accepted, confidence_logits, survivals)

    spec.record = recording
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    _outputs(llm, PROMPTS12[:3], params)
    assert seen and all(c is None and s is not None for c, s in seen)  # (no observer)
    seen.clear()
    spec.observers.append(lambda *args: None)
    _outputs(llm, PROMPTS12[:3], params)
    assert seen
    for confidences, survivals in seen:
        expected = host_survivals(confidences, [True] * len(confidences), temperatures)
        np.testing.assert_allclose(survivals, expected, rtol=1e-5, atol=1e-6)
