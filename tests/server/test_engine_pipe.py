"""The server's end of the engine pipe: whole messages from bytes split anywhere, read without
waiting for the rest of a message in transit, also when the event loop made the fd non-blocking
(uvloop does, for every fd it watches)."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import pickle
import struct
import subprocess
import sys
import threading
import time

from dspark.engine.collector import STEP_LOOP_THRESHOLDS
from dspark.server import wire
from dspark.server.engine_loop import EngineLoop, EngineState
from dspark.server.output_sender import send_whole
from dspark.server.wire import EngineInfo, EngineStats, FrameReader


def frame(message) -> bytes:
    payload = pickle.dumps(message)
    return struct.pack("!i", len(payload)) + payload


def test_frames_split_at_every_byte_are_read_whole_and_in_order():
    messages = [(wire.STEP, [("a", "Hi", [5], None, None)], None), (wire.STOPPED,), ("x" * 300,)]
    stream = b"".join(frame(m) for m in messages)
    for cut in range(len(stream) + 1):
        reader = FrameReader()
        got = reader.feed(stream[:cut]) + reader.feed(stream[cut:])
        assert got == messages, cut
        assert reader.num_pending_bytes == 0
    reader = FrameReader()
    got = [m for byte in range(len(stream)) for m in reader.feed(stream[byte : byte + 1])]
    assert got == messages


def test_a_frame_with_the_long_length_header_is_read():
    """Connection's framing for 2 GiB and more: -1, then the length as "!Q"."""
    payload = pickle.dumps((wire.FAILED, "reason"))
    stream = struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload + frame((1,))
    reader = FrameReader()
    assert reader.feed(stream[:7]) == []  # (the long header itself split)
    assert reader.feed(stream[7:]) == [(wire.FAILED, "reason"), (1,)]


def test_a_frame_is_exactly_what_connection_send_and_send_whole_write():
    reader_conn, writer_conn = multiprocessing.Pipe()
    message = (wire.STEP, [("b", "y" * 100_000, [1] * 1000, None, None)], ("stats",))
    for send in (writer_conn.send, lambda m: send_whole(writer_conn, m)):
        thread = threading.Thread(target=send, args=(message,))
        thread.start()
        reader, got = FrameReader(), []
        while not got:
            got = reader.feed(os.read(reader_conn.fileno(), 1 << 16))
        thread.join(timeout=10)
        assert got == [message]


def _engine_loop_on_a_pipe(loop) -> tuple[EngineLoop, multiprocessing.connection.Connection]:
    engine_loop = EngineLoop(lambda: None, max_queued_requests=1, max_queued_tokens=1)
    engine_loop._loop = loop
    engine_loop._conn, child = multiprocessing.Pipe()
    return engine_loop, child


def test_a_large_message_on_a_non_blocking_pipe_is_read_whole():
    """8 MB, far more than a socket buffer holds, read as the event loop would: a `_read` each
    time the pipe is readable, until the message is whole."""

    async def read_ready() -> EngineLoop:
        engine_loop, child = _engine_loop_on_a_pipe(asyncio.get_running_loop())
        os.set_blocking(engine_loop._conn.fileno(), False)  # as uvloop leaves it
        info = EngineInfo("x" * 8_000_000, 4096, 256, os.getpid())  # (a large tokenizer)
        sender = threading.Thread(target=child.send, args=((wire.READY, info),))
        sender.start()
        deadline = time.monotonic() + 10
        while engine_loop.state == EngineState.LOADING and time.monotonic() < deadline:
            if engine_loop._conn.poll(0):
                engine_loop._read()
            else:
                await asyncio.sleep(0.001)
        sender.join(timeout=10)
        assert not sender.is_alive(), "the message was not read to its end"
        return engine_loop

    engine_loop = asyncio.run(read_ready())
    assert engine_loop.state == EngineState.SERVING and engine_loop.failure is None
    assert engine_loop.info.max_model_len == 4096 and len(engine_loop.info.tokenizer) == 8_000_000


def test_a_read_returns_at_once_when_a_message_is_still_in_transit():
    """Half a frame on the pipe: `_read` takes it and returns (Connection.recv would wait for
    the rest with the event loop stopped); the rest completes the message at the next read."""

    async def read_in_halves() -> tuple[EngineLoop, float]:
        engine_loop, child = _engine_loop_on_a_pipe(asyncio.get_running_loop())
        data = frame((wire.READY, EngineInfo("tok", 2048, 256, os.getpid())))
        half = len(data) // 2
        os.write(child.fileno(), data[:half])
        rest = threading.Timer(1.0, os.write, (child.fileno(), data[half:]))
        rest.start()  # (a read that waits for the rest returns after a second, not never)
        start = time.perf_counter()
        engine_loop._read()
        took = time.perf_counter() - start
        if took < 1.0:
            assert engine_loop.state == EngineState.LOADING  # nothing whole yet
        rest.join()
        engine_loop._read()
        return engine_loop, took

    thresholds = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # (the default: an earlier READY in this process raised it)
    try:
        engine_loop, took = asyncio.run(read_in_halves())
        # serving: the start-up heap frozen, young collections rarer (engine/collector.py)
        assert gc.get_freeze_count() > 0 and gc.get_threshold() == STEP_LOOP_THRESHOLDS
    finally:
        gc.set_threshold(*thresholds)
    assert took < 0.5, f"the read waited {took:.2f} s for the rest of the message"
    assert engine_loop.state == EngineState.SERVING and engine_loop.info.max_model_len == 2048


def test_the_tokenizers_backend_is_imported_while_the_engine_loads():
    """The READY message's tokenizer is unpickled on the event loop; transformers' import is
    most of that, so watching the pipe (while the engine still loads) imports it first. In a
    fresh interpreter: not imported by the server's modules, imported once the pipe is watched."""
    code = """
import asyncio, multiprocessing, sys
from dspark.server.engine_loop import EngineLoop
before = "transformers" in sys.modules

async def watch():
    engine_loop = EngineLoop(lambda: None, max_queued_requests=1, max_queued_tokens=1)
    conn, _ = multiprocessing.Pipe()
    engine_loop.attach(conn)

asyncio.run(watch())
print(before, "transformers" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_admission_counts_the_submissions_the_engine_has_not_acknowledged():
    """The queue limits count what was sent and not yet acknowledged beside what the engine
    reports waiting (here its one seat is taken, so every submission would wait); an
    acknowledgement, accepted or refused, frees its share."""
    import pytest

    from dspark.sampling_params import SamplingParams
    from dspark.server.engine_loop import SubRequest
    from dspark.server.errors import APIError

    stats = (1, 0, 0, 0, 8, 0, 0, 0, None, None)  # the engine: its seat taken, nothing waiting

    def subs(name: str) -> list[SubRequest]:
        return [SubRequest(name, [1] * 10, SamplingParams(max_tokens=1))]

    async def scenario() -> None:
        engine_loop = EngineLoop(lambda: None, max_queued_requests=2, max_queued_tokens=100)
        engine_loop._loop = asyncio.get_running_loop()
        engine_loop._conn, child = multiprocessing.Pipe()
        engine_loop.state, engine_loop.info = EngineState.SERVING, EngineInfo(None, 64, 1, 0)
        engine_loop.stats = EngineStats(num_running=1)
        first = asyncio.ensure_future(engine_loop.submit(subs("a")))
        second = asyncio.ensure_future(engine_loop.submit(subs("b")))
        await asyncio.sleep(0)  # both sent, neither acknowledged
        with pytest.raises(APIError) as full:
            await engine_loop.submit(subs("c"))
        assert full.value.code == "queue_full"
        assert "(2 requests and 20 prompt tokens waiting" in str(full.value)
        ack_a, ack_b = (child.recv()[1] for _ in range(2))
        engine_loop._acknowledge(((ack_a, None),), stats)
        await first
        third = asyncio.ensure_future(engine_loop.submit(subs("c")))  # room for one again
        await asyncio.sleep(0)
        refusal = (wire.INVALID, "a token outside the vocabulary")
        engine_loop._acknowledge(((ack_b, refusal),), stats)
        with pytest.raises(APIError) as refused:
            await second
        assert refused.value.status == 400
        assert (engine_loop._num_pending_requests, engine_loop._num_pending_tokens) == (1, 10)
        engine_loop._acknowledge(((child.recv()[1], None),), stats)
        await third
        assert (engine_loop._num_pending_requests, engine_loop._num_pending_tokens) == (0, 0)

    asyncio.run(scenario())
