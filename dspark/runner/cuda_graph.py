"""CUDA graphs for decode steps: one captured forward per batch size G of the ladder.

Captured at start-up, largest first, sharing one memory pool; never captured on the fly. A live
decode batch of B rows replays the smallest G >= B, with rows B..G-1 as pad rows on the scratch
page (InputBuffers.write_pad_rows). Inputs are the persistent InputBuffers; the output is each
graph's own logits tensor [G, vocab], valid until the next replay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from dspark.runner.input_buffers import InputBuffers, StepLayout

logger = logging.getLogger(__name__)

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def graph_ladder(max_num_seqs: int, sizes: tuple[int, ...] = DEFAULT_GRAPH_SIZES) -> list[int]:
    """Sizes up to max_num_seqs, plus max_num_seqs itself so every batch has a graph."""
    ladder = sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})
    return ladder


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
        forward: Callable[[StepLayout], torch.Tensor],  # runs the model on the buffers
        buffers: InputBuffers,
        sizes: list[int],
    ) -> None:
        self.buffers = buffers
        self.sizes = sorted(sizes)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._capture(forward)

    @torch.inference_mode()
    def _capture(self, forward: Callable[[StepLayout], torch.Tensor]) -> None:
        pool = torch.cuda.graph_pool_handle()
        for g in reversed(self.sizes):  # largest first: later graphs reuse its pool blocks
            layout = decode_layout(g)
            self.buffers.write_pad_rows(0, 0, g)
            self.buffers.np("logits_indices")[:g] = range(g)
            self.buffers.upload(layout)
            forward(layout)  # warm-up: compiles kernels, settles the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[g] = forward(layout)
            self._graphs[g] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs: %s", len(self.sizes), self.sizes)

    def replay(self, size: int) -> torch.Tensor:  # [G, vocab]
        self.buffers.check_pointers()
        self._graphs[size].replay()
        return self._outputs[size]
