"""Server-side prompt_logprobs (vLLM's shape, equal to the offline engine's) and echo with
logprobs (the prompt's tokens first in the completions logprobs), and their refusal while
streaming."""

from __future__ import annotations

import math

import pytest

from dspark.server.prompt_logprobs import FLOOR, PromptLogprobs, ranks
from tests.server.conftest import API_KEY, MODEL

openai = pytest.importorskip("openai")

PROMPT = "The quick brown fox jumps"


def _client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)


def test_ranks_count_among_the_computed_alternatives():
    # the prompt token (7) among the top 2: every token ranked
    assert ranks({7: -0.5, 3: -0.2}, 7, 2) == {3: 1, 7: 2}
    # outside the top 2 (the entry has one more): its rank is unknown, the others 1..2
    assert ranks({7: -3.0, 3: -0.2, 5: -1.0}, 7, 2) == {3: 1, 5: 2, 7: None}
    assert ranks({7: -3.0}, 7, 0) == {7: None}


def test_formats_vllms_shape_and_the_legacy_lists():
    fmt = PromptLogprobs(computed=2, asked=1, text=lambda t: f"<{t}>")
    entries = [None, {7: -3.0, 3: -0.2, 5: -1.0}, {9: -math.inf, 3: -0.1, 4: -2.0}]
    shown = fmt.vllm([1, 7, 9], entries)
    assert shown[0] is None
    assert shown[1] == {7: {"logprob": -3.0, "rank": None, "decoded_token": "<7>"},
                        3: {"logprob": -0.2, "rank": 1, "decoded_token": "<3>"}}  # fmt: skip
    assert shown[2][9] == {"logprob": FLOOR, "rank": None, "decoded_token": "<9>"}
    tokens, token_logprobs, top = fmt.legacy([1, 7, 9], entries, 2)
    assert tokens == ["<1>", "<7>", "<9>"] and token_logprobs == [None, -3.0, FLOOR]
    assert top == [None, {"<7>": -3.0, "<3>": -0.2, "<5>": -1.0},
                   {"<9>": FLOOR, "<3>": -0.1, "<4>": -2.0}]  # fmt: skip


def _offline_prompt_logprobs(tiny_llm, prompt_ids, k):
    from dspark import SamplingParams

    (out,) = tiny_llm.generate([{"prompt_token_ids": prompt_ids}],
                               SamplingParams(max_tokens=1, prompt_logprobs=k))  # fmt: skip
    return out.prompt_logprobs


def test_completion_prompt_logprobs_equal_the_offline_engines(server, tiny_llm):
    client = _client(server)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 3})  # fmt: skip
    ids = server.tokenizer.encode(PROMPT)
    shown = out.choices[0].model_extra["prompt_logprobs"]
    offline = _offline_prompt_logprobs(tiny_llm, ids, 3)
    assert len(shown) == len(ids) and shown[0] is None
    for token, entry, expected in zip(ids[1:], shown[1:], offline[1:], strict=True):
        assert {int(t) for t in entry} == set(expected)  # the token and its top 3
        for t, value in entry.items():
            assert value["logprob"] == pytest.approx(expected[int(t)], abs=1e-4)
            assert value["decoded_token"] == server.tokenizer.decode(
                [int(t)], skip_special_tokens=False
            )
        assert sorted(v["rank"] for v in entry.values() if v["rank"] is not None) == [1, 2, 3]
        assert str(token) in entry


def test_chat_prompt_logprobs_are_the_responses(server, tiny_llm):
    messages = [{"role": "user", "content": "Hi there"}]
    out = _client(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, n=2, extra_body={"prompt_logprobs": 0}
    )
    shown = out.model_extra["prompt_logprobs"]
    ids = server.tokenizer.apply_chat_template(messages, True)
    assert len(shown) == out.usage.prompt_tokens == len(ids) and shown[0] is None
    offline = _offline_prompt_logprobs(tiny_llm, ids, 0)
    for token, entry, expected in zip(ids[1:], shown[1:], offline[1:], strict=True):
        assert list(entry) == [str(token)]  # k = 0: the prompt token alone, rank unknown
        assert entry[str(token)]["logprob"] == pytest.approx(expected[token], abs=1e-4)


def test_echo_with_logprobs_lists_the_prompts_tokens_first(server):
    client = _client(server)
    kwargs = dict(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=3, temperature=0, logprobs=2,
                  n=2, extra_body={"ignore_eos": True})  # fmt: skip
    plain = client.completions.create(**kwargs)
    echoed = client.completions.create(echo=True, **kwargs)
    for before, after in zip(plain.choices, echoed.choices, strict=True):
        prompt = [PROMPT, "Hello"][after.index // 2]
        ids = server.tokenizer.encode(prompt)
        lp = after.logprobs
        assert after.text == prompt + before.text
        assert len(lp.tokens) == len(ids) + 3 and "".join(lp.tokens).endswith(before.text)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[len(ids) :] == before.logprobs.token_logprobs
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        # each prompt position: the prompt token and the top 2
        assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1 : len(ids)])
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        shown = after.model_extra["prompt_logprobs"]  # computed for echo: shown as vLLM does
        assert len(shown) == len(ids)
        for token, entry, logprob in zip(ids[1:], shown[1:], lp.token_logprobs[1 : len(ids)],
                                         strict=True):  # fmt: skip
            assert entry[str(token)]["logprob"] == logprob


def test_prompt_logprobs_are_refused_on_a_stream(server):
    client = _client(server)
    with pytest.raises(openai.BadRequestError, match="stream") as e:
        client.completions.create(model=MODEL, prompt="x", stream=True,
                                  extra_body={"prompt_logprobs": 1})  # fmt: skip
    assert e.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError, match="stream") as e:
        client.completions.create(model=MODEL, prompt="x", stream=True, echo=True, logprobs=1)
    assert e.value.body["param"] == "echo"
