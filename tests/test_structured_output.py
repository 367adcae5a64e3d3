"""Structured output (dspark/structured/, docs/SPECULATION.md 4.9): the parameters and their
errors, the bitmask layouts on their worked examples, the grammar's matcher kept exactly in step
with the emitted tokens, drafts the grammar rejects rejected, the shaped law kept under
speculation, and on the default model: valid JSON, regex and choice outputs with speculation on
and off, greedy speculation equal to plain decoding token for token."""

from __future__ import annotations

import json
import re

import llguidance
import numpy as np
import pytest
import torch

from dspark import LLM, SamplingParams, StructuredOutputsParams
from dspark.sample.token_bitmask import WindowMasks, apply_token_bitmask, window_index
from dspark.spec import spec_decoder
from dspark.structured import validate
from dspark.structured.masks import BitmaskFiller
from tests.helpers import assert_matches_distribution, full_logits
from tests.spec.eager_replay import EagerReplay
from tests.tiny_models import TINY_WORDS, make_tiny_drafter

S = StructuredOutputsParams
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
}


def _allowed(words: np.ndarray) -> list[int]:
    """The token ids a bitmask row [W] allows."""
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")).tolist()


# ---- parameters and errors --------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({}, "structured_outputs sets none of json, regex, choice, grammar, json_object: exactly"),
        (dict(json=PERSON, regex="a+"), "structured_outputs sets json, regex of json, regex, "),
        (dict(regex="a", choice=["b"], json_object=True), "sets regex, choice, json_object of"),
        (dict(regex=""), "structured_outputs.regex must be a non-empty string, got ''"),
        (dict(choice=[]), "structured_outputs.choice must be a non-empty list of non-empty"),
        (dict(choice=["a", 3]), r"choice must be a non-empty list of non-empty strings, got \['a'"),
        (dict(json=3), r"structured_outputs.json must be a JSON schema \(a dict or its JSON"),
        (dict(json="{not json"), "structured_outputs.json is not JSON text: Expecting property"),
        (dict(json_object="yes"), "structured_outputs.json_object must be True or False"),
    ],
)
def test_structured_outputs_params_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        S(**kwargs)


def test_sampling_params_take_only_structured_outputs_params():
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams, "
                       "got dict"):  # fmt: skip
        SamplingParams(structured_outputs={"json": PERSON})
    params = SamplingParams(structured_outputs=S(choice=["a", "b"]))
    assert params.reads_outputs  # (its grammar's mask is the matcher's state over them)
    # one key for one constraint: a schema and its JSON text are compiled once
    assert S(json=PERSON).key == S(json=json.dumps(PERSON)).key
    assert S(json=PERSON).key != S(json_object=True).key


@pytest.mark.parametrize(
    "spec,message",
    [
        (S(regex="[0-9+"), r"(?s)structured_outputs.regex is invalid: .*unclosed character"),
        (S(json={"type": "bogus"}), "structured_outputs.json is invalid: Invalid type: bogus"),
        (S(json={"type": "array", "uniqueItems": True}), r"Unimplemented keys: \[\"uniqueItems"),
        (S(grammar="start: foo"), r"(?s)structured_outputs.grammar is invalid: .*unknown name"),
        (S(grammar="root ::= ("), "structured_outputs.grammar is invalid: Failed to convert"),
    ],
)
def test_invalid_constraints_are_refused_before_the_engine(spec, message):
    """dspark.structured.validate: what a front end calls before a request reaches the engine."""
    with pytest.raises(ValueError, match=message):
        validate(spec)


def test_valid_constraints_compile():
    for spec in (S(json=PERSON), S(json_object=True), S(regex="[0-9]{3}"),
                 S(choice=["yes", 'say "no"']), S(grammar='start: "a"+ "b"'),
                 S(grammar='root ::= "x" | "y"')):  # fmt: skip
        assert validate(spec)


def test_the_engine_refuses_an_invalid_constraint_and_keeps_the_batch(tiny_llm):
    good = SamplingParams(max_tokens=2, structured_outputs=S(regex="[0-9]+"))
    bad = SamplingParams(max_tokens=2, structured_outputs=S(regex="(a"))
    with pytest.raises(ValueError, match=r"prompt 1: structured_outputs.regex is invalid"):
        tiny_llm.generate(["one", "two"], [good, bad], use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


# ---- the layouts' worked examples -------------------------------------------------------


def test_token_bitmask_worked_example():
    """sample/token_bitmask.py: V = 5, bitmask [[0b00101], [0b11000]], index [1, -1, 0]."""
    logits = torch.arange(15.0).view(3, 5)
    bitmask = torch.tensor([[0b00101], [0b11000]], dtype=torch.int32)
    out = apply_token_bitmask(logits, bitmask, torch.tensor([1, -1, 0]))
    inf = float("-inf")
    assert out.tolist() == [[inf, inf, inf, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0, 9.0],
                            [10.0, inf, 12.0, inf, inf]]  # fmt: skip
    assert logits[0, 0] == 0.0  # (not in place: logprobs read the raw logits)
    # the sign bit is token 31 of its word
    high = torch.tensor([[-(2**31), 1]], dtype=torch.int32)
    assert torch.isfinite(apply_token_bitmask(torch.zeros(1, 40), high, torch.tensor([0]))
                          ).nonzero()[:, 1].tolist() == [31, 32]  # fmt: skip
    masks = WindowMasks(torch.zeros(1, 3, 1, dtype=torch.int32), torch.tensor([-1, 0]))
    index = window_index(masks, torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 1, 0, 1, 2]))
    assert index.tolist() == [-1, -1, 0, 1, 2]


# ---- the grammar's state on the default tokenizer ---------------------------------------


@pytest.fixture(scope="module")
def grammars(tiny_llm):
    """The tiny Llama's compiler (SmolLM2's tokenizer, 49,152 tokens)."""
    return tiny_llm.engine.grammars


def _ids(grammars, text: str) -> list[int]:
    return grammars.tokenizer.encode(text, add_special_tokens=False)


def test_window_bitmasks_worked_example(grammars):
    """structured/masks.py: regex [0-9]+ after "4", drafts ["2", "x", "7"]."""
    matcher = grammars.matcher(S(regex="[0-9]+"))
    assert matcher.advance(_ids(grammars, "4")) == 1
    two, x, seven = (_ids(grammars, c)[0] for c in "2x7")
    filler = BitmaskFiller(grammars.vocab_size)
    masks = filler.window_bitmasks([matcher], [[two, x, seven]], width=4)  # [1, 4, W]
    digits = [_ids(grammars, str(d))[0] for d in range(10)]
    eos = grammars.eos_token_ids[0]
    for j in (0, 1):  # after "4", after "42": digits and EOS
        allowed = _allowed(masks[0, j])
        assert set(digits) | {eos} <= set(allowed) and x not in allowed, j
        assert all(grammars.tokenizer.decode([t]).isdigit() for t in allowed if t != eos)
    for j in (2, 3):  # after the "x" the grammar rejects: all-allowed, never read
        assert len(_allowed(masks[0, j])) == grammars.vocab_size
    # the request's own state did not move
    assert _allowed(filler.anchor_bitmasks([matcher])[0]) == _allowed(masks[0, 0])
    assert filler.stats["masks"] == 5


def test_matcher_takes_tokens_until_the_grammar_completes(grammars):
    """structured/matcher.py's examples: after a completed grammar nothing is taken (the
    request ends on the completing token); EOS is taken where the grammar may end."""
    eos = grammars.eos_token_ids[0]
    one, two = _ids(grammars, "1")[0], _ids(grammars, "2")[0]
    m = grammars.matcher(S(regex="[0-9]{2}"))
    assert m.advance([one]) == 1 and not m.is_stopped and not m.is_accepting
    assert m.advance([two, eos]) == 1 and m.is_stopped and m.is_accepting and not m.error
    m = grammars.matcher(S(regex="[0-9]+"))
    assert m.advance([one, two, eos]) == 3 and m.is_stopped and not m.error
    m = grammars.matcher(S(regex="[0-9]+"))
    assert m.advance([one, _ids(grammars, "x")[0]]) == 1 and m.is_stopped and m.error
    # compiled once per constraint; each request a copy of its own
    before = grammars.stats["grammars_compiled"]
    a, b = grammars.matcher(S(choice=["yes", "no"])), grammars.matcher(S(choice=["yes", "no"]))
    assert grammars.stats["grammars_compiled"] == before + 1
    assert a.advance(_ids(grammars, "yes")) and a.is_stopped and not b.is_stopped


# ---- the engine on tiny models ----------------------------------------------------------


@pytest.fixture(scope="module")
def llama_drafter(tiny_llama_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_llama_dir, tmp_path_factory.mktemp("so_drafter"), taps=(0, 1))


def _tiny(target, drafter=None, **kw) -> LLM:
    spec = None if drafter is None else {"model": str(drafter), "num_speculative_tokens": 4}
    return LLM(str(target), dtype="float32", device="cpu", num_kv_pages=256, max_num_seqs=8,
               speculative_config=spec, **kw)  # fmt: skip


TINY_CONSTRAINTS = [
    S(regex="[0-9]{3}(-[a-z]{2,4}){2}"),
    S(choice=["alpha", "beta gamma", "delta"]),
    S(json={"type": "object", "properties": {"ok": {"type": "boolean"},
                                             "n": {"enum": [1, 2, 3]}},
            "required": ["ok", "n"], "additionalProperties": False}),
    S(grammar='start: "(" item ("," item)* ")"\nitem: /[a-c]/'),
]  # fmt: skip


def _fresh_state(grammars, spec, tokens):
    """A fresh matcher fed `tokens`: (tokens it took, accepting, stopped, its next mask)."""
    fresh = grammars.matcher(spec)
    taken = fresh.advance(tokens)
    mask = None if fresh.is_stopped else _allowed(BitmaskFiller(grammars.vocab_size)
                                                  .anchor_bitmasks([fresh])[0])  # fmt: skip
    return taken, fresh.is_accepting, fresh.is_stopped, mask


@pytest.mark.parametrize("mode", ["sync", "async", "ahead"])
def test_the_matcher_is_a_fresh_one_fed_the_emitted_tokens_after_every_step(
    tiny_llama_dir, llama_drafter, mode
):
    """A random drafter (most drafts rejected), greedy and sampled rows, rows without a
    grammar beside: after every step each request's matcher equals a fresh matcher fed exactly
    its emitted tokens (the same acceptance, stop and next mask), and every emitted token is one
    the grammar allows. "ahead": windows laid out K + 1 wide, drafting steps launched behind
    the step in flight."""
    llm = _tiny(tiny_llama_dir, llama_drafter, async_scheduling=mode != "sync")
    engine = llm.engine
    engine.runner.spec_runner.uniform_windows = mode == "ahead"
    reqs = []
    for i, spec in enumerate(TINY_CONSTRAINTS * 2):
        params = SamplingParams(temperature=0.0 if i < 4 else 1.0, seed=i, max_tokens=24,
                                structured_outputs=spec)  # fmt: skip
        engine.add_request(f"g{i}", f"Prompt number {i}:", params)
        reqs.append((engine._requests[f"g{i}"], spec))
    engine.add_request("free", "No constraint", SamplingParams(max_tokens=24, seed=9))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        for req, spec in reqs:
            outputs = req.output_token_ids
            taken, accepting, stopped, mask = _fresh_state(engine.grammars, spec, outputs)
            assert taken == len(outputs), (req.request_id, outputs)
            assert req.grammar.is_accepting == accepting and req.grammar.is_stopped == stopped
            if not stopped:
                filler = BitmaskFiller(engine.grammars.vocab_size)
                assert _allowed(filler.anchor_bitmasks([req.grammar])[0]) == mask
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > m["num_accepted_tokens"] and steps > 10
    for req, _ in reqs:  # complete grammars end "stop", the others at max_tokens
        assert req.finish_reason.value == ("stop" if req.grammar.is_stopped else "length")
    assert engine.scheduler.num_structured == 0 and engine.scheduler.num_grammar_errors == 0
    if mode == "ahead":
        assert engine.runner.stats["structured_output_steps_behind"] > 0


def test_drafts_that_break_the_grammar_are_rejected(tiny_llama_dir, llama_drafter, monkeypatch):
    """A drafter that always proposes a token the grammar never allows (its distribution all
    on it): every draft is rejected, the recovered token comes from the masked target, the
    output is valid and ends (no runaway), greedy and sampled."""
    llm = _tiny(tiny_llama_dir, llama_drafter)
    bad = llm.get_tokenizer().encode("x", add_special_tokens=False)[0]
    real = spec_decoder.draft_block

    def bad_drafts(*args, **kwargs):
        block = real(*args, **kwargs)
        probs = None
        if block.probs is not None:
            probs = torch.zeros_like(block.probs)
            probs[..., bad] = 1.0
        return spec_decoder.DraftBlock(torch.full_like(block.tokens, bad), probs,
                                       block.confidence_logits)  # fmt: skip

    monkeypatch.setattr(spec_decoder, "draft_block", bad_drafts)
    params = [SamplingParams(temperature=t, seed=3, max_tokens=40, structured_outputs=S(
              regex="[0-9]{6}")) for t in (0.0, 1.0)]  # fmt: skip
    outs = llm.generate(["Digits:", "More digits:"], params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert re.fullmatch("[0-9]{6}", c.text) and c.finish_reason == "stop", c
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] == 0


def test_a_token_the_grammar_does_not_allow_aborts_the_request(tiny_llama_dir, monkeypatch,
                                                                 caplog):  # fmt: skip
    """With the mask switched off (what a desynchronised matcher amounts to) the random target
    soon samples a token the grammar does not allow: the request ends there, "abort", its
    output the tokens before it, logged with the matcher's reason and counted; no runaway."""
    from dspark.runner import model_runner

    monkeypatch.setattr(model_runner, "apply_token_bitmask", lambda logits, *masks: logits)
    llm = _tiny(tiny_llama_dir)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=S(regex="[0-9]{30}"))
    with caplog.at_level("ERROR", logger="dspark.engine.scheduler"):
        (out,) = llm.generate(["Digits:"], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "abort" and re.fullmatch("[0-9]*", c.text), c
    assert llm.engine.scheduler.num_grammar_errors == 1
    assert llm.get_metrics()["structured_output"]["grammar_errors"] == 1
    assert "breaks its structured output grammar, so it is aborted" in caplog.text


def test_rows_without_a_grammar_are_untouched(tiny_llama_dir, llama_drafter):
    """Greedy requests without a constraint give the same tokens beside constrained ones as
    alone; a speculative engine serving none does no grammar work at all: no grammar rows, no
    mask filled, no extra host synchronisation."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = ["Hello there", "The quick brown fox"]
    alone = _tiny(tiny_llama_dir, llama_drafter)
    want = [o.outputs[0].token_ids for o in alone.generate(prompts, params, use_tqdm=False)]
    stats = alone.engine.runner.stats
    assert not any(k.startswith("structured_output") for k in stats), dict(stats)
    assert stats["spec_graph_steps_structured_output"] == 0
    assert alone.engine.runner.grammar_masks.filler._executor is None  # (never started)
    assert alone.engine.grammars._ll_tokenizer is None  # (never built)
    assert "structured_output" not in alone.get_metrics()

    beside = _tiny(tiny_llama_dir, llama_drafter)
    constrained = SamplingParams(temperature=0, max_tokens=20, structured_outputs=S(
                                 regex="[a-z ]{5,30}"))  # fmt: skip
    grammar_plans = []
    real_launch = beside.engine.runner.launch

    def launch(plan):  # (the steps whose windows carry a grammar)
        grammar_plans.append(any(plan.rows[i].num_draft for i in plan.grammar_rows))
        return real_launch(plan)

    beside.engine.runner.launch = launch
    outs = beside.generate(prompts + ["Letters:"], [params, params, constrained], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == want
    # one extra host synchronisation in each step with grammar windows, none in the others
    stats = beside.engine.runner.stats
    assert stats["structured_output_syncs"] == sum(grammar_plans) > 0
    metrics = beside.get_metrics()["structured_output"]
    assert metrics["draft_syncs"] == sum(grammar_plans) and metrics["grammars_compiled"] == 1
    assert metrics["masks_filled"] > 0 and metrics["grammar_errors"] == 0


def _grammar_window_steps(llm: LLM) -> list[bool]:
    """Per speculative step from now on: does it carry a window with a grammar?"""
    steps, masks = [], llm.engine.runner.grammar_masks
    real = masks.window_grammar

    def window_grammar(*args):
        grammar = real(*args)
        steps.append(grammar is not None)
        return grammar

    masks.window_grammar = window_grammar
    return steps


@pytest.mark.parametrize(
    ("max_num_seqs", "graphs"), [(8, False), (3, False), (8, True)],
    ids=["roomy", "admission", "graph_layouts"],
)  # fmt: skip
def test_grammar_windows_launched_behind_a_step_equal_sync(tiny_llama_dir, llama_drafter,
                                                           max_num_seqs, graphs):  # fmt: skip
    """Windows laid out K + 1 wide (as the speculative graphs lay them out), async scheduling:
    steps with grammar windows launch behind the step in flight and their drafts reach the host
    with that step's one wait (runner/grammar_masks.py), no wait of their own; the outputs equal
    the synchronous engine's token for token, greedy and seeded sampling, rows without a grammar
    beside, requests ending by their grammar, by length and by EOS mid-pipeline. "graph_layouts":
    the async engine's steps run as the captured ones do (tests/spec/eager_replay.py), a step
    with grammar windows verified again with its masks after the whole step."""
    prompts = [f"Prompt number {i}:" for i in range(10)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=20 + i,
                             structured_outputs=TINY_CONSTRAINTS[i % 4] if i < 8 else None)
              for i in range(10)]  # fmt: skip

    def run(async_scheduling: bool):
        llm = _tiny(tiny_llama_dir, llama_drafter, async_scheduling=async_scheduling,
                    max_num_batched_tokens=64)  # fmt: skip
        llm.engine.scheduler.max_num_seqs = max_num_seqs
        spec_runner = llm.engine.runner.spec_runner
        spec_runner.uniform_windows = True
        if graphs and async_scheduling:
            spec_runner.graphs = EagerReplay(spec_runner, [1, 2, 4, 8])
        launches = _grammar_window_steps(llm)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        counted = llm.get_metrics()["structured_output"]
        assert counted["drafts_with_previous_wait"] == llm.engine.runner.stats[
            "structured_output_steps_behind"]  # fmt: skip
        return llm.engine.runner.stats, sum(launches), outs

    sync_stats, sync_grammar_steps, want = run(False)
    stats, grammar_steps, got = run(True)
    assert [(c.token_ids, c.finish_reason) for c in got] == [
        (c.token_ids, c.finish_reason) for c in want]  # fmt: skip
    for c, p in zip(got, params, strict=True):
        if p.structured_outputs is not None and c.finish_reason == "stop":
            assert p.structured_outputs.regex is None or re.fullmatch(
                p.structured_outputs.regex, c.text), c.text  # fmt: skip
    assert sync_stats["structured_output_syncs"] == sync_grammar_steps > 0
    assert stats["structured_output_steps_behind"] > 0, dict(stats)
    # every step with grammar windows waits once for its drafts: with the step before it, or
    # (nothing in flight before it) on its own
    assert (
        stats["structured_output_steps_behind"] + stats["structured_output_syncs"] == grammar_steps
    )
    assert (
        stats["spec_steps_launched_ahead"] > 0
        and "spec_steps_not_ahead_structured_output" not in stats
    )
    assert (stats["spec_graph_steps_structured_output"] > 0) == graphs, dict(stats)


def test_greedy_speculation_with_a_grammar_equals_plain_decoding(tiny_llama_dir, llama_drafter):
    """Float32, a random drafter: the same tokens with and without speculation."""
    prompts = [f"Prompt {i}" for i in range(len(TINY_CONSTRAINTS))]
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=s)
              for s in TINY_CONSTRAINTS]  # fmt: skip
    plain = [o.outputs[0] for o in _tiny(tiny_llama_dir).generate(prompts, params,
                                                                   use_tqdm=False)]  # fmt: skip
    spec = [o.outputs[0] for o in _tiny(tiny_llama_dir, llama_drafter).generate(
            prompts, params, use_tqdm=False)]  # fmt: skip
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert [c.finish_reason for c in spec] == [c.finish_reason for c in plain]


# ---- the law under speculation (the tiny word-level model) -------------------------------


class _Words:
    """The tiny model's 12 words as llguidance's tokenizer (its WordPiece decoder is one
    llguidance does not read): each word its letters, "<unk>" and "<eos>" special."""

    eos_token_id, bos_token_id = 1, None
    tokens = [w.encode() for w in TINY_WORDS]
    special_token_ids = [0, 1]

    def __call__(self, text):
        text = text.decode() if isinstance(text, bytes) else text
        return [TINY_WORDS.index(c) for c in text]


# four letters alternating halves: each token's allowed set depends on the one before it
ALTERNATING = S(regex="[a-e][f-j][a-e][f-j]|[f-j][a-e][f-j][a-e]")
PROMPT = [2, 3, 4, 3]
NUM_SAMPLES = 4000


LOW, HIGH = range(2, 7), range(7, 12)  # a..e, f..j


def _alternating(tokens: list[int]) -> list[int]:
    """What ALTERNATING allows after `tokens` (of at most 3), written out without llguidance."""
    if not tokens:
        return [*LOW, *HIGH]
    return list(HIGH if tokens[-1] in LOW else LOW)


def _exact_triples(model, temperature: float) -> torch.Tensor:  # [V^3]
    """P(t1, t2, t3) of plain decoding under ALTERNATING: each token from the target's
    distribution at the temperature, renormalised over what the grammar allows after the tokens
    before it (no engine code)."""
    V = len(TINY_WORDS)

    def probs(tokens: list[int]) -> torch.Tensor:
        logits = full_logits(model, PROMPT + tokens).logits[-1].double()
        allowed = torch.zeros(V, dtype=torch.bool)
        allowed[_alternating(tokens)] = True
        return (logits / temperature).masked_fill(~allowed, float("-inf")).softmax(-1)

    exact = torch.zeros(V, V, V, dtype=torch.float64)
    p1 = probs([])
    for t1 in p1.nonzero().flatten().tolist():
        p2 = probs([t1])
        for t2 in p2.nonzero().flatten().tolist():
            exact[t1, t2] = p1[t1] * p2[t2] * probs([t1, t2])
    return exact.flatten()


def test_speculation_keeps_the_masked_law(tiny_vocab_dir, tmp_path_factory, monkeypatch):
    """4,000 seeded requests at temperature 0.9: token 1 from the prefill, then a window of one
    draft judged by the mask after token 1, its bonus by the mask after the draft. Drafts are
    drawn uniformly from the ten letters (half of them allowed at each position, so drafts are
    both accepted and rejected by the grammar). The emitted triples match plain decoding's
    exact law under the grammar (chi-square at the 0.1% level), and no triple the grammar
    forbids occurs."""
    drafter = make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("so_d12"), taps=(0,))
    real, draws = spec_decoder.draft_block, torch.Generator().manual_seed(0)

    def uniform_letters(*args, **kwargs):  # (a draft's law is all verification needs)
        block = real(*args, **kwargs)
        tokens = torch.randint(2, 12, block.tokens.shape, generator=draws)
        probs = torch.zeros_like(block.probs)
        probs[..., 2:] = 0.1
        return spec_decoder.DraftBlock(tokens, probs, block.confidence_logits)

    monkeypatch.setattr(spec_decoder, "draft_block", uniform_letters)
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=4096,
              speculative_config={"model": str(drafter), "num_speculative_tokens": 4})  # fmt: skip
    grammars = llm.engine.grammars
    grammars._ll_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Words()),
                                                    n_vocab=len(TINY_WORDS))  # fmt: skip
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=3, structured_outputs=ALTERNATING)
              for s in range(NUM_SAMPLES)]  # fmt: skip
    outs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and 0 < m["num_accepted_tokens"] < m["num_draft_tokens"], m
    V = len(TINY_WORDS)
    triples = torch.tensor([t[0] * V * V + t[1] * V + t[2] for t in
                            (o.outputs[0].token_ids for o in outs)])  # fmt: skip
    counts = torch.bincount(triples, minlength=V**3).double()
    exact = _exact_triples(llm.engine.model, 0.9)
    assert exact.sum().item() == pytest.approx(1.0)
    assert_matches_distribution(counts, exact * NUM_SAMPLES)


# ---- the default model and its shipped drafter ------------------------------------------


@pytest.fixture(scope="module")
def default_llms():
    """(plain, speculative): the default model in float32 on the CPU, the shipped drafter."""
    kw = dict(dtype="float32", device="cpu", max_num_seqs=8)
    return LLM(**kw), LLM(speculative_config={"method": "dspark"}, **kw)


CONVERSATIONS = [
    "Describe a person named Alice, 30, from Paris, as JSON with keys name, age, city.",
    "Give me a JSON object for Bob who is 42 and lives in Berlin (keys: name, age, city).",
    "Invent a character for a novel and give their name, age and home city as JSON.",
]


def _chat(llm, texts, params):
    convs = [[{"role": "user", "content": t}] for t in texts]
    return [o.outputs[0] for o in llm.chat(convs, params, use_tqdm=False)]


def _assert_valid_person(text: str) -> None:
    value = json.loads(text)
    try:
        import jsonschema
    except ImportError:  # (by hand: the schema's required keys and types)
        assert isinstance(value, dict) and set(PERSON["required"]) <= value.keys()
        assert isinstance(value["name"], str) and isinstance(value["city"], str)
        assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    else:
        jsonschema.validate(value, PERSON)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("speculative", [False, True])
def test_json_schema_output_validates(default_llms, speculative, temperature):
    llm = default_llms[speculative]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=96,
                             structured_outputs=S(json=PERSON)) for i in range(3)]  # fmt: skip
    for c in _chat(llm, CONVERSATIONS, params):
        assert c.finish_reason == "stop", c
        _assert_valid_person(c.text)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("speculative", [False, True])
def test_regex_and_choice_outputs_match(default_llms, speculative, temperature):
    llm = default_llms[speculative]
    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
    choices = ["positive", "negative", "neutral"]
    texts = ["When did the Berlin wall fall? Answer with a date.",
             "Is the review 'I loved every minute of it' positive, negative or neutral?",
             "Write the date of the first moon landing."]  # fmt: skip
    specs = [S(regex=date), S(choice=choices), S(regex=date)]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=32,
                             structured_outputs=s) for i, s in enumerate(specs)]  # fmt: skip
    got = _chat(llm, texts, params)
    assert re.fullmatch(date, got[0].text) and re.fullmatch(date, got[2].text), got
    assert got[1].text in choices
    assert all(c.finish_reason == "stop" for c in got)


@pytest.mark.slow
def test_greedy_structured_speculation_equals_plain_decoding(default_llms):
    """Float32: with the shipped drafter, the same tokens as plain decoding under JSON schema,
    JSON object, regex, choice and grammar constraints; drafts are accepted."""
    plain, spec = default_llms
    texts = CONVERSATIONS + [
        "List three colours as a JSON object.",
        "Write a phone number.",
        "Pick a fruit.",
        "Write a short arithmetic expression.",
    ]
    specs = [S(json=PERSON)] * 3 + [
        S(json_object=True),
        S(regex=r"\+?[0-9]{1,3} [0-9]{3} [0-9]{3} [0-9]{4}"),
        S(choice=["apple", "banana", "cherry"]),
        S(grammar='start: expr\nexpr: NUM (OP NUM)*\nNUM: /[0-9]+/\nOP: " + " | " * "'),
    ]
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=s) for s in specs]
    before = spec.get_metrics().get("num_accepted_tokens", 0)
    want = [c.token_ids for c in _chat(plain, texts, params)]
    assert [c.token_ids for c in _chat(spec, texts, params)] == want
    assert spec.get_metrics()["num_accepted_tokens"] > before
    stats = spec.engine.runner.stats
    assert stats["structured_output_syncs"] + stats["structured_output_steps_behind"] > 0


# ---- the GPU: captured steps, those with grammar windows verified again with masks --------


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_gpu_grammar_steps_replay_their_graphs_and_verify_with_masks(
    tiny_llama_dir, llama_drafter, async_scheduling
):
    """CUDA graphs on, float32: requests without a constraint alone replay captured
    speculative steps with no grammar work; beside constrained ones they give the same tokens,
    the steps with grammar windows replay their graphs too, then verify again with the masks
    after the drafts the graph made (with async scheduling their drafts come with the wait for
    the step before), and greedy constrained output equals plain decoding's under the same
    constraint (decode graphs, the mask applied after them)."""
    kw = dict(dtype="float32", device="cuda", num_kv_pages=512, max_num_seqs=8,
              max_model_len=256, async_scheduling=async_scheduling)  # fmt: skip
    spec_config = {"model": str(llama_drafter), "num_speculative_tokens": 4}
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["Hello there", "The quick brown fox"]
    alone = LLM(str(tiny_llama_dir), speculative_config=spec_config, **kw)
    want = [o.outputs[0].token_ids for o in alone.generate(prompts, free, use_tqdm=False)]
    stats = alone.engine.runner.stats
    assert stats["spec_graph_steps"] > 0 and stats["structured_output_syncs"] == 0, dict(stats)
    assert stats["spec_graph_steps_structured_output"] == 0
    del alone

    constrained = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=s)
                   for s in TINY_CONSTRAINTS]  # fmt: skip
    tiny_prompts = [f"Prompt {i}" for i in range(len(TINY_CONSTRAINTS))]
    spec = LLM(str(tiny_llama_dir), speculative_config=spec_config, **kw)
    outs = spec.generate(prompts + tiny_prompts, [free, free] + constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == want
    stats = spec.engine.runner.stats
    assert stats["spec_graph_steps_structured_output"] > 0
    assert spec.engine.scheduler.num_grammar_errors == 0
    assert stats["structured_output_syncs"] + stats["structured_output_steps_behind"] > 0
    assert (stats["structured_output_steps_behind"] > 0) == async_scheduling, dict(stats)
    got = [o.outputs[0].token_ids for o in outs[2:]]
    del spec
    plain = LLM(str(tiny_llama_dir), **kw)
    assert [o.outputs[0].token_ids for o in plain.generate(tiny_prompts, constrained,
                                                            use_tqdm=False)] == got  # fmt: skip
    assert plain.engine.runner.stats["graph_steps"] > 0
