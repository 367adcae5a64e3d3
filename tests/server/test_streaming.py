"""Streams under load: outputs coalesced into one chunk per pacing interval, chunks rendered from
templates, and what a client sees when its chunks carry many tokens (every token exactly once,
in order, with the right usage and finish reason; a slow reader still gets everything)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from dspark.outputs import DeltaOutput, FinalInfo
from dspark.server.event_stream import EventStreamResponse
from dspark.server.request_stream import COST_WEIGHT, EngineFailed, RequestStream, StreamPacer
from dspark.server.responses import ChatFormat, CompletionFormat, Delta, envelope, to_json
from dspark.server.serving import Prepared, StreamWriter
from tests.server.conftest import MODEL, engine_config, start_server

NUM_TOKENS = 48


def _out(text: str, finished: bool = False, request_id: str = "r-0") -> DeltaOutput:
    """A delta of `text` (a token per character)."""
    final = FinalInfo("length", None, 1, len(text), None, {}) if finished else None
    return DeltaOutput(request_id, text, list(range(len(text))), None, final)


# ---- RequestStream and StreamPacer ----------------------------------------------------------


def test_pacer_interval_is_streams_times_cost_over_budget():
    pacer = StreamPacer(budget=0.1)
    for _ in range(256):
        pacer.open()
    pacer.record(20e-6)  # the first chunk starts the average
    assert pacer.interval_s == pytest.approx(256 * 20e-6 / 0.1)  # 51.2 ms, the docstring's
    for _ in range(255):
        pacer.close()
    assert pacer.interval_s == pytest.approx(0.2e-3)  # 1 stream
    pacer.record(40e-6)  # later chunks move the average by COST_WEIGHT of the difference
    assert pacer.cpu_per_chunk_s == pytest.approx(20e-6 + COST_WEIGHT * 20e-6)
    assert StreamPacer(budget=None).interval_s == 0.0


def test_outputs_that_arrive_together_become_one_update():
    async def scenario():
        stream = RequestStream(["a", "b"], abort=lambda ids: None)
        loop = asyncio.get_running_loop()
        for index, text in ((0, "He"), (1, "A"), (0, "llo")):
            stream.put(index, _out(text), loop.time())
        updates = stream.updates()
        first = await updates.__anext__()
        stream.put(0, _out("!", finished=True), loop.time())
        stream.put(1, EngineFailed("gone"), loop.time())
        second = await updates.__anext__()
        with pytest.raises(StopAsyncIteration):
            await updates.__anext__()
        return first, second

    first, second = asyncio.run(scenario())
    assert {i: u.text for i, u in first.items()} == {0: "Hello", 1: "A"}
    assert first[0].token_ids == [0, 1, 0, 1, 2]  # the deltas' tokens, in order
    assert second[0].finished and second[0].text == "!" and isinstance(second[1], EngineFailed)


def test_a_paced_stream_holds_outputs_until_due_but_never_its_last():
    """interval 50 ms: the first output goes at once, the next two wait for the due time and
    go as one update, the final output goes at once."""

    async def scenario():
        pacer = StreamPacer(budget=0.1)
        stream = RequestStream(["a"], abort=lambda ids: None, pacer=pacer)
        pacer.record(5e-3)  # 5 ms per chunk: 1 stream x 5 ms / 0.1 = 50 ms
        pacer.record = lambda cpu_s: None  # the test's own chunks keep it there
        loop = asyncio.get_running_loop()
        taken = []

        async def consume():
            async for batch in stream.updates():
                taken.append((loop.time(), batch[0].text))

        consumer = asyncio.ensure_future(consume())
        start = loop.time()
        stream.put(0, _out("a"), loop.time())
        await asyncio.sleep(0.005)
        stream.put(0, _out("b"), loop.time())
        stream.put(0, _out("c"), loop.time())
        await asyncio.sleep(0.1)  # past the due time: "bc" went when it was due
        stream.put(0, _out("d"), loop.time())
        stream.put(0, _out("e", finished=True), loop.time())  # due in 50 ms, sent now
        await asyncio.wait_for(consumer, 0.03)
        return start, pacer.interval_s, taken

    start, interval, taken = asyncio.run(scenario())
    assert interval == pytest.approx(0.05)
    assert [text for _, text in taken] == ["a", "bc", "de"]
    assert taken[0][0] - start < 0.02  # the first output was not held
    assert taken[1][0] - taken[0][0] >= 0.045  # "bc" waited for its due time
    assert taken[2][0] - taken[1][0] < 0.09  # the final one did not wait for the next


def test_closing_aborts_only_the_unfinished_choices():
    aborted = []

    async def scenario():
        pacer = StreamPacer(budget=0.1)
        stream = RequestStream(["a", "b"], abort=aborted.extend, pacer=pacer)
        stream.put(0, _out("x", finished=True), asyncio.get_running_loop().time())
        updates = stream.updates()
        await updates.__anext__()
        stream.close()
        stream.close()  # idempotent
        return pacer.num_streams

    assert asyncio.run(scenario()) == 0
    assert aborted == ["b"]


def test_closing_ends_a_consumer_waiting_for_updates():
    """The client left while its stream waited for the engine: close() (the response's
    disconnect watcher) aborts the choice and the consumer's loop ends at once."""
    aborted = []

    async def scenario():
        stream = RequestStream(["a"], abort=aborted.extend)
        taken = []

        async def consume():
            async for batch in stream.updates():
                taken.append(batch)

        consumer = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)  # waiting: nothing arrived
        stream.close()
        await asyncio.wait_for(consumer, 1.0)
        stream.put(0, _out("late"), asyncio.get_running_loop().time())  # dropped
        return taken

    assert asyncio.run(scenario()) == []
    assert aborted == ["a"]


@pytest.mark.parametrize("client_leaves", [False, True])
def test_an_event_stream_response_sends_every_event_or_closes_when_the_client_leaves(
    client_leaves,
):
    """EventStreamResponse at the ASGI level: headers, one body message per event and the end;
    or, once receive() says the client left, on_close runs while the body still waits."""
    sent, closed, receive_calls = [], [], []

    async def scenario():
        left = asyncio.Event()

        async def receive():
            receive_calls.append(1)
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        stream = RequestStream(["a"], abort=lambda ids: None)

        async def events():
            async for batch in stream.updates():
                yield batch[0].text

        def on_close():
            closed.append(1)
            stream.close()

        response = EventStreamResponse(events(), on_close, {"X-Test": "1"})
        task = asyncio.ensure_future(response({"type": "http"}, receive, send))
        loop = asyncio.get_running_loop()
        stream.put(0, _out("data: a\n\n"), loop.time())
        await asyncio.sleep(0.01)
        if client_leaves:
            left.set()  # the body waits for the engine: the watcher ends it
        else:
            stream.put(0, _out("data: b\n\n", finished=True), loop.time())
        await asyncio.wait_for(task, 1.0)

    asyncio.run(scenario())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"x-test"] == b"1" and b"content-length" not in headers
    bodies = [(m["body"], m["more_body"]) for m in sent[1:]]
    if client_leaves:
        assert bodies == [(b"data: a\n\n", True), (b"", False)]
    else:
        assert bodies == [(b"data: a\n\n", True), (b"data: b\n\n", True), (b"", False)]
    assert closed and len(receive_calls) == 1


# ---- chunk text -----------------------------------------------------------------------------

TRICKY = ["a", ' "quoted" \\ back\nslash\t', "é漢字🙂", "\x00\x1f\x7f"]  # (never empty)


@pytest.mark.parametrize("fmt_class", [ChatFormat, CompletionFormat])
def test_templated_chunks_equal_the_dict_rendering(fmt_class):
    fmt = fmt_class(None, False, None)
    for text in TRICKY:
        choice = fmt.delta_choice(3, Delta(text, [], None, None), is_first=False)
        assert fmt.text_delta_json(3, text) == json.dumps(choice, ensure_ascii=False)


@pytest.mark.parametrize("include_usage", [False, True])
def test_an_event_equals_json_dumps_of_its_envelope(include_usage):
    fmt = ChatFormat(None, False, None)
    prep = Prepared("chatcmpl-x", [], 3, fmt, True, include_usage)
    writer = StreamWriter(prep, 'model "m"', created=17)
    choice = fmt.delta_choice(0, Delta("hi é", [], None, None), is_first=True)
    body = envelope(fmt.chunk_object_name, "chatcmpl-x", 17, 'model "m"', [choice, choice])
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    if include_usage:
        body["usage"] = usage
    expected = f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
    assert writer.sse([to_json(choice)] * 2, usage) == expected


def test_a_choice_past_its_first_chunk_is_templated_and_the_final_is_not():
    fmt = ChatFormat(None, False, None)
    writer = StreamWriter(Prepared("chatcmpl-x", [], 3, fmt, True, False), "m", created=0)
    first = json.loads(writer.delta(0, _out("Hel")))
    middle = json.loads(writer.delta(0, _out("lo wor")))
    assert writer.delta(0, _out("")) is None  # nothing new
    last = json.loads(writer.delta(0, _out("ld", finished=True)))
    assert first["delta"] == {"role": "assistant", "content": "Hel"}
    assert middle["delta"] == {"content": "lo wor"} and middle["finish_reason"] is None
    assert last["delta"] == {"content": "ld"} and last["finish_reason"] == "length"


# ---- a real server whose chunks carry many tokens --------------------------------------------


@pytest.fixture(scope="module")
def chunky_server(tiny_llama_dir):
    """A budget so small that a lone stream's chunks come tens of milliseconds apart: several
    engine steps' tokens per chunk."""
    live = start_server(engine_config(tiny_llama_dir), stream_budget=0.001)
    yield live
    live.stop()


def _events(lines: list[str]) -> list[dict]:
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _stream(live, route: str, body: dict, read_delay_s: float = 0.0) -> list[dict]:
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    lines = []
    with httpx.stream("POST", f"{live.url}/v1/{route}", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            lines.append(line)
            time.sleep(read_delay_s)
    return _events(lines)


def _greedy(**extra) -> dict:
    return {"model": MODEL, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip


def test_coalesced_completion_chunks_carry_every_token_once(chunky_server):
    body = _greedy(prompt="Once upon a time")
    whole = httpx.post(f"{chunky_server.url}/v1/completions", json=body, timeout=60).json()
    *chunks, last = _stream(chunky_server, "completions", body)
    choices = [c["choices"][0] for c in chunks]
    token_ids = [t for choice in choices for t in choice["token_ids"]]
    assert len(chunks) < NUM_TOKENS // 2  # several tokens per chunk: the pacing took effect
    assert token_ids == whole["choices"][0]["token_ids"] and len(token_ids) == NUM_TOKENS
    assert "".join(choice["text"] for choice in choices) == whole["choices"][0]["text"]
    assert [choice["finish_reason"] for choice in choices] == [None] * (len(chunks) - 1) + [
        "length"
    ]
    assert last["choices"] == [] and last["usage"] == whole["usage"]


def test_coalesced_chat_chunks_with_a_stop_string_send_nothing_past_it(chunky_server):
    """The stop string is cut from the final text; chunks of many tokens still hold back its
    first characters, so nothing past the final text was ever sent."""
    messages = [{"role": "user", "content": "Tell me a story"}]
    probe = httpx.post(f"{chunky_server.url}/v1/chat/completions", timeout=60,
                       json=_greedy(messages=messages)).json()  # fmt: skip
    text = probe["choices"][0]["message"]["content"]
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    assert len(stop) == 4 and text.find(stop) > 0
    body = _greedy(messages=messages, stop=[stop])
    whole = httpx.post(f"{chunky_server.url}/v1/chat/completions", json=body, timeout=60).json()
    *chunks, last = _stream(chunky_server, "chat/completions", body)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == whole["choices"][0]["message"]["content"] == text[: text.find(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert last["usage"] == whole["usage"]


def test_a_slow_reader_gets_every_token(chunky_server):
    """The client reads one line per 20 ms while the engine runs ahead: the stream's chunks
    grow instead of queueing, and the text and token ids arrive whole."""
    body = _greedy(prompt="The slow reader", max_tokens=NUM_TOKENS)
    whole = httpx.post(f"{chunky_server.url}/v1/completions", json=body, timeout=60).json()
    *chunks, last = _stream(chunky_server, "completions", body, read_delay_s=0.02)
    token_ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert token_ids == whole["choices"][0]["token_ids"]
    assert last["usage"]["completion_tokens"] == NUM_TOKENS
    chunky_server.wait_idle()


def test_every_stream_leaves_the_pacer_refused_finished_or_abandoned(chunky_server):
    """The pacing interval counts open streams: a stream the engine refused (prompt longer
    than the context), one that finished and one whose client left all stop counting."""
    url = f"{chunky_server.url}/v1/completions"
    pacer = chunky_server.state.engine_loop.pacer
    refused = _greedy(prompt="word " * 200, stream=True)
    assert httpx.post(url, json=refused, timeout=60).status_code == 400
    _stream(chunky_server, "completions", _greedy(prompt="Finished"))
    with httpx.stream("POST", url, json=_greedy(prompt="Left", max_tokens=100, stream=True),
                      timeout=60) as response:  # fmt: skip
        next(response.iter_lines())
    chunky_server.wait_idle()
    deadline = time.monotonic() + 10
    while pacer.num_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pacer.num_streams == 0


def test_a_stream_interval_sends_the_first_token_then_chunks_of_n(tiny_llama_dir):
    """EngineConfig.stream_interval (`dspark serve --stream-interval 4`): the first chunk
    carries the first token, the next ones 4 each (NUM_TOKENS - 1 is not a multiple of 4: the
    last carries the rest), and together they equal the whole response. (The pacer may join
    deltas of a lagging stream into one chunk: sizes are counted modulo 4.)"""
    live = start_server(engine_config(tiny_llama_dir, stream_interval=4))
    try:
        body = _greedy(prompt="Once upon a time")
        whole = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
        *chunks, last = _stream(live, "completions", body)
    finally:
        live.stop()
    sizes = [len(c["choices"][0]["token_ids"]) for c in chunks]
    assert sizes[0] % 4 == 1 and all(n % 4 == 0 for n in sizes[1:-1]), sizes
    assert len(chunks) > 2 and sizes[-1] % 4 == (NUM_TOKENS - 1) % 4, sizes
    token_ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert token_ids == whole["choices"][0]["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert last["usage"] == whole["usage"]


# ---- streams decoded by the server (output_kind "delta_tokens") ----------------------------


def test_a_stream_decodes_token_only_updates_once_per_chunk_across_split_characters():
    """The engine sends tokens only; the stream decodes each coalesced update. A character
    split over updates waits for its last byte's token, and the texts add up to the full
    decode (emoji and CJK span several byte-level tokens)."""
    from dspark.engine.detokenizer import Detokenizer
    from dspark.models.loader import resolve_model
    from dspark.models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model("default"))
    ids = tok.encode("Unicode: café 日本語 🚀🚀 done")

    async def scenario() -> list[str]:
        stream = RequestStream(["a"], abort=lambda ids: None, decoders=[Detokenizer(tok)])
        loop, updates, texts = asyncio.get_running_loop(), stream.updates(), []
        for i, token in enumerate(ids):  # one update per token: every split is met
            last = i == len(ids) - 1
            final = FinalInfo("length", None, 1, len(ids), None, {}) if last else None
            stream.put(0, DeltaOutput("a", "", [token], None, final), loop.time())
            texts.append((await updates.__anext__())[0].text)
        return texts

    texts = asyncio.run(scenario())
    assert "".join(texts) == tok.decode(ids)
    assert "" in texts  # (some token completed no character: its update carried no text)


def test_streams_decoded_by_the_server_or_the_engine_send_the_same_text(tiny_llama_dir):
    """`stream_detokenize` "server" (the default: the engine is sent "delta_tokens") and
    "engine" stream the same text and tokens as the whole response; a stream with stop
    strings is decoded by the engine either way."""
    body = _greedy(prompt="Once upon a time, far away")
    texts = {}
    for mode in ("server", "engine"):
        live = start_server(engine_config(tiny_llama_dir), stream_detokenize=mode)
        try:
            whole = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
            *chunks, _ = _stream(live, "completions", body)
            texts[mode] = "".join(c["choices"][0]["text"] for c in chunks)
            assert texts[mode] == whole["choices"][0]["text"]
            tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
            assert tokens == whole["choices"][0]["token_ids"]
            assert live.state.engine_loop.decode_streams == (mode == "server")
        finally:
            live.stop()
    assert texts["server"] == texts["engine"]


def test_token_only_outputs_refuse_stop_strings():
    from dspark.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="delta_tokens.*stop strings"):
        SamplingParams(output_kind="delta_tokens", stop=["END"])
    SamplingParams(output_kind="delta_tokens", stop_token_ids=[2])  # (ids need no decoding)


def test_the_pacer_leaves_decoding_out_of_a_chunks_cost(monkeypatch):
    """Decoding is paid per token, however tokens are grouped: counted per chunk, it would
    lengthen the interval, so chunks would carry more tokens and cost more, without end. A
    decode that takes 1 s (on the stream's own clock) leaves the recorded cost at the
    consumer's 2 ms."""
    import types

    from dspark.engine.detokenizer import Detokenizer
    from dspark.models.loader import resolve_model
    from dspark.models.tokenizer import load_tokenizer
    from dspark.server import request_stream

    clock = [0.0]
    monkeypatch.setattr(request_stream, "time", types.SimpleNamespace(thread_time=lambda: clock[0]))

    class SlowDecoder(Detokenizer):
        def add_tokens(self, new_tokens):
            clock[0] += 1.0
            return super().add_tokens(new_tokens)

    tok = load_tokenizer(resolve_model("default"))
    pacer = StreamPacer(budget=0.1)

    async def scenario() -> None:
        stream = RequestStream(["a"], lambda ids: None, pacer, decoders=[SlowDecoder(tok)])
        loop, updates = asyncio.get_running_loop(), stream.updates()
        for token in tok.encode("Hello there"):
            stream.put(0, DeltaOutput("a", "", [token], None, None), loop.time())
            await updates.__anext__()
            clock[0] += 0.002  # the consumer's own work on the chunk
        stream.put(0, _out("", finished=True), loop.time())
        await updates.__anext__()

    asyncio.run(scenario())
    assert pacer.cpu_per_chunk_s == pytest.approx(0.002)
