"""The server's end of the engine pipe reads whole messages even when the event loop made its
fd non-blocking (uvloop does, for every fd it watches)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading

from dspark.server import wire
from dspark.server.engine_loop import EngineLoop, EngineState
from dspark.server.wire import EngineInfo


def test_a_large_message_on_a_non_blocking_pipe_is_read_whole():
    """8 MB, far more than a socket buffer holds: poll() reports the pipe readable once the
    first part is there, and a non-blocking read would stop mid-message."""

    async def read_ready() -> EngineLoop:
        engine_loop = EngineLoop(lambda: None, max_queued_requests=1, max_queued_tokens=1)
        engine_loop._loop = asyncio.get_running_loop()
        engine_loop._conn, child = multiprocessing.Pipe()
        os.set_blocking(engine_loop._conn.fileno(), False)  # as uvloop leaves it
        info = EngineInfo("x" * 8_000_000, 4096, os.getpid())  # (a large tokenizer)
        sender = threading.Thread(target=child.send, args=((wire.READY, info),))
        sender.start()
        while not engine_loop._conn.poll(0):
            await asyncio.sleep(0.001)
        engine_loop._read()
        sender.join(timeout=10)
        assert not sender.is_alive(), "the message was not read to its end"
        return engine_loop

    engine_loop = asyncio.run(read_ready())
    assert engine_loop.state == EngineState.SERVING and engine_loop.failure is None
    assert engine_loop.info.max_model_len == 4096 and len(engine_loop.info.tokenizer) == 8_000_000
