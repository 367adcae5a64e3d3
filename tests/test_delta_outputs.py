"""output_kind "delta": a request's deltas, concatenated, equal its cumulative output (text,
tokens, logprobs, finish and usage), and no delta reports a character the final text lacks
(stop strings held back). Every case runs the same requests twice through one engine, first
cumulative, then delta, with the same seeds and the same batch, so the tokens are the same."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dspark.config import EngineConfig
from dspark.engine.engine import LLMEngine
from dspark.outputs import DeltaOutput, RequestOutput
from dspark.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_drafter

PROMPTS = ["Hello there, how", "The capital of France", "Once upon a time", "1 2 3 4"]


@pytest.fixture(scope="module", params=["plain", "speculation"])
def engine(request, tiny_llama_dir, tmp_path_factory):
    spec = None
    if request.param == "speculation":
        drafter = make_tiny_drafter(tiny_llama_dir, tmp_path_factory.mktemp("delta_d"), (0, 1))
        spec = {"method": "dspark", "model": str(drafter), "num_speculative_tokens": 3}
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                          num_kv_pages=256, max_model_len=256, speculative_config=spec)  # fmt: skip
    return LLMEngine(config)


def _run(engine: LLMEngine, params: list[SamplingParams], tag: str) -> dict[str, list]:
    """Every output of each request, by its index, until all have finished."""
    reports: dict[str, list] = {}
    for i, (prompt, p) in enumerate(zip(PROMPTS * 2, params, strict=False)):
        engine.add_request(f"{tag}-{i}", prompt, p)
    while engine.has_unfinished_requests():
        for out in engine.step():
            reports.setdefault(out.request_id.split("-")[1], []).append(out)
    return reports


def _joined(deltas: list[DeltaOutput]) -> tuple[str, list[int], list | None]:
    text = "".join(d.text for d in deltas)
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = None if deltas[0].logprobs is None else [lp for d in deltas for lp in d.logprobs]
    return text, tokens, logprobs


def _check_same(cumulative: dict[str, list], delta: dict[str, list]) -> None:
    assert cumulative.keys() == delta.keys()
    for index, outs in cumulative.items():
        final: RequestOutput = outs[-1]
        deltas: list[DeltaOutput] = delta[index]
        assert final.finished and deltas[-1].finished
        assert not any(d.finished for d in deltas[:-1]), "only the last delta is final"
        c, info = final.outputs[0], deltas[-1].final
        text, tokens, logprobs = _joined(deltas)
        assert (text, tokens, logprobs) == (c.text, c.token_ids, c.logprobs), index
        assert (info.finish_reason, info.stop_reason) == (c.finish_reason, c.stop_reason)
        assert info.num_output_tokens == len(c.token_ids)
        assert info.num_prompt_tokens == len(final.prompt_token_ids)
        assert info.cumulative_logprob == c.cumulative_logprob
        assert info.metrics.keys() == final.metrics.keys()
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_preemptions"):
            assert info.metrics.get(k) == final.metrics.get(k), k
        sent = ""
        for d in deltas:  # nothing reported that the final text lacks
            sent += d.text
            assert c.text.startswith(sent)


def _both(engine: LLMEngine, params: list[SamplingParams], name: str) -> dict[str, list]:
    cumulative = _run(engine, params, f"{name}c")
    delta = _run(engine, [replace(p, output_kind="delta") for p in params], f"{name}d")
    _check_same(cumulative, delta)
    assert all(isinstance(d, DeltaOutput) for ds in delta.values() for d in ds)
    assert not engine._cursors, "every delta request's cursor is dropped at its end"
    return cumulative


def test_deltas_add_up_to_the_cumulative_output(engine):
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20 + 3 * i, ignore_eos=True)
              for i in range(8)]  # fmt: skip
    _both(engine, params, "plain")


def test_deltas_with_logprobs(engine):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, logprobs=2) for i in range(3)]
    _both(engine, params, "lp")


def test_deltas_hold_back_a_stop_string_until_it_is_complete(engine):
    """Stop strings taken from the text a first run produced (so they do occur), of 2 to 6
    characters, with and without include_stop_str_in_output."""
    base = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in PROMPTS]
    texts = {i: outs[-1].outputs[0].text for i, outs in _run(engine, base, "probe").items()}
    params = []
    for i, _ in enumerate(PROMPTS):
        text = texts[str(i)]
        stops = [text[len(text) // 2 : len(text) // 2 + 2 + i], "never seen: zq#"]
        params.append(replace(base[i], stop=stops, include_stop_str_in_output=i % 2 == 1))
    cumulative = _both(engine, params, "stop")
    reasons = [outs[-1].outputs[0].finish_reason for outs in cumulative.values()]
    assert reasons.count("stop") >= 3, reasons


def test_an_aborted_delta_request_reports_its_end(engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind="delta")
    engine.add_request("abort-0", "Hello", params)
    deltas = []
    while len(deltas) < 3:
        deltas += engine.step()
    engine.abort_request("abort-0")
    while engine.has_unfinished_requests():
        deltas += engine.step()
    final = deltas[-1].final
    assert final.finish_reason == "abort" and not any(d.finished for d in deltas[:-1])
    tokens = [t for d in deltas for t in d.token_ids]
    assert final.num_output_tokens == len(tokens) >= 3
    assert "".join(d.text for d in deltas) == engine.tokenizer.decode(tokens)


@pytest.fixture(scope="module")
def interval_engine(engine):
    """The engine's model and speculation, reporting a stream every 4 tokens."""
    return LLMEngine(replace(engine.config, stream_interval=4))


def test_a_stream_interval_reports_every_n_tokens_and_adds_up(interval_engine):
    """Deltas of at least 4 tokens, but the first (at once, for TTFT) and the last (the end);
    plain decoding gives exactly 4. Together they equal the cumulative output, stop strings
    included."""
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=17 + 3 * i, ignore_eos=True,
                             stop=["zq#"] if i % 2 else None) for i in range(8)]  # fmt: skip
    params[3] = replace(params[3], stop=["the", "e"], ignore_eos=False, temperature=0.0)
    delta = _both(interval_engine, params, "interval")
    # the same requests again, kept this time to look at their deltas' sizes
    reports = _run(interval_engine, [replace(p, output_kind="delta") for p in params], "sizes")
    is_spec = interval_engine.spec is not None
    for outs in reports.values():
        sizes = [len(d.token_ids) for d in outs]
        assert sizes[0] >= 1 and all(n >= 4 for n in sizes[1:-1]), sizes
        if not is_spec:
            assert sizes[0] == 1 and all(n == 4 for n in sizes[1:-1]), sizes
    assert delta  # (the cumulative outputs _both compared against)


def test_bad_stream_interval_is_refused_by_name():
    for bad in (0, -1, 2.5, "4"):
        with pytest.raises(ValueError, match=r"stream_interval must be an integer >= 1"):
            EngineConfig(stream_interval=bad)


def test_token_only_deltas_carry_the_tokens_and_no_text(engine):
    """output_kind "delta_tokens" (the server decodes): the same tokens, finals and logprobs
    as "delta", every text empty, and no decoding in the engine."""
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=10 + 2 * i, ignore_eos=True,
                             logprobs=1 if i % 2 else None) for i in range(4)]  # fmt: skip
    delta = _run(engine, [replace(p, output_kind="delta") for p in params], "td")
    tokens_only = _run(engine, [replace(p, output_kind="delta_tokens") for p in params], "tt")
    for index, deltas in delta.items():
        got = tokens_only[index]
        assert all(d.text == "" for d in got)
        _, tokens, logprobs = _joined(deltas)
        assert _joined(got)[1:] == (tokens, logprobs)
        assert got[-1].final.finish_reason == deltas[-1].final.finish_reason
    assert not engine._cursors and not engine._detokenizers
