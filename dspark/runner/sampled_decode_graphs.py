"""The sampling of a plain decode step, captured: one graph per G that draws every row's token.

A decode graph (runner/cuda_graph.py) captures the forward only; a step whose rows sample then
ran `sample` eagerly after the replay: the uniforms, the stats and the pick (three Triton
launches), seven allocations, and their Python. On the H100 that doubled a plain step's host work
at G = 1 (0.317 -> 0.661 ms), and the speculative engine's plain steps, which add their own,
became host-bound at temperature 1.

Here each G of the ladder gets a second graph that samples rows 0..G-1 of the decode graph's
logits (a fixed address) with the sampling parameters `SamplingRows.stage` writes to fixed
device addresses, so a sampled step is two replays:

    decode graph (G)   -> logits [G, V]         (the forward, as before)
    sampling graph (G) -> tokens [G]            rows 0..B-1 live, B..G-1 pads (ignored)

Each row's draw depends only on its logits, temperature and (seed, position) uniform, so the
live rows' tokens are the eager `sample`'s on the same rows (a GPU test compares them). The
pad rows read whatever parameters the staging buffers held last: finite values, discarded.

Taken only where the eager step would take the fused path for every row
(`sampler.takes_fused_path`: no top-k, no top-p) and only for a pure decode step (no tail of
prefill rows); a row under its min_tokens ban needs its logits masked first, so such a step
samples eagerly too (ModelRunner._sample).

Why: on an H100 a sampled plain step at G = 1 took 0.723 ms this way against 0.988 ms eagerly
(greedy's 0.714). DSPARK_REFERENCE_OPS leaves them out.
"""

from __future__ import annotations

import torch

from dspark import envs
from dspark.runner.cuda_graph import DecodeGraphs, capture_stream, captured, no_garbage_collection
from dspark.sample.sampler import sample
from dspark.sample.sampling_rows import SamplingRows


def sampled_decode_graphs_enabled() -> bool:
    return not envs.ENVS.reference_ops


class SampledDecodeGraphs:
    @torch.inference_mode()  # (the decode graphs' outputs are inference tensors)
    def __init__(self, decode_graphs: DecodeGraphs, sampling_rows: SamplingRows) -> None:
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._tokens: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream()
        with no_garbage_collection():
            # largest first: later graphs reuse its pool blocks
            for g in reversed(decode_graphs.sizes):
                logits = decode_graphs.output(g)
                logits.zero_()  # (no replay has written it yet: the warm-up run reads zeros)
                args = (logits, sampling_rows.graph_tensors(g))
                self._graphs[g], self._tokens[g] = captured(sample, args, pool, stream)
        torch.cuda.synchronize()

    def replay(self, size: int, num_rows: int) -> torch.Tensor:  # [num_rows] int64
        """The tokens of rows 0..num_rows-1, sampled from the decode graph `size`'s logits,
        valid until the next replay of this size."""
        self._graphs[size].replay()
        return self._tokens[size][:num_rows]
