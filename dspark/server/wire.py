"""What crosses the pipe between the server process and the engine process (engine_process.py).

Messages are plain tuples, a tag first: pickle writes tuples, lists, strings and numbers in C,
while a dataclass or a named tuple goes through Python per object (3 to 4x slower to pickle,
measured on 256 outputs). So outputs travel as the tuples of DeltaOutput's fields and are
rebuilt on the server's side, and the stats snapshot as a tuple of EngineStats' fields.

    server -> engine   (ADD, ack_id, ((request_id, prompt_ids, SamplingParams, prompt_text,
                                   arrival_time), ..))
                       (ABORT, (request_id, ...))
                       (REJECTED, reason)     a 503 answered (counted with the requests)
                       (STOP,)
    engine -> server   (READY, EngineInfo)                    once, when the engine is built
                       (ADDED, ((ack_id, error | None), ..), stats)   error: (kind, message)
                       (STEP, (output tuple, ..), stats)      one per step
                                 output tuple = DeltaOutput's fields [+ prompt logprobs]
                       (FAILED, reason)                       then the process exits
                       (STOPPED,)                             the answer to STOP, its last

    stats = (running, waiting, waiting tokens, KV pages used, KV pages, preemptions,
             prefix cache queries, prefix cache hits (tokens),
             speculative metrics | None, the request metrics' snapshot | None)

On the pipe each message is multiprocessing.Connection's frame: its pickle's length ("!i"; -1
then "!Q" for 2 GiB and more), then the pickle. The server reads frames with `FrameReader`
from whatever bytes have arrived, never waiting for the rest of a message in transit.
"""

from __future__ import annotations

import enum
import pickle
import struct
from dataclasses import dataclass, field

from dspark.models.tokenizer import Tokenizer
from dspark.outputs import DeltaOutput, FinalInfo, RequestOutput

ADD, ABORT, REJECTED, STOP = "add", "abort", "rejected", "stop"
READY, ADDED, STEP, FAILED, STOPPED = "ready", "added", "step", "failed", "stopped"
INVALID = "invalid"  # the kind of an add error that is the client's (ValueError): a 400


class EngineState(str, enum.Enum):
    """The engine as a server process sees it (/health, /metrics, admission)."""

    LOADING = "loading"
    SERVING = "serving"
    STOPPING = "stopping"
    DEAD = "dead"


@dataclass(frozen=True)
class EngineStats:
    """What the engine looked like after its last step (read by /metrics and admission)."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_tokens: int = 0  # tokens the waiting requests still have to prefill
    num_kv_pages_used: int = 0
    num_kv_pages: int = 0
    num_preemptions: int = 0
    # automatic prefix caching, in tokens as vLLM counts them (engine/prefix_cache.py): looked
    # up at admission, and found in cached pages; 0 with caching off
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    spec: dict = field(default_factory=dict)  # LLMEngine.get_metrics()
    requests: tuple = ()  # metrics.RequestMetrics.snapshot(): every API process's requests


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs of the engine, sent once it is built: the tokenizer (prompts are
    encoded and chat templates rendered in the server process), the context length, and the
    seats (admission counts as queued only the requests that will not find one)."""

    tokenizer: Tokenizer
    max_model_len: int
    max_num_seqs: int
    pid: int  # the engine process's


def stats_of(engine, requests=None, with_spec: bool = True, with_requests: bool = True) -> tuple:
    """The engine's EngineStats as a tuple: the counts, then the engine's speculative metrics
    (get_metrics()) and `requests`' snapshot. Either part may be left out (None: the receiver
    keeps its last one, `merge_stats`): the speculative part is the dearer one, a dict built and
    pickled (with a drafting policy's realised costs, ~130 cells, 0.12 ms on the development
    CPU), the snapshot costs ~1 us."""
    sched, alloc, cache = engine.scheduler, engine.allocator, engine.prefix_cache
    snapshot = None
    if with_requests:
        snapshot = requests.snapshot() if requests is not None else ()
    return (
        len(sched.running),
        len(sched.waiting),
        sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting),
        alloc.num_usable - alloc.num_free,
        alloc.num_usable,
        sched.num_preemptions,
        cache.num_queries if cache is not None else 0,
        cache.num_hits if cache is not None else 0,
        engine.get_metrics() if with_spec else None,
        snapshot,
    )


def merge_stats(previous: EngineStats, stats: tuple) -> EngineStats:
    """A received stats tuple; a part left out (None) keeps the previous one."""
    return EngineStats(*kept_parts(stats, previous.spec, previous.requests))


def kept_parts(stats: tuple, spec, requests) -> tuple:
    """`stats` with each metrics part it leaves out (None) taken from these."""
    *counts, new_spec, new_requests = stats
    return (
        *counts,
        spec if new_spec is None else new_spec,
        requests if new_requests is None else new_requests,
    )


def encode_outputs(outputs: list[DeltaOutput | RequestOutput]) -> list[tuple]:
    """A step's outputs as tuples: deltas as they are, final-only outputs as one whole delta.
    A final-only output with prompt logprobs carries them as a sixth element (only such a
    request has them: the engine refuses prompt_logprobs on a delta request)."""
    wire = []
    for out in outputs:
        prompt_logprobs = None
        if isinstance(out, RequestOutput):
            assert out.finished, f"{out.request_id}: only delta or final outputs are served"
            prompt_logprobs = out.prompt_logprobs
            out = DeltaOutput.of_final(out)
        request_id, text, token_ids, logprobs, final = out
        final = None if final is None else (*final,)
        if prompt_logprobs is None:
            wire.append((request_id, text, token_ids, logprobs, final))
        else:
            wire.append((request_id, text, token_ids, logprobs, final, prompt_logprobs))
    return wire


def decode_output(wire: tuple) -> DeltaOutput:
    final = wire[4]  # (indexed: the tuple may have a sixth element, the prompt logprobs)
    return DeltaOutput(
        wire[0], wire[1], wire[2], wire[3], None if final is None else FinalInfo(*final)
    )


def prompt_logprobs_of(wire: tuple) -> list[dict[int, float] | None] | None:
    """The prompt logprobs an encoded output carries (RequestOutput.prompt_logprobs), or None."""
    return wire[5] if len(wire) > 5 else None


class FrameReader:
    """Connection.send's frames, from bytes as they arrive, split anywhere:

        feed(b"\\0\\0\\0\\x05" + first 3 bytes of a 5-byte pickle)   -> []
        feed(its last 2 bytes + a whole frame)                       -> [message 1, message 2]

    Connection.recv, on the other hand, reads a whole message once its first bytes are there:
    in blocking mode it waits for the rest, which on the server's event loop stops every
    stream for as long as the engine takes to write it.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()  # received, not yet a whole frame

    def feed(self, data: bytes) -> list:
        """The messages that `data` completes, in order."""
        buffer = self._buffer
        buffer += data
        messages, start = [], 0
        while len(buffer) - start >= 4:
            (size,) = struct.unpack_from("!i", buffer, start)
            header = 4
            if size == -1:  # a frame of 2 GiB or more: its length follows as "!Q"
                if len(buffer) - start < 12:
                    break
                (size,) = struct.unpack_from("!Q", buffer, start + 4)
                header = 12
            end = start + header + size
            if len(buffer) < end:
                break
            messages.append(pickle.loads(buffer[start + header : end]))
            start = end
        del buffer[:start]
        return messages

    @property
    def num_pending_bytes(self) -> int:
        """Bytes of a frame not yet whole."""
        return len(self._buffer)
