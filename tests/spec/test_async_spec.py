"""A speculative engine schedules asynchronously while drafting is off and synchronously while it
drafts; switching between the two every few steps changes no output (CPU, tiny models)."""

from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams
from tests.helpers import assert_matches_distribution, assert_same_finished
from tests.spec.test_spec_engine import _exact_pair_distribution
from tests.tiny_models import make_tiny_drafter

PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 2, 3, 4, 5], [9], [4, 4, 4, 4, 4, 4, 4], [3, 5],
           [6, 2, 8], [10, 11], [7, 7, 1, 2]]  # fmt: skip


@pytest.fixture(scope="module")
def drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter_a"), taps=(0,))


def _engine(model_dir, drafter, async_scheduling, **kw):
    llm = LLM(str(model_dir), dtype="float32", device="cpu", async_scheduling=async_scheduling,
              speculative_config={"model": str(drafter), "num_speculative_tokens": 3},
              **kw)  # fmt: skip
    return llm.engine


def _run(engine, params, period=3):
    """Drafting on for `period` steps, off for `period`, ...; every finished output (token
    ids, text, finish reason, logprobs, stop reason) and the steps launched ahead."""
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done, step, launched_ahead = {}, 0, 0
    while engine.has_unfinished_requests():
        engine.scheduler.drafting = (step // period) % 2 == 0
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, c.text, c.finish_reason, c.logprobs,
                                        c.stop_reason)  # fmt: skip
        launched_ahead += engine._in_flight is not None
        step += 1
    return done, launched_ahead


def _params(engine):
    """Stops placed on tokens the requests really produce (from a greedy run)."""
    probe = {str(i): p for i, p in enumerate(PROMPTS)}
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = {}
    for rid, prompt in probe.items():
        engine.add_request(rid, prompt, greedy)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ids[out.request_id] = out.outputs[0].token_ids
    return [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ids["0"][4]]),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ids["1"][1]], min_tokens=6),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=13, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, seed=5, max_tokens=20, logprobs=1),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, use_speculation=False),
        SamplingParams(temperature=0, max_tokens=19, ignore_eos=True),
    ]


@pytest.mark.parametrize(
    "kw",
    [dict(num_kv_pages=256, max_num_batched_tokens=16, max_num_seqs=8),
     dict(num_kv_pages=7, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8)],
    ids=["chunked", "preemption"],
)  # fmt: skip
def test_async_plain_steps_between_drafting_steps_change_nothing(tiny_vocab_dir, drafter, kw):
    sync = _engine(tiny_vocab_dir, drafter, False, **kw)
    params = _params(sync)
    expected, ahead = _run(sync, params)
    assert ahead == 0
    fast = _engine(tiny_vocab_dir, drafter, True, **kw)
    got, ahead = _run(fast, params)
    assert ahead > 0  # plain steps were launched before the previous one was read back
    assert_same_finished(got, expected)
    assert fast.spec.metrics["num_drafts"] > 0
    assert fast.allocator.num_free == fast.allocator.num_usable
    if kw["num_kv_pages"] == 7:
        assert fast.scheduler.num_preemptions > 0


def test_greedy_equals_plain_decoding_across_mode_switches(tiny_vocab_dir, drafter):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (11, 25, 7, 16, 30, 9, 12, 20)]  # fmt: skip
    plain = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=256)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    got, _ = _run(_engine(tiny_vocab_dir, drafter, True, num_kv_pages=256), params, period=2)
    assert [got[str(i)][0] for i in range(len(PROMPTS))] == want


def test_sampling_across_mode_switches_keeps_the_target_distribution(tiny_vocab_dir, drafter):
    """Tokens 2 and 3 of 4,000 seeded requests while drafting flips every step (async plain
    steps between synchronous drafting ones): their joint law is the target's (chi-square)."""
    n, prompt = 4000, [2, 3, 4]
    engine = _engine(tiny_vocab_dir, drafter, True, num_kv_pages=2048, max_num_seqs=64)
    for s in range(n):
        engine.add_request(str(s), prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=3,
                                                          ignore_eos=True))  # fmt: skip
    outs, step = {}, 0
    while engine.has_unfinished_requests():
        engine.scheduler.drafting = step % 2 == 0
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        step += 1
    assert engine.spec.metrics["num_accepted_tokens"] > 0
    pairs = torch.tensor([o[1] * 12 + o[2] for o in outs.values()])
    counts = torch.bincount(pairs, minlength=144).float()
    expected = _exact_pair_distribution(engine.model, prompt, 1.0, 1.0) * n
    assert_matches_distribution(counts, expected)


@pytest.mark.parametrize("max_tokens", [5, 4])
def test_sampling_with_drafting_steps_launched_ahead_keeps_the_target_distribution(
    tiny_vocab_dir, drafter, max_tokens
):
    """4,000 seeded requests with drafting steps launched ahead (uniform windows, K = 1).
    Token 1 comes from the prefill. A first window verifies token 2 and, when it accepts,
    emits token 3 as its bonus; when it rejects, token 3 comes from the window launched
    behind it, whose anchor (token 2, at a position known only on the device) was written
    there. max_tokens 5: tokens 2 and 3. max_tokens 4: tokens 3 and 4; when the first window
    accepts, the window behind it has room for no draft, and the device shortens it to an
    empty window that emits token 4. Their joint law is the target's (chi-square), and every
    request's tokens and windows are those of the same engine with no step launched ahead."""
    n, prompt = 4000, [2, 3, 4]
    # (logprobs: a shortened window's are packed by the staged length, read by the device's)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, ignore_eos=True,
                             logprobs=1 if s % 2 else None) for s in range(n)]  # fmt: skip
    runs, logprobs = {}, {}
    for ahead in (False, True):
        spec = {"model": str(drafter), "num_speculative_tokens": 1}
        llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=4 * n + 16,
                  max_num_seqs=n, max_num_batched_tokens=4 * n, async_scheduling=ahead,
                  speculative_config=spec)  # fmt: skip
        llm.engine.runner.spec_runner.uniform_windows = True
        outputs = llm.generate([prompt] * n, params, use_tqdm=False)
        runs[ahead] = [(o.outputs[0].token_ids, o.metrics["num_draft_tokens"]) for o in outputs]
        logprobs[ahead] = [o.outputs[0].logprobs or [] for o in outputs]
    assert runs[True] == runs[False]  # (seeded: the same windows give the same tokens)
    for got, want in zip(logprobs[True], logprobs[False], strict=True):
        assert [list(top) for top in got] == [list(top) for top in want]
        for top, top_want in zip(got, want, strict=True):
            assert list(top.values()) == pytest.approx(list(top_want.values()), abs=1e-4)
    outs = [tokens for tokens, _ in runs[True]]
    engine = llm.engine
    stats = engine.runner.stats
    assert stats["continuation_windows"] >= n, dict(stats)  # every request continued once
    # (runner/continuations.py: shortened on the device near max_tokens)
    assert stats["continuation_windows_shortened"] > 0, dict(stats)
    assert engine.spec.metrics["num_accepted_tokens"] > 0
    first = 7 - max_tokens  # the pair's first token: 2 or 3
    pairs = torch.tensor([o[first - 1] * 12 + o[first] for o in outs])
    counts = torch.bincount(pairs, minlength=144).float()
    expected = _exact_pair_distribution(engine.model, prompt, 1.0, 1.0, first) * n
    assert_matches_distribution(counts, expected)
