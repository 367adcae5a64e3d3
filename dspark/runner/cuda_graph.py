"""CUDA graphs for decode steps: one captured forward per batch size G of the ladder.

Captured at start-up, largest first, sharing one memory pool; never captured on the fly. A live
decode batch of B rows replays the smallest G >= B, with rows B..G-1 as pad rows on the scratch
page (InputBuffers.write_pad_rows). Inputs are the persistent InputBuffers; the output is the
first rows of one logits buffer [rows of the largest graph, vocab] that every graph of the set
writes (graph_logits), valid until the next replay of any of them.

With a tail size P, each G also gets a mixed graph (G, P): G decode rows, then a tail of prefill
chunks of up to P tokens in all (requests admitted while the others decode). It is the layout
of a mixed speculative step with windows one token wide (runner/mixed_layout.py), and its
logits are [G + R, vocab]: the decode rows', then one per tail row. A step of prefill chunks
alone that fits the tail replays the (1, P) graph with a pad decode row
(StepStager._mixed_decode_graph, runner/staging.py).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator

import torch

from dspark.runner.input_buffers import InputBuffers, StepLayout
from dspark.runner.mixed_layout import graph_tail_rows, prepare_capture

logger = logging.getLogger(__name__)

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def graph_ladder(max_num_seqs: int, sizes: tuple[int, ...] = DEFAULT_GRAPH_SIZES) -> list[int]:
    """Sizes up to max_num_seqs, plus max_num_seqs itself so every batch has a graph."""
    ladder = sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})
    return ladder


def capture_stream() -> torch.cuda.Stream:
    """A graph set's own capture stream, not torch.cuda.graph's class-wide default.

    cuBLAS keeps a workspace per (handle, stream); one first used inside a capture comes from
    that graph's memory pool, and recent PyTorch drops a stream's workspace when a graph
    captured on it is destroyed (pytorch/pytorch#193402). On the shared default stream, the
    graphs of several engines in one process (benchmark arms, tests, a notebook's second LLM)
    share that workspace, so freeing one engine's graphs can pull it from under another's
    capture or replay. That is the likely cause of CUBLAS_STATUS_EXECUTION_FAILED in the
    capture of a later engine, which failed `test_captured_trimmed_cells_equal_the_eager_step`
    in 7 of 8 processes on the H200. A stream per graph
    set keeps each set's workspace its own; with it that error did not recur.
    """
    return torch.cuda.Stream()


def graph_logits(num_rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The one float32 logits buffer [rows of the set's largest step, vocab] that every graph of
    a set writes its logits into (its first rows).

    A graph keeps its outputs at fixed addresses. Kept per graph, the logits alone would hold a
    float32 vocabulary row per scored position in every graph: for Qwen3-8B's 151,936 entries,
    256 windows of K + 1 = 8 positions are 1.2 GB a graph, and the speculative set's three
    sampling modes, mixed steps and smaller sizes held 16.2 GB, so the K = 7 capture ran out of
    memory on an 80 GB H100 (docs/PERFORMANCE.md, Real targets). Graphs of a set never replay
    at once, and whatever reads a step's logits is queued behind that step, before the next
    replay: one buffer serves them all. It lives outside the graphs' pool, which then holds one
    capture's temporaries (reused by the next capture) and each graph's small outputs."""
    return torch.empty(num_rows, vocab_size, device=device)


def reserved_gb(device: torch.device | None = None) -> float:
    """Memory the caching allocator holds now (graph pools included), in GiB: read before and
    after a graph set's capture, what the capture took (its pool and its eager runs' cache)."""
    return torch.cuda.memory_reserved(device) / 2**30


def captured(run: Callable, args: tuple, pool, stream: torch.cuda.Stream):
    """(graph, output): run(*args) once eagerly (compiles kernels, settles the allocator), then
    captured into `pool` on `stream`. Called inside `no_garbage_collection()`."""
    run(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        output = run(*args)
    return graph, output


@contextlib.contextmanager
def no_garbage_collection() -> Iterator[None]:
    """Collect garbage once, then keep Python's collector off while graphs are captured.

    An engine's objects form reference cycles, so a dropped engine (a benchmark's earlier arm,
    a test's earlier LLM) is freed by the cyclic collector, which runs whenever allocations
    trigger it. Freed inside another engine's capture, its CUDA graphs and their memory pool
    are released there, and that CUDA work invalidates the capture ("operation failed due to a
    previous error during capture"): it failed one capture in four processes of
    `test_captured_trimmed_cells_equal_the_eager_step` on the H200 even with a stream per graph
    set. torch.cuda.graph no longer collects before a
    capture (torch.compiler.config.force_cudagraph_gc), so the collection happens here, before
    the first capture of a set, and none can happen during one."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def decode_layout(num_rows: int) -> StepLayout:
    """G rows of one token each; host mirrors are upper bounds for the kernels' grids."""
    return StepLayout(
        num_tokens=num_rows,
        num_rows=num_rows,
        num_logits=num_rows,
        cu_num_tokens_cpu=tuple(range(num_rows + 1)),
        seq_lens_cpu=(1,) * num_rows,
    )


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[..., torch.Tensor],  # (layout, logits_out): the model on the buffers
        buffers: InputBuffers,
        sizes: list[int],
        vocab_size: int,
        tail_tokens: int = 0,  # P of the mixed graphs (0: none)
    ) -> None:
        self.buffers = buffers
        self.sizes = sorted(sizes)
        self.tail_tokens = tail_tokens
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (G, P; 0: no tail)
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        tail_rows = graph_tail_rows(tail_tokens) if tail_tokens else 0
        self.logits = graph_logits(self.sizes[-1] + tail_rows, vocab_size, buffers.device)
        self._capture(forward)

    @torch.inference_mode()
    def _capture(self, forward: Callable[..., torch.Tensor]) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream()
        before = reserved_gb(self.buffers.device)
        tails = (self.tail_tokens, 0) if self.tail_tokens else (0,)
        with no_garbage_collection():
            for g in reversed(self.sizes):  # largest first: later graphs reuse its pool blocks
                for tail in tails:
                    if tail:
                        layout = prepare_capture(self.buffers, g, 1, tail, graph_tail_rows(tail))
                    else:
                        layout = decode_layout(g)
                        self.buffers.write_pad_rows(0, 0, g)
                        self.buffers.np("logits_indices")[:g] = range(g)
                    self.buffers.upload(layout)
                    logits = self.logits[: layout.num_logits]
                    self._graphs[g, tail], self._outputs[g, tail] = captured(
                        forward, (layout, logits), pool, stream
                    )
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs: %s%s (%.2f GiB reserved by the capture)",
                    len(self._graphs), self.sizes,
                    f", with and without a tail of {self.tail_tokens} prefill tokens"
                    if self.tail_tokens else "",
                    reserved_gb(self.buffers.device) - before)  # fmt: skip

    def output(self, size: int, tail: int = 0) -> torch.Tensor:  # [G (+ R with a tail), vocab]
        """The logits graph (size, tail) writes on every replay (a fixed address)."""
        return self._outputs[size, tail]

    def replay(self, size: int, tail: int = 0) -> torch.Tensor:  # [G (+ R with a tail), vocab]
        self.buffers.check_pointers()
        self._graphs[size, tail].replay()
        return self._outputs[size, tail]
