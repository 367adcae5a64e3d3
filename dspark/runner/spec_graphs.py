"""CUDA graphs for fixed-K speculative steps: one captured step per (batch size G, sampling mode).

A captured step is the whole speculative step of SpecDecoder.step: the drafter block forward and
its Markov loop, the drafts scattered into the target's inputs, the target forward over
V = G * (K + 1) tokens, the drafter context append, verification. Its inputs are the persistent
InputBuffers and SpecBuffers; a live step of R <= G full windows pads rows R..G-1 with pad
windows on the scratch page and dummy identities (greedy, seed 0).

Sampling work depends on host flags (greedy, top-k/top-p filtering), so each size is captured in
three modes: GREEDY (every row greedy), TEMPERATURE (no row filters) and FILTERED (the general
case: rows without filters pass through top-k = vocab, top-p = 1).

A mixed step (windows, then a tail of prefill chunks and plain rows: a request admitted while others
draft) is captured too, per (G, P): G windows, then max_tail_rows(P) tail rows holding P tokens in
all (runner/mixed_layout.py), in the same three modes. (A TEMPERATURE mixed step that replayed
FILTERED would capture fewer graphs, but FILTERED sorts the vocabulary of every drafter slot and
every window token, some 4,000 rows of 49,152 at G = 256, K = 7, on each step that admits a request
while others draft.)

Trimmed cells (G, V) (spec/ragged.py) are captured beside each G's full block, in every
sampling mode: the same staged inputs, cut on the device to V target tokens after drafting.

A step whose windows need what no graph holds replays the same graph, then runs the
verification again, eagerly, on the target's logits the graph made; the captured
verification's results are not read. Verification is a small part of the step. What it adds:
  - the shaping of windows whose requests shape their logits (penalties, logit_bias, bad
    words, min_p: sample/logits_shaping.py), built on the host from the outputs (after the
    step before, when the step was launched behind one). The graph drafted their
    windows unshaped: lossless all the same (verification needs the distribution each draft
    was drawn from, not a shaped one), at some acceptance where the shaping moves the argmax
    (an eager step shapes the drafter too);
  - the masks of grammar rows after the drafts the graph made (runner/grammar_masks.py: the
    masks need the drafts on the host).

Captured at start-up, largest first, sharing one memory pool and one logits buffer (its first
rows: cuda_graph.graph_logits), like the decode graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from dspark.runner.cuda_graph import capture_stream, captured, no_garbage_collection, reserved_gb
from dspark.runner.input_buffers import StepLayout
from dspark.spec.spec_buffers import FILTERED, GREEDY, TEMPERATURE, SamplingMode
from dspark.spec.spec_decoder import Scored, SpecStepOutput

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


def trimmed_layout(num_rows: int, num_tokens: int, width: int) -> StepLayout:
    """A trimmed cell's target layout, V tokens in G rows of at most `width`: the host mirrors
    are upper bounds (each row's window is chosen on the device), every token scored."""
    return StepLayout(
        num_tokens=num_tokens,
        num_rows=num_rows,
        num_logits=num_tokens,
        cu_num_tokens_cpu=tuple(min(i * width, num_tokens) for i in range(num_rows + 1)),
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
        step: Callable[..., tuple[SpecStepOutput, Scored]],  # (G, P, V, mode): V a trimmed
        #   cell's, or None; the step's output and its half up to verification
        prepare: Callable[[int, int], None],  # fills the buffers with G pad windows, P tail
        sizes: list[int],
        tails: tuple[int, ...] = (),  # P of the mixed steps captured beside each G
        modes: tuple[SamplingMode, ...] = MODES,
        trimmed: dict[int, tuple[int, ...]] | None = None,  # G -> V of its trimmed cells
    ) -> None:
        self.sizes = sorted(sizes)
        self.tails = tuple(sorted(tails))
        self.modes = modes
        self.trimmed = trimmed or {}
        Key = tuple[int, int, int | None, SamplingMode]
        self._graphs: dict[Key, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[Key, tuple[SpecStepOutput, Scored]] = {}
        self._capture(step, prepare)

    def _keys(self, g: int):
        """The captured steps of size G, in capture order: mixed steps (largest tail first),
        then the trimmed cells (largest first), then the full block."""
        for tail in reversed(self.tails):
            for mode in self.modes:
                yield g, tail, None, mode
        for v in (*sorted(self.trimmed.get(g, ()), reverse=True), None):
            for mode in self.modes:
                yield g, 0, v, mode

    @torch.inference_mode()
    def _capture(self, step, prepare) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream()
        before = reserved_gb()
        with no_garbage_collection():
            for g in reversed(self.sizes):
                for key in self._keys(g):
                    _, tail, v, mode = key
                    prepare(g, tail)
                    self._graphs[key], self._outputs[key] = captured(
                        step, (g, tail, v, mode), pool, stream
                    )
        torch.cuda.synchronize()
        logger.info("captured %d speculative CUDA graphs: sizes %s x %d sampling modes, mixed "
                    "steps with tails of %s tokens, trimmed cells %s (%.2f GiB reserved by the "
                    "capture)",
                    len(self._graphs), self.sizes, len(self.modes), list(self.tails),
                    {g: list(v) for g, v in self.trimmed.items()},
                    reserved_gb() - before)  # fmt: skip

    def replay(
        self, size: int, mode: SamplingMode, tail: int = 0, trimmed: int | None = None
    ) -> SpecStepOutput:
        key = (size, tail, trimmed, graph_mode(mode))
        self._graphs[key].replay()
        return self._outputs[key][0]

    def replay_scored(
        self, size: int, mode: SamplingMode, tail: int = 0, trimmed: int | None = None
    ) -> Scored:
        """Replay, and hand back the step's half up to verification, for a step whose
        verification runs again with what no graph holds: its shaping, its grammar rows'
        masks (the captured verification is not read)."""
        key = (size, tail, trimmed, graph_mode(mode))
        self._graphs[key].replay()
        return self._outputs[key][1]
