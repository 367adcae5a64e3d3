"""What crosses the pipe between the server process and the engine process (engine_process.py).

Messages are plain tuples, a tag first: pickle writes tuples, lists, strings and numbers in C,
while a dataclass or a named tuple goes through Python per object (3 to 4x slower to pickle,
measured on 256 outputs). So outputs travel as the tuples of DeltaOutput's fields and are
rebuilt on the server's side, and the stats snapshot as a tuple of EngineStats' fields.

    server -> engine   (ADD, ack_id, ((request_id, prompt_ids, SamplingParams, prompt_text), ..))
                       (ABORT, (request_id, ...))
                       (STOP,)
    engine -> server   (READY, EngineInfo)                    once, when the engine is built
                       (ADDED, ((ack_id, error | None), ..), stats)   error: (kind, message)
                       (STEP, (output tuple, ..), stats)      one per step
                       (FAILED, reason)                       then the process exits
                       (STOPPED,)                             the answer to STOP, its last
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark.models.tokenizer import Tokenizer
from dspark.outputs import DeltaOutput, FinalInfo, RequestOutput

ADD, ABORT, STOP = "add", "abort", "stop"
READY, ADDED, STEP, FAILED, STOPPED = "ready", "added", "step", "failed", "stopped"
INVALID = "invalid"  # the kind of an add error that is the client's (ValueError): a 400


@dataclass(frozen=True)
class EngineStats:
    """What the engine looked like after its last step (read by /metrics and admission)."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_tokens: int = 0  # tokens the waiting requests still have to prefill
    num_kv_pages_used: int = 0
    num_kv_pages: int = 0
    num_preemptions: int = 0
    spec: dict = field(default_factory=dict)  # LLMEngine.get_metrics()


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs of the engine, sent once it is built: the tokenizer (prompts are
    encoded and chat templates rendered in the server process) and the context length."""

    tokenizer: Tokenizer
    max_model_len: int
    pid: int  # the engine process's


def stats_of(engine, with_spec: bool = True) -> tuple:
    """The engine's EngineStats, as a tuple of its fields; without `with_spec` its speculative
    metrics are None (the receiver keeps the last ones: `merge_stats`)."""
    sched, alloc = engine.scheduler, engine.allocator
    return (
        len(sched.running),
        len(sched.waiting),
        sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting),
        alloc.num_usable - alloc.num_free,
        alloc.num_usable,
        sched.num_preemptions,
        engine.get_metrics() if with_spec else None,
    )


def merge_stats(previous: EngineStats, stats: tuple) -> EngineStats:
    """A received stats tuple; speculative metrics left out (None) keep the previous ones."""
    if stats[-1] is None:
        return EngineStats(*stats[:-1], previous.spec)
    return EngineStats(*stats)


def encode_outputs(outputs: list[DeltaOutput | RequestOutput]) -> list[tuple]:
    """A step's outputs as tuples: deltas as they are, final-only outputs as one whole delta."""
    wire = []
    for out in outputs:
        if isinstance(out, RequestOutput):
            assert out.finished, f"{out.request_id}: only delta or final outputs are served"
            out = DeltaOutput.of_final(out)
        request_id, text, token_ids, logprobs, final = out
        wire.append((request_id, text, token_ids, logprobs, None if final is None else (*final,)))
    return wire


def decode_output(wire: tuple) -> DeltaOutput:
    request_id, text, token_ids, logprobs, final = wire
    return DeltaOutput(
        request_id, text, token_ids, logprobs, None if final is None else FinalInfo(*final)
    )
