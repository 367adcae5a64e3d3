"""Issue 51's routes and operations on a real server: /tokenize and /detokenize, CORS, the
X-Request-Id header, fields dspark does not implement refused by name, vLLM's latency
histograms, and `dspark serve` exiting when its model cannot load."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import httpx
import pytest
from starlette.testclient import TestClient

from dspark.server.app import build_app
from dspark.server.config import ServerConfig
from tests.server.conftest import API_KEY, MODEL, auth, engine_config, start_server

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def live(long_llama_dir):
    """Plain decoding, an API key, a 4096-token context (a request that runs for seconds)."""
    server = start_server(engine_config(long_llama_dir, max_model_len=4096), api_key=API_KEY)
    yield server
    server.stop()


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)


def _post(live, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, headers=auth() | headers, timeout=60)


# ---- /tokenize and /detokenize ----------------------------------------------------------------


def test_tokenize_a_prompt_and_detokenize_it_back(live):
    tokenizer = live.tokenizer
    body = _post(live, "/tokenize", {"model": MODEL, "prompt": "Hello world"}).json()
    assert body["tokens"] == tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 4096
    assert body["token_strs"] is None
    plain = _post(live, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert plain.json()["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    strs = _post(live, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.token_to_text(body["tokens"])
    back = _post(live, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {
        "prompt": tokenizer.decode(body["tokens"], skip_special_tokens=False)
    }


def test_tokenize_messages_applies_the_chat_template(live):
    messages = [{"role": "user", "content": "Hi there"}]
    tokenizer = live.tokenizer
    body = _post(live, "/tokenize", {"messages": messages}).json()
    assert body["tokens"] == tokenizer.apply_chat_template(messages, True)
    without = _post(live, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert without.json()["tokens"] == tokenizer.apply_chat_template(messages, False)
    assert without.json()["count"] < body["count"]
    # the count is what a chat completion's usage reports as its prompt
    usage = _client(live).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert usage.usage.prompt_tokens == body["count"]


TOOL = {"type": "function", "function": {"name": "f"}}


def test_tokenize_and_detokenize_refuse_bad_input_by_field(live):
    cases = [
        ("/tokenize", {}, None),  # neither prompt nor messages
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None),
        ("/tokenize", {"prompt": "x", "tools": [TOOL]}, None),  # tools need messages
        ("/tokenize", {"prompt": "x", "promt": "x"}, "promt"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens.1"),  # outside the vocabulary
        ("/detokenize", {"prompt": "x"}, "prompt"),
    ]
    for path, body, param in cases:
        response = _post(live, path, body)
        assert response.status_code == 400, (path, body, response.text)
        assert response.json()["error"]["param"] == param, response.json()
    assert _post(live, "/tokenize", {"model": "gpt-4", "prompt": "x"}).status_code == 404
    for path in ("/tokenize", "/detokenize"):  # behind the API key, as /v1
        refused = httpx.post(f"{live.url}{path}", json={"prompt": "x", "tokens": [1]})
        assert refused.status_code == 401


# ---- fields dspark does not implement ------------------------------------------------------


def test_unimplemented_and_unknown_fields_are_refused_by_name(live):
    client = _client(live)
    # vLLM's guided_* fields (gone from vLLM): the 400 says what replaces each
    guided = [({"guided_json": {"type": "object"}}, '"json": SCHEMA'),
              ({"guided_regex": "a+"}, '"regex": REGEX'),
              ({"guided_choice": ["a", "b"]}, '"choice": [...]'),
              ({"guided_grammar": "root ::= 'a'"}, '"grammar": GRAMMAR')]  # fmt: skip
    for extra, replacement in guided:
        (name,) = extra
        with pytest.raises(openai.BadRequestError, match="replaced by structured_outputs") as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == name and replacement in e.value.message
        with pytest.raises(openai.BadRequestError, match="replaced by structured_outputs"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                           max_tokens=2, extra_body=extra)  # fmt: skip
    for extra in ({"tools": [{"type": "function", "function": {"name": "f"}}]},
                  {"tool_choice": "auto"}, {"parallel_tool_calls": False}):  # fmt: skip
        (name,) = extra
        with pytest.raises(openai.BadRequestError, match="chat/completions only") as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == name
    with pytest.raises(openai.BadRequestError, match="beam search is not supported") as e:
        client.completions.create(model=MODEL, prompt="x", extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="temprature: unknown field") as e:
        client.completions.create(model=MODEL, prompt="x", extra_body={"temprature": 0})
    assert e.value.body["param"] == "temprature" and "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError, match="stream_options.continuous_usage_stats"):
        client.completions.create(model=MODEL, prompt="x", stream=True,
                                  stream_options={"continuous_usage_stats": True})  # fmt: skip


def test_what_clients_send_by_default_is_accepted(live):
    """The official client's own fields (n, user, stream_options), vLLM fields at the value
    that asks for nothing, and null for a field dspark lacks, are served."""
    client = _client(live)
    neutral = {"use_beam_search": False, "length_penalty": 1.0, "store": False,
               "guided_json": None, "priority": 0}  # fmt: skip
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=1, user="u",
                                    extra_body=neutral)  # fmt: skip
    assert out.choices[0].text is not None
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True,
        stream_options={"include_usage": True}, user="u",
    ))  # fmt: skip
    assert chunks[-1].usage.completion_tokens == 2


# ---- X-Request-Id ---------------------------------------------------------------------------


def test_the_request_id_header_is_the_request_id_whole_and_streamed(live):
    client = _client(live)
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="x", max_tokens=2, extra_headers={"X-Request-Id": "my-id.1"}
    )
    assert raw.headers["x-request-id"] == "my-id.1" and raw.parse().id == "cmpl-my-id.1"
    with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True,
        extra_headers={"X-Request-Id": "chat-7"},
    ) as response:  # fmt: skip
        assert response.headers["x-request-id"] == "chat-7"
        assert {chunk.id for chunk in response.parse()} == {"chatcmpl-chat-7"}
    generated = client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1)
    assert generated.parse().id == f"cmpl-{generated.headers['x-request-id']}"


def test_a_bad_or_running_request_id_is_a_400(live):
    for bad in ("has space", "x" * 129, "tab\there"):
        response = _post(live, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                         **{"X-Request-Id": bad})  # fmt: skip
        assert response.status_code == 400 and response.json()["error"]["param"] == "X-Request-Id"

    async def scenario():
        url = f"{live.url}/v1/completions"
        long = {"prompt": "Long", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        headers = auth() | {"X-Request-Id": "twice"}
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", url, json=long, headers=headers) as stream:
                lines = stream.aiter_lines()
                await anext(line async for line in lines if line.startswith("data: "))
                again = await client.post(url, json={"prompt": "x", "max_tokens": 1},
                                          headers=headers)  # fmt: skip
        return again

    again = asyncio.run(scenario())
    assert again.status_code == 400, again.text
    assert "still running" in again.json()["error"]["message"]
    live.wait_idle()  # (the long stream, closed, was aborted)
    reused = _post(live, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                   **{"X-Request-Id": "twice"})  # fmt: skip
    assert reused.status_code == 200 and reused.json()["id"] == "cmpl-twice"  # finished: free


# ---- metrics --------------------------------------------------------------------------------


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_vllm_latency_histograms_count_each_request_and_step(live):
    """A whole request of 6 tokens, one per step: one sample in each per-request histogram,
    five inter-token latencies (the steps after the first token)."""
    live.wait_idle()
    names = ["vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
             "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
             "vllm:request_time_per_output_token_seconds_count",
             "vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count",
             "vllm:inter_token_latency_seconds_count"]  # fmt: skip
    before = httpx.get(f"{live.url}/metrics").text
    body = {"prompt": "Count", "max_tokens": 6, "ignore_eos": True, "use_speculation": False}
    assert _post(live, "/v1/completions", body).status_code == 200
    after = httpx.get(f"{live.url}/metrics").text
    grown = {name: _sample(after, name) - _sample(before, name) for name in names}
    assert grown == {**dict.fromkeys(names, 1.0), "vllm:inter_token_latency_seconds_count": 5.0}
    assert "vllm:time_per_output_token_seconds" not in after


# ---- CORS (middleware only: no engine needed) ----------------------------------------------


def _app_client(**overrides) -> TestClient:
    """The application without its lifespan: no engine is started."""
    return TestClient(build_app(ServerConfig(api_key=API_KEY, **overrides), None))


def test_cors_preflight_is_answered_before_the_key_with_vllms_defaults():
    client = _app_client()
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    response = client.options("/v1/chat/completions", headers=preflight)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "*"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "access-control-allow-credentials" not in response.headers
    refused = client.post("/v1/completions", json={}, headers={"Origin": "https://app.example"})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"


def test_cors_flags_restrict_origins_methods_and_allow_credentials():
    client = _app_client(allowed_origins=("https://app.example",), allowed_methods=("POST",),
                         allow_credentials=True)  # fmt: skip
    ok = client.options(
        "/tokenize",
        headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"},
    )
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    assert ok.headers["access-control-allow-credentials"] == "true"
    other = client.options(
        "/tokenize",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    put = client.options(
        "/tokenize",
        headers={"Origin": "https://app.example", "Access-Control-Request-Method": "PUT"},
    )
    assert put.status_code == 400


# ---- the command line -----------------------------------------------------------------------


def test_serve_exits_non_zero_when_the_model_cannot_load(tmp_path):
    missing = tmp_path / "no_such_model"
    done = subprocess.run(
        [sys.executable, "-m", "dspark", "serve", str(missing), "--device", "cpu", "--port", "0"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "dspark: error: the model could not be loaded" in done.stderr
    assert "no_such_model" in done.stderr.splitlines()[-1]


def test_version_and_python_dash_m():
    from dspark.version import __version__

    for command in (["-m", "dspark", "--version"], ["-m", "dspark.cli", "--version"]):
        done = subprocess.run([sys.executable, *command], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 0 and done.stdout.strip() == f"dspark {__version__}", done
    usage = subprocess.run([sys.executable, "-m", "dspark", "serve", "--help"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert usage.returncode == 0 and "--allowed-origins" in usage.stdout
