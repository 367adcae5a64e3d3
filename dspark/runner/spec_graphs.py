"""CUDA graphs for fixed-K speculative steps: one captured step per (batch size G, sampling mode).

A captured step is the whole speculative step of SpecDecoder.step: the drafter block forward and
its Markov loop, the drafts scattered into the target's inputs, the target forward over
V = G * (K + 1) tokens, the drafter context append, verification. Its inputs are the persistent
InputBuffers and SpecBuffers; a live step of R <= G full windows pads rows R..G-1 with pad
windows on the scratch page and dummy identities (greedy, seed 0).

Sampling work depends on host flags (greedy, top-k/top-p filtering), so each size is captured in
three modes: GREEDY (every row greedy), TEMPERATURE (no row filters) and FILTERED (the general
case: rows without filters pass through top-k = vocab, top-p = 1).

A mixed step (windows, then a tail of prefill chunks and plain rows: a request admitted while
others draft) is captured too, per (G, P): G windows, then MAX_TAIL_ROWS tail rows holding P
tokens in all (runner/mixed_layout.py). Its sampling modes are GREEDY and FILTERED only (a
TEMPERATURE step replays FILTERED, where filters pass through), so that the ladder of G times
the tail sizes stays cheap to capture.

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
TAIL_MODES = (GREEDY, FILTERED)


def window_layout(num_rows: int, width: int) -> StepLayout:
    """G windows of `width` tokens, every token scored; host mirrors are upper bounds."""
    return StepLayout(
        num_tokens=num_rows * width,
        num_rows=num_rows,
        num_logits=num_rows * width,
        cu_num_tokens_cpu=tuple(range(0, (num_rows + 1) * width, width)),
        seq_lens_cpu=(width,) * num_rows,
    )


def graph_mode(mode: SamplingMode, tail: int = 0) -> SamplingMode:
    """The captured mode that serves a live step's sampling needs (tail: its P, 0 if none)."""
    if mode.all_greedy:
        return GREEDY
    return FILTERED if (mode.any_top_k or mode.any_top_p or tail) else TEMPERATURE


class SpecGraphs:
    def __init__(
        self,
        step: Callable[[int, int, SamplingMode], SpecStepOutput],  # SpecDecoder.step, (G, P)
        prepare: Callable[[int, int], None],  # fills the buffers with G pad windows, P tail
        sizes: list[int],
        tails: tuple[int, ...] = (),  # P of the mixed steps captured beside each G
        modes: tuple[SamplingMode, ...] = MODES,
    ) -> None:
        self.sizes = sorted(sizes)
        self.tails = tuple(sorted(tails))
        self.modes = modes
        self._graphs: dict[tuple[int, int, SamplingMode], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int, SamplingMode], SpecStepOutput] = {}
        self._capture(step, prepare)

    @torch.inference_mode()
    def _capture(self, step, prepare) -> None:
        pool = torch.cuda.graph_pool_handle()
        for g in reversed(self.sizes):
            for tail in (*reversed(self.tails), 0):
                for mode in TAIL_MODES if tail else self.modes:
                    prepare(g, tail)
                    step(g, tail, mode)  # warm-up: compiles kernels, settles the allocator
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._outputs[g, tail, mode] = step(g, tail, mode)
                    self._graphs[g, tail, mode] = graph
        torch.cuda.synchronize()
        logger.info("captured %d speculative CUDA graphs: sizes %s x %d sampling modes, and "
                    "mixed steps with tails of %s tokens", len(self._graphs), self.sizes,
                    len(self.modes), list(self.tails))  # fmt: skip

    def replay(self, size: int, mode: SamplingMode, tail: int = 0) -> SpecStepOutput:
        key = (size, tail, graph_mode(mode, tail))
        self._graphs[key].replay()
        return self._outputs[key]
