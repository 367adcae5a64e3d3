"""The engine process's sender: a slow reader gets merged step outputs, in order, nothing lost."""

from __future__ import annotations

import multiprocessing
import threading
import time

from dspark.server import wire
from dspark.server.output_sender import OutputSender


def _read_all(conn, until_tag: str) -> list[tuple]:
    messages = []
    while True:
        message = conn.recv()
        messages.append(message)
        if message[0] == until_tag:
            return messages


def test_a_blocked_send_merges_the_steps_behind_it_and_keeps_order():
    reader, writer = multiprocessing.Pipe(duplex=False)
    sender = OutputSender(writer, on_closed_exit=3)
    big = "x" * 200_000  # more than a pipe buffer: the first send blocks until read
    sender.post_step([("a", big, [1], None, None)], ("stats", 0))
    time.sleep(0.2)  # the sender thread is now blocked in that send
    sender.post_step([("a", "He", [5], [-0.5], None)], ("stats", 1))
    sender.post_step([("a", "llo", [7], [-0.25], None), ("b", "Hi", [9], None, None)], ("stats", 2))
    # a final-only output with its prompt's logprobs (a sixth element) keeps them in a merge
    sender.post_step([("c", "Yo", [4], None, ("stop", 2), [None, {3: -0.5}])], ("stats", 2))
    sender.post_step([("a", "!", [2], [-1.0], ("length", 4))], ("stats", 3))
    sender.post_step([("a", "new", [8], None, None)], ("stats", 4))  # the id reused after its final
    sender.send((wire.STOPPED,))
    messages = _read_all(reader, wire.STOPPED)
    assert sender.drain(timeout=5)
    steps = [m for m in messages if m[0] == wire.STEP]
    assert [m[0] for m in messages][-1] == wire.STOPPED  # after every output posted before it
    assert steps[0] == (wire.STEP, [("a", big, [1], None, None)], ("stats", 0))
    # steps 2-4 met the busy pipe: merged per request, the newest stats; the reused id after
    assert steps[1] == (
        wire.STEP,
        [
            ("a", "Hello!", [5, 7, 2], [-0.5, -0.25, -1.0], ("length", 4)),
            ("b", "Hi", [9], None, None),
            ("c", "Yo", [4], None, ("stop", 2), [None, {3: -0.5}]),
        ],
        ("stats", 3),
    )
    assert steps[2] == (wire.STEP, [("a", "new", [8], None, None)], ("stats", 4))
    assert sender.num_steps_posted == 6 and sender.num_step_messages == 3
    # the thread's own clock: 4 messages sent, the first blocked until the reader came
    assert sender.times.counts["message"] == 4 and sender.times.seconds["message"] > 0.1


def test_a_fast_reader_gets_one_message_per_step():
    reader, writer = multiprocessing.Pipe(duplex=False)
    sender = OutputSender(writer, on_closed_exit=3)
    received = []
    thread = threading.Thread(target=lambda: received.extend(_read_all(reader, wire.STOPPED)))
    thread.start()
    for i in range(20):
        sender.post_step([("r", str(i), [i], None, None)], ("stats", i))
        assert sender.drain(timeout=5)  # each step is on the wire before the next is posted
    sender.send((wire.STOPPED,))
    thread.join(timeout=5)
    texts = [m[1][0][1] for m in received if m[0] == wire.STEP]
    assert texts == [str(i) for i in range(20)]


def test_a_message_is_written_whole_in_the_framing_connection_recv_reads(monkeypatch):
    """send_whole: one write per message (header and pickle together), read back by recv(), for
    a small message and one far over multiprocessing's 16 KiB split and the pipe's buffer."""
    import os

    from dspark.server import output_sender
    from dspark.server.output_sender import send_whole

    writes = []
    write = os.write

    def counting_write(fd, data):
        writes.append(len(data))
        return write(fd, data)

    monkeypatch.setattr(output_sender.os, "write", counting_write)
    reader, writer = multiprocessing.Pipe()
    small = (wire.STEP, [("a", "Hi", [5], None, None)], ("stats", 1))
    large = (wire.STEP, [("b", "y" * 1_000_000, [1] * 1000, None, None)], None)
    for message in (small, large):
        writes.clear()
        received = []
        thread = threading.Thread(target=lambda out=received: out.append(reader.recv()))
        thread.start()
        send_whole(writer, message)
        thread.join(timeout=10)
        assert received == [message]
        assert len(writes) == 1  # (a blocking socket takes the whole buffer in one call)


def test_metrics_are_sent_when_due_and_never_lost_in_a_merge(tiny_vocab_dir, monkeypatch):
    """The engine loop sends its two metrics parts (get_metrics(), the request metrics) every
    METRICS_INTERVAL_S; between, the request metrics go whenever they changed (a request ended),
    the speculative part only once nothing is left to run. A part left out keeps the previous
    one, on the server (merge_stats) and in a merged message (the sender)."""
    from dspark import LLM, SamplingParams
    from dspark.server import engine_process
    from dspark.server.engine_process import METRICS_INTERVAL_S, EngineServer
    from dspark.server.wire import EngineStats, merge_stats

    clock = [100.0]
    # (the module's own name: patching time.monotonic would stop the event loops of the
    # session's live servers, which run in this process)
    monkeypatch.setattr(engine_process, "monotonic", lambda: clock[0])
    engine = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=32).engine
    loop = EngineServer(engine, conns=[], senders=[])
    assert loop._stats()[-2:] != (None, None)  # due at once
    assert loop._stats()[-2:] == (None, None)
    assert loop._stats(requests_changed=True)[-2] is not None  # nothing runs: both go
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4))
    spec, requests = loop._stats(requests_changed=True)[-2:]
    assert spec is None and requests is not None  # one still runs: the dear part waits
    clock[0] += METRICS_INTERVAL_S
    assert None not in loop._stats()[-2:]
    before = EngineStats(spec={"num_drafts": 3}, requests=(5, 6, {}, {}, ()))
    kept = EngineStats(1, 0, 0, 2, 8, 0, 40, 32, {"num_drafts": 3}, (5, 6, {}, {}, ()))
    assert merge_stats(before, (1, 0, 0, 2, 8, 0, 40, 32, None, None)) == kept
    assert merge_stats(before, (1, 0, 0, 2, 8, 0, 40, 32, {}, None)).spec == {}
    assert merge_stats(before, (1, 0, 0, 2, 8, 0, 40, 32, None, ())).requests == ()
    reader, writer = multiprocessing.Pipe(duplex=False)
    sender = OutputSender(writer, on_closed_exit=3)
    big = "x" * 200_000  # blocks the first send: the next three steps merge
    sender.post_step([("a", big, [1], None, None)], (0, 0, 0, 0, 8, 0, 0, 0, None, None))
    time.sleep(0.2)
    sender.post_step([("a", "b", [2], None, None)], (1, 0, 0, 1, 8, 0, 0, 0, {"num_drafts": 5}, ()))
    sender.post_step([("a", "c", [3], None, None)], (1, 0, 0, 1, 8, 0, 0, 0, None, (7,)))
    sender.post_step([("a", "d", [4], None, None)], (1, 0, 0, 1, 8, 0, 0, 0, None, None))
    sender.send((wire.STOPPED,))
    steps = [m for m in _read_all(reader, wire.STOPPED) if m[0] == wire.STEP]
    assert steps[-1][2] == (1, 0, 0, 1, 8, 0, 0, 0, {"num_drafts": 5}, (7,))


def test_a_sender_of_one_of_several_servers_stops_when_its_pipe_closes():
    """With several API processes the engine must outlive one of them: that sender (no exit
    status) stops and drops what is posted after, instead of ending the process."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    sender = OutputSender(writer, on_closed_exit=None)
    reader.close()  # the API process is gone
    sender.post_step([("a", "x", [1], None, None)], (0, 0, 0, 0, 8, 0, 0, 0, None, None))
    deadline = time.monotonic() + 5
    while not sender.closed:
        assert time.monotonic() < deadline, "the sender did not notice the closed pipe"
        time.sleep(0.01)
    sender.post_step([("a", "y", [2], None, None)], (0, 0, 0, 0, 8, 0, 0, 0, None, None))  # dropped
    sender.send((wire.STOPPED,))
    assert sender.drain(timeout=1.0)  # nothing left waiting


def test_a_step_posted_while_the_sender_keeps_up_goes_out_as_it_came():
    """The usual case (kept as posted, not merged): the message holds the step's outputs
    exactly, logprobs and final included."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    sender = OutputSender(writer, on_closed_exit=3)
    outputs = [("a", "x", [1, 2], None, None), ("b", "", [3], [{3: -0.1}], ("stop", None))]
    sender.post_step(outputs, ("stats", 0))
    assert sender.drain(timeout=5)
    assert reader.recv() == (wire.STEP, outputs, ("stats", 0))


def test_bench_sender_cost_runs(capsys):
    from tests.helpers import bench_module

    bench_module("serving").main(["sender-cost", "--outputs", "8", "--steps", "20"])
    assert "8 outputs a step, 20 steps: post_step median" in capsys.readouterr().out
