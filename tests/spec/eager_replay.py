"""SpecGraphs without capture, for the CPU: replay runs the step a graph captures on the
buffers as staged, so the padded layouts of graph steps (pad windows, mixed tails, trimmed
cells) run through the engine on the CPU."""

from __future__ import annotations

from dspark.runner.chosen_lengths import trimmed_target
from dspark.runner.mixed_layout import graph_tail_rows
from dspark.runner.spec_graphs import graph_mode


class EagerReplay:
    """SpecGraphs without capture: replay runs the step a graph captures (SpecDecoder.step over
    G windows, the target over the padded layout) on the buffers as staged. The step's host
    mirrors are the live layout's: the CPU reference attention reads them, where the Triton
    kernel a graph holds reads only the device buffers (the mirrors size its grid)."""

    def __init__(
        self,
        spec_runner,
        sizes: list[int],
        tails: tuple[int, ...] = (),
        trimmed: dict[int, tuple[int, ...]] | None = None,  # G -> V of the "captured" cells
    ) -> None:
        self.spec_runner, self.sizes, self.tails = spec_runner, sorted(sizes), tails
        self.trimmed = trimmed or {}
        self.layout = None
        self.replayed: list[tuple[int, int, int | None]] = []  # (G, P, V) of every replay
        self.modes: list = []  # the captured sampling mode each replay ran (graph_mode)
        run = spec_runner.run

        def keep_layout(plan, layout, *args):
            self.layout = layout
            return run(plan, layout, *args)

        spec_runner.run = keep_layout

    def replay(self, size, mode, tail=0, trimmed=None):
        return self.spec_runner.spec.verify_scored(self.replay_scored(size, mode, tail, trimmed))

    def replay_scored(self, size, mode, tail=0, trimmed=None):
        r, width = self.spec_runner, self.layout.window_width
        assert self.layout.num_rows == size + (self.layout.tail_rows if tail else 0)
        assert not tail or self.layout.tail_rows == graph_tail_rows(tail)
        self.replayed.append((size, tail, trimmed))
        self.modes.append(graph_mode(mode))
        if trimmed is not None:
            assert trimmed in self.trimmed[size]
            target, cell = trimmed_target(r.buffers, r.spec, r.run_model, size, trimmed,
                                          (size, trimmed))  # fmt: skip
            return r.spec.launch(size, graph_mode(mode), target, None, cell)
        target = r._target_step(self.layout, r.buffers.block_table)
        index = slice(0, size * width) if tail else None
        return r.spec.launch(size, graph_mode(mode), target, index)
