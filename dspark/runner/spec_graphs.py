"""CUDA graphs for fixed-K speculative steps: one captured step per (batch size G, sampling mode).

A captured step is the whole speculative step of SpecDecoder.step: the drafter block forward and
its Markov loop, the drafts scattered into the target's inputs, the target forward over
V = G * (K + 1) tokens, the drafter context append, verification. Its inputs are the persistent
InputBuffers and SpecBuffers; a live step of R <= G full windows pads rows R..G-1 with pad
windows on the scratch page and dummy identities (greedy, seed 0).

Sampling work depends on host flags (greedy, top-k/top-p filtering), so each size is captured in
three modes: GREEDY (every row greedy), TEMPERATURE (no row filters) and FILTERED (the general
case: rows without filters pass through top-k = vocab, top-p = 1).

Captured at start-up, largest first, sharing one memory pool, like the decode graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from dspark.runner.input_buffers import StepLayout
from dspark.spec.spec_buffers import FILTERED, GREEDY, TEMPERATURE, SamplingMode
from dspark.spec.spec_decoder import SpecStepOutput

logger = logging.getLogger(__name__)

MODES = (GREEDY, TEMPERATURE, FILTERED)


def window_layout(num_rows: int, width: int) -> StepLayout:
    """G windows of `width` tokens, every token scored; host mirrors are upper bounds."""
    return StepLayout(
        num_tokens=num_rows * width,
        num_rows=num_rows,
        num_logits=num_rows * width,
        cu_num_tokens_cpu=tuple(range(0, (num_rows + 1) * width, width)),
        seq_lens_cpu=(width,) * num_rows,
    )


def graph_mode(mode: SamplingMode) -> SamplingMode:
    """The captured mode that serves a live step's sampling needs."""
    if mode.all_greedy:
        return GREEDY
    return FILTERED if (mode.any_top_k or mode.any_top_p) else TEMPERATURE


class SpecGraphs:
    def __init__(
        self,
        step: Callable[[int, SamplingMode], SpecStepOutput],  # runs SpecDecoder.step for G rows
        prepare: Callable[[int], None],  # fills the buffers with G pad windows
        sizes: list[int],
        modes: tuple[SamplingMode, ...] = MODES,
    ) -> None:
        self.sizes = sorted(sizes)
        self.modes = modes
        self._graphs: dict[tuple[int, SamplingMode], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, SamplingMode], SpecStepOutput] = {}
        self._capture(step, prepare)

    @torch.inference_mode()
    def _capture(self, step, prepare) -> None:
        pool = torch.cuda.graph_pool_handle()
        for g in reversed(self.sizes):
            for mode in self.modes:
                prepare(g)
                step(g, mode)  # warm-up: compiles kernels, settles the allocator
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[g, mode] = step(g, mode)
                self._graphs[g, mode] = graph
        torch.cuda.synchronize()
        logger.info("captured %d speculative CUDA graphs: sizes %s x %d sampling modes",
                    len(self._graphs), self.sizes, len(self.modes))  # fmt: skip

    def replay(self, size: int, mode: SamplingMode) -> SpecStepOutput:
        key = (size, graph_mode(mode))
        self._graphs[key].replay()
        return self._outputs[key]
