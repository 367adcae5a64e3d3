"""Penalties, min_p, logit_bias and bad words: each transform on a hand-computed case, the
parameters' validation, and the engine's next-token distribution with them (no speculation;
tests/spec/test_spec_sampling_params.py has the speculative half)."""

from __future__ import annotations

import math

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.request import Request
from dspark.sample.logits_shaping import (
    LogitsShaping,
    apply_min_p,
    apply_penalties,
    apply_shaping,
    apply_window_shaping,
    banned_by_bad_words,
    build_shaping,
    window_draft_counts,
    window_shaping_index,
)
from tests.helpers import assert_matches_distribution, assert_same_logprobs, full_logits

VOCAB = 12  # the tiny word-level model's


def test_penalties_on_the_docstring_example():
    """logits [2, -1, 0.5, 1], prompt {1}, outputs [0, 0, 3], repetition 2, frequency 0.5,
    presence 0.25 -> [-0.25, -2, 0.5, -0.25] (sample/logits_shaping.py)."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    prompt = torch.tensor([[False, True, False, False]])
    counts = torch.tensor([[2.0, 0.0, 0.0, 1.0]])
    out = apply_penalties(logits, prompt, counts, torch.tensor([0.25]), torch.tensor([0.5]),
                          torch.tensor([2.0]))  # fmt: skip
    assert out.tolist() == [[-0.25, -2.0, 0.5, -0.25]]

    # each penalty alone
    def one(presence: float, frequency: float, repetition: float) -> list[float]:
        args = (torch.tensor([presence]), torch.tensor([frequency]), torch.tensor([repetition]))
        return apply_penalties(logits, prompt, counts, *args)[0].tolist()

    assert one(0.0, 0.0, 2.0) == [1.0, -2.0, 0.5, 0.5]  # prompt and outputs: tokens 0, 1, 3
    assert one(0.0, 0.5, 1.0) == [1.0, -1.0, 0.5, 0.5]  # minus 0.5 x count
    assert one(0.25, 0.0, 1.0) == [1.75, -1.0, 0.5, 0.75]  # minus 0.25 once present
    assert one(-1.0, 0.0, 1.0) == [3.0, -1.0, 0.5, 2.0]  # a negative penalty encourages


def test_min_p_drops_tokens_below_a_share_of_the_most_likely():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs.log(), torch.tensor([0.4]))  # threshold 0.4 x 0.5 = 0.2
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    assert torch.equal(apply_min_p(probs.log(), torch.tensor([0.0])), probs.log())
    # min_p 1 keeps only the most likely token (and ties with it)
    assert torch.isfinite(apply_min_p(probs.log(), torch.tensor([1.0]))).sum() == 1


def test_bad_words_ban_the_last_token_after_the_others():
    words = [[7], [3, 4, 5]]
    assert banned_by_bad_words(words, [1, 3, 4]) == [7, 5]
    assert banned_by_bad_words(words, [3]) == [7]
    assert banned_by_bad_words(words, []) == [7]
    assert banned_by_bad_words(words, [4, 3, 4, 9]) == [7]


def _request(prompt, outputs, **params) -> Request:
    sp = SamplingParams(**params)
    req = Request("r", list(prompt), sp, seed=0, eos_token_id=None, arrival_time=0.0)
    req.token_ids = list(prompt) + list(outputs)
    return req


def test_shaping_of_a_row_from_its_tokens_bias_and_bans():
    """logit_bias adds, a bad word bans, counts are outputs before `end` only; the tensors hold
    the shaping row alone (step row 1), and the other row's logits pass untouched."""
    req = _request([5, 6], [9, 9, 4], frequency_penalty=1.0, logit_bias={2: 3.0, 9: -1.5})
    req.bad_words_token_ids = [[9, 11], [8]]
    plain = _request([1], [2], temperature=0.5)  # a row in the same step that shapes nothing
    s = build_shaping([plain, req], [2, 4], VOCAB, torch.device("cpu"))
    assert s.rows.tolist() == [1] and s.output_counts.shape == s.bias.shape == (1, VOCAB)
    assert s.output_counts[0, 9] == 2 and s.output_counts[0].sum() == 2  # [9, 9]; 4 not yet
    assert s.prompt_mask[0].nonzero().flatten().tolist() == [5, 6]
    assert s.bias[0, 2] == 3.0 and s.bias[0, 9] == -1.5
    assert s.bias[0, 11] == -math.inf and s.bias[0, 8] == -math.inf  # outputs end in 9
    assert s.min_p is None
    logits = torch.zeros(2, VOCAB)
    logits[0, 3] = -0.0  # (x + 0 would make it +0.0: untouched keeps the sign bit)
    out = apply_shaping(logits, s)
    assert out[1, 9] == -1.5 - 2.0 and out[1, 2] == 3.0
    assert out[0].eq(0).all() and out[0].signbit().tolist() == logits[0].signbit().tolist()
    assert not logits.any(), "apply_shaping makes a new tensor"


def test_min_p_alone_is_every_rows_float_and_no_shaping_row():
    rows = [_request([1], [], min_p=0.2), _request([1], [], presence_penalty=0.5)]
    s = build_shaping(rows, [1, 1], VOCAB, torch.device("cpu"))
    assert s.rows.tolist() == [1] and s.min_p.tolist() == pytest.approx([0.2, 0.0])
    s = build_shaping(rows[:1], [1], VOCAB, torch.device("cpu"))
    assert s.rows.numel() == 0 and s.bias.shape == (0, VOCAB)
    logits = torch.randn(1, VOCAB)
    assert torch.equal(apply_shaping(logits, s), logits)


def test_window_tokens_count_the_drafts_before_them():
    """drafts [[4, 4, 2]], offsets [0, 1, 2, 3]: token 4 counted [0, 1, 2, 2],
    token 2 [0, 0, 0, 1]."""
    drafts = torch.tensor([[4, 4, 2]])
    counts = window_draft_counts(drafts, torch.zeros(4, dtype=torch.int64), torch.arange(4), 6)
    assert counts[:, 4].tolist() == [0, 1, 2, 2] and counts[:, 2].tolist() == [0, 0, 0, 1]
    assert counts.sum(1).tolist() == [0, 1, 2, 3]


def test_window_shaping_index_on_the_docstring_example():
    """cu [0, 3, 4, 6], shaping windows [0, 2], W 3: tokens [0, 1, 2, 4, 5] and the spare (6)
    for window 2's slot past its two tokens."""
    cu = torch.tensor([0, 3, 4, 6])
    index, owner, offset = window_shaping_index(torch.tensor([0, 2]), cu, 3, spare=6)
    assert index.tolist() == [0, 1, 2, 4, 5, 6]
    assert owner.tolist() == [0, 0, 0, 1, 1, 1] and offset.tolist() == [0, 1, 2, 0, 1, 2]


def test_window_shaping_shapes_the_shaping_windows_tokens_only():
    """Windows of 3, 1 and 2 tokens (K = 2), windows 0 and 2 shaping: each of their tokens j is
    shaped as one row with its outputs and drafts 1..j, bit for bit; window 1's token and the
    pad token after the windows are the logits as given."""
    windows = [  # (prompt, outputs, shaping) of each
        ([1], [3, 3], dict(presence_penalty=0.5, logit_bias={4: 1.0})),
        ([2], [5], {}),
        ([6], [7, 8], dict(frequency_penalty=0.75, repetition_penalty=1.5)),
    ]
    reqs = [_request(prompt, outputs, **kw) for prompt, outputs, kw in windows]
    shaping = build_shaping(reqs, [len(r.token_ids) for r in reqs], VOCAB, torch.device("cpu"))
    assert shaping.rows.tolist() == [0, 2]
    drafts = torch.tensor([[3, 9], [0, 0], [8, 8]])  # [R, K]
    cu = torch.tensor([0, 3, 4, 6])
    logits = torch.randn(7, VOCAB)  # [Tw, V], token 6 a pad
    out = apply_window_shaping(logits, shaping, drafts, cu)
    for token, window, j in [(0, 0, 0), (1, 0, 1), (2, 0, 2), (4, 2, 0), (5, 2, 1)]:
        prompt, outputs, kw = windows[window]
        alone = _request(prompt, outputs + drafts[window, :j].tolist(), **kw)
        one = build_shaping([alone], [len(alone.token_ids)], VOCAB, torch.device("cpu"))
        assert torch.equal(out[token], apply_shaping(logits[token : token + 1], one)[0])
    assert torch.equal(out[[3, 6]], logits[[3, 6]])


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ("frequency_penalty", -3, r"frequency_penalty must be in \[-2, 2\], got -3"),
        ("repetition_penalty", 0.0, "repetition_penalty must be greater than 0, got 0.0"),
        ("min_p", 1.5, r"min_p must be in \[0, 1\], got 1.5"),
        ("logit_bias", {3: 101}, r"logit_bias of token 3 must be in \[-100, 100\], got 101"),
        ("logit_bias", {"x": 1}, "logit_bias key 'x' is not a token id"),
        ("bad_words", [" "], "bad_words must be non-empty strings"),
        ("prompt_logprobs", 21, r"prompt_logprobs must be an integer in \[0, 20\], got 21"),
        ("n", 0, "n must be at least 1, got 0"),
    ],
)
def test_bad_parameters_are_refused_with_the_allowed_range(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_logit_bias_keys_may_be_strings_and_must_be_in_the_vocabulary(tiny_vocab_dir):
    assert SamplingParams(logit_bias={"7": 2.0}).logit_bias == {7: 2.0}
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=64)
    with pytest.raises(
        ValueError, match=r"logit_bias has token 12, outside the vocabulary \[0, 12\)"
    ):
        llm.generate([[2, 3]], SamplingParams(logit_bias={12: 1.0}), use_tqdm=False)


def test_bad_words_are_tokenised_alone_and_after_a_space():
    """vLLM's rule: the word, and with a leading space when that is another first token of
    the same length."""
    vocab = {"hello": [1], " hello": [2], "a b": [3, 4], " a b": [5, 4], "xy": [6, 7], " xy": [8]}
    sp = SamplingParams(bad_words=["hello", " a b", "xy"])
    assert sp.bad_words_token_ids(vocab.__getitem__) == [[1], [2], [3, 4], [5, 4], [6, 7]]


# ---- the engine's distribution --------------------------------------------------------------

NUM_SAMPLES = 6000
PROMPT = [2, 3, 4, 3]


def exact_next_probs(model, prompt, outputs, sp: SamplingParams) -> torch.Tensor:
    """The next token's distribution by vLLM's definitions, written out token by token (no
    engine code): bias, repetition over prompt and outputs, frequency and presence over
    outputs, temperature, min_p."""
    logits = full_logits(model, list(prompt) + list(outputs)).logits[-1].double().tolist()
    for v in range(len(logits)):
        logits[v] += (sp.logit_bias or {}).get(v, 0.0)
        if v in prompt or v in outputs:
            r = sp.repetition_penalty
            logits[v] = logits[v] / r if logits[v] > 0 else logits[v] * r
        logits[v] -= sp.frequency_penalty * outputs.count(v)
        logits[v] -= sp.presence_penalty * (v in outputs)
    probs = (torch.tensor(logits) / sp.temperature).softmax(-1)
    return (
        torch.where(probs < sp.min_p * probs.max(), 0.0, probs)
        / probs[probs >= sp.min_p * probs.max()].sum()
    )


def exact_pair_probs(model, prompt, sp: SamplingParams) -> torch.Tensor:
    """P(x2, x3) [V * V] after the prompt, x1 marginalised: each shaped by the outputs before it."""
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p1 = exact_next_probs(model, prompt, [], sp)
    for x1 in p1.nonzero().flatten().tolist():
        p2 = exact_next_probs(model, prompt, [x1], sp)
        for x2 in p2.nonzero().flatten().tolist():
            joint[x2] += p1[x1] * p2[x2] * exact_next_probs(model, prompt, [x1, x2], sp)
    return joint.reshape(-1)


SHAPED = {
    "penalties": dict(presence_penalty=0.8, frequency_penalty=1.0, repetition_penalty=1.8),
    "min_p": dict(min_p=0.15),
    "logit_bias": dict(logit_bias={5: 2.0, 0: -100.0, 7: 1.0}),
}


@pytest.mark.parametrize("name", list(SHAPED))
def test_engine_pair_distribution_with_shaping(tiny_vocab_dir, name):
    """Tokens 2 and 3 of 6,000 seeded requests, temperature 0.9, each shaped by the outputs
    before it, against the exact law from the model's logits (chi-square at the 0.1% level:
    tests/helpers.assert_matches_distribution). The shaping must move the law, or the test
    would not tell."""
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=4096)
    base = dict(temperature=0.9, max_tokens=3, ignore_eos=True)
    params = [SamplingParams(seed=s, **base, **SHAPED[name]) for s in range(NUM_SAMPLES)]
    outs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
    pairs = torch.tensor([o.outputs[0].token_ids[1] * VOCAB + o.outputs[0].token_ids[2]
                          for o in outs])  # fmt: skip
    counts = torch.bincount(pairs, minlength=VOCAB * VOCAB).double()
    exact = exact_pair_probs(llm.engine.model, PROMPT, SamplingParams(**base, **SHAPED[name]))
    unshaped = exact_pair_probs(llm.engine.model, PROMPT, SamplingParams(**base))
    assert (exact - unshaped).abs().sum() > 0.1, "the shaping hardly moves the law"
    assert_matches_distribution(counts, exact * NUM_SAMPLES)
    assert llm.engine.runner.stats["pytorch_sampling_steps_logits_shaping"] > 0


def record_shaping(monkeypatch, module) -> list[tuple[int, LogitsShaping]]:
    """(number of rows, the shaping) of each build_shaping call `module` makes."""
    built = []

    def build(reqs, *args):
        built.append((len(reqs), shaping := build_shaping(reqs, *args)))
        return shaping

    monkeypatch.setattr(module, "build_shaping", build)
    return built


ONE_SHAPED = dict(presence_penalty=1.5, repetition_penalty=1.5, logit_bias={4: 2.0})
MANY_PROMPTS = [[2, 3, 4, 3], [5, 6], [9, 9, 1], [7], [3, 5, 8, 8], [4, 4], [10, 2], [6, 11, 3]]


def test_one_shaping_row_among_many(tiny_vocab_dir, monkeypatch):
    """Eight greedy rows decoding together, row 3 shaping its logits: each step's tensors hold
    that row alone, the seven others emit the tokens and logprobs of a run where no row shapes,
    and row 3 those of its run alone."""
    from dspark.sample import sampling_rows

    built = record_shaping(monkeypatch, sampling_rows)
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=128,
              max_num_seqs=8)  # fmt: skip
    base = dict(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    params = [SamplingParams(**base, **(ONE_SHAPED if i == 3 else {})) for i in range(8)]
    shaped = llm.generate(MANY_PROMPTS, params, use_tqdm=False)
    outs = [o.outputs[0] for o in shaped]
    assert built and all(n == 8 and s.rows.tolist() == [3] and s.bias.shape[0] == 1
                         for n, s in built)  # fmt: skip
    unshaped = [o.outputs[0] for o in llm.generate(MANY_PROMPTS, SamplingParams(**base),
                                                   use_tqdm=False)]  # fmt: skip
    for i in (0, 1, 2, 4, 5, 6, 7):
        assert outs[i].token_ids == unshaped[i].token_ids
        assert outs[i].logprobs == unshaped[i].logprobs
    assert outs[3].token_ids != unshaped[3].token_ids, "the shaping should change row 3"
    alone = llm.generate([MANY_PROMPTS[3]], params[3], use_tqdm=False)
    assert outs[3].token_ids == alone[0].outputs[0].token_ids
    assert_same_logprobs([shaped[3]], alone)


def test_greedy_with_penalties_avoids_repeats(tiny_vocab_dir):
    """Greedy with a strong presence penalty never repeats a token within 11 outputs (12 words),
    where plain greedy does; each token is the argmax of the shaped logits."""
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=64)
    base = dict(temperature=0, max_tokens=11, ignore_eos=True)
    plain = llm.generate([PROMPT], SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    assert len(set(plain.token_ids)) < 11, "plain greedy should repeat on this model"
    sp = SamplingParams(presence_penalty=2.0, repetition_penalty=2.0, **base)
    got = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
    for i, token in enumerate(got):
        probs = exact_next_probs(llm.engine.model, PROMPT, got[:i], replace_temp(sp))
        assert token == int(probs.argmax())


def replace_temp(sp: SamplingParams) -> SamplingParams:
    """sp at temperature 1 (exact_next_probs divides by it; the argmax is the same)."""
    from dataclasses import replace

    return replace(sp, temperature=1.0)


def test_bad_words_never_appear_in_the_text(tiny_vocab_dir):
    """A one-token and a two-token bad word: neither occurs in 200 sampled outputs, where
    without them both do."""
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=1024)
    tok = llm.get_tokenizer()
    one, two = (
        tok.encode("e", add_special_tokens=False),
        tok.encode("c d", add_special_tokens=False),
    )
    assert len(one) == 1 and len(two) == 2

    def outputs(bad_words):
        params = [SamplingParams(seed=s, temperature=1.5, max_tokens=12, ignore_eos=True,
                                 bad_words=bad_words) for s in range(200)]  # fmt: skip
        return [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 200, params,
                                                               use_tqdm=False)]  # fmt: skip

    def found(outs):
        singles = sum(one[0] in t for t in outs)
        pairs = sum(t[i : i + 2] == two for t in outs for i in range(len(t) - 1))
        return singles, pairs

    assert min(found(outputs(None))) > 0
    assert found(outputs(["e", "c d"])) == (0, 0)


def test_offline_n_runs_n_seeded_samples(tiny_vocab_dir):
    """n = 3 with seed 5: one RequestOutput of three completions, completion i the sample a
    single request with seed 5 + i gives (vLLM's children); without a seed they still differ."""
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=256)
    base = dict(temperature=1.0, max_tokens=6, ignore_eos=True, presence_penalty=0.5)
    (out,) = llm.generate([PROMPT], SamplingParams(n=3, seed=5, **base), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = llm.generate([PROMPT] * 3, [SamplingParams(seed=5 + i, **base) for i in range(3)],
                           use_tqdm=False)  # fmt: skip
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in singles]
    unseeded = llm.generate([PROMPT, [5]], SamplingParams(n=4, **base), use_tqdm=False)
    assert [len(o.outputs) for o in unseeded] == [4, 4]
    assert len({tuple(c.token_ids) for c in unseeded[0].outputs}) > 1
    with pytest.raises(ValueError, match="n must be 1 for one engine request, got 2"):
        llm.engine.add_request("x", PROMPT, SamplingParams(n=2))


@pytest.mark.parametrize("budget", [64, 4])  # the second prefills in chunks of 4 tokens
def test_prompt_logprobs_are_the_raw_models(tiny_vocab_dir, budget):
    """vLLM's layout: None for the first prompt token, then per token {token: logprob} of it and
    the top 2 at its position, under the raw model's distribution (no shaping), also when the
    prompt is prefilled in chunks; a request without them in the batch gets None."""
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=64,
              max_num_batched_tokens=budget, max_num_seqs=4)  # fmt: skip
    prompt = [2, 3, 4, 3, 9, 9, 5, 7, 2, 6]
    sp = SamplingParams(prompt_logprobs=2, max_tokens=2, presence_penalty=1.0)
    out, other = llm.generate([prompt, PROMPT], [sp, SamplingParams(max_tokens=2)],
                              use_tqdm=False)  # fmt: skip
    assert other.prompt_logprobs is None
    assert_raw_prompt_logprobs(llm.engine.model, prompt, out.prompt_logprobs, 2)
    # a prompt whose pages are cached by now is still scored whole (no cache hit for it)
    long_prompt = prompt * 5  # (full pages of 16 tokens)
    llm.generate([long_prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    (again,) = llm.generate([long_prompt], sp, use_tqdm=False)
    assert_raw_prompt_logprobs(llm.engine.model, long_prompt, again.prompt_logprobs, 2)
    with pytest.raises(ValueError, match="prompt_logprobs comes with a RequestOutput"):
        llm.engine.add_request("d", prompt, SamplingParams(prompt_logprobs=1, output_kind="delta"))


def assert_raw_prompt_logprobs(model, prompt: list[int], got: list, k: int) -> None:
    """got[i] (i >= 1): {prompt[i]: its logprob, then the top k} under the raw model."""
    assert len(got) == len(prompt) and got[0] is None
    logprobs = full_logits(model, prompt).logits.log_softmax(-1)  # [T, V]
    for i in range(1, len(prompt)):
        top = logprobs[i - 1].topk(k)
        expected = {prompt[i]: logprobs[i - 1, prompt[i]].item()}
        expected.update({t: v for t, v in zip(top.indices.tolist(), top.values.tolist(),
                                              strict=True) if t not in expected})  # fmt: skip
        assert got[i].keys() == expected.keys()
        assert list(got[i].values()) == pytest.approx(list(expected.values()), abs=1e-4)
