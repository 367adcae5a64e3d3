"""The speculative half of the runner: windows staged, the speculative step run (a captured
graph or eagerly), its results queued to the host and assigned to plan rows.

A step whose rows are all windows, at most a captured size of them, replays SpecGraphs (pad
windows on the scratch page after the live ones). Such a step lays every window out K + 1
tokens wide, also a window shortened near max_tokens (its verify_len caps what it accepts), so
that requests finishing at different steps do not send the batch to the eager path. Any other
step with windows (mixed with plain rows) runs the same SpecDecoder.step eagerly, and the
reason is counted.

  K = 3, windows of verify_len [3, 1]: target tokens [a0 x x x | a1 x . .], cu [0, 4, 8];
  the second window's last two tokens are scored but never accepted.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from dspark.engine.scheduler import SampledTokens, StepPlan
from dspark.request import TokenLogprobs
from dspark.runner.input_buffers import InputBuffers, StepLayout, to_host
from dspark.runner.spec_graphs import SpecGraphs, window_layout
from dspark.sample.sampler import top_logprobs
from dspark.spec.spec_buffers import SamplingMode, WindowRow
from dspark.spec.spec_decoder import SpecDecoder, SpecStepOutput, TargetStep

if TYPE_CHECKING:
    from dspark.runner.model_runner import InFlightStep


class SpecRunner:
    def __init__(
        self,
        spec: SpecDecoder,
        buffers: InputBuffers,
        run_model: Callable,  # (layout, hidden_layers) -> ModelOutput
        vocab_size: int,
        stats: Counter[str],
        graph_sizes: list[int],  # the ladder to capture ([]: none, every step eager)
    ) -> None:
        self.spec, self.buffers, self.run_model = spec, buffers, run_model
        self.vocab_size, self.stats, self.device = vocab_size, stats, buffers.device
        width = 1 + spec.num_verify
        self.capacity = buffers.input_ids.shape[0]
        sizes = [g for g in graph_sizes if g * width <= self.capacity]
        self.graphs = SpecGraphs(self._graph_step, self._prepare_graph, sizes) if sizes else None
        # lay steps of windows out K + 1 wide (on with graphs; a test turns it on eagerly)
        self.uniform_windows = self.graphs is not None
        # called after each speculative step's sync with the windows' request ids, raw
        # confidence logits [R, K] (host) and greedy flags: the drafting policy's survivals
        self.confidence_sinks: list[Callable[[list[str], torch.Tensor, list[bool]], None]] = []

    def window_width(self, plan: StepPlan) -> int | None:
        """K + 1 if every row of the step is a window laid out at full width, else None."""
        width = 1 + self.spec.num_verify
        if not self.uniform_windows or not all(r.num_draft for r in plan.rows):
            return None
        if len(plan.rows) * width > self.capacity:  # the token buffers' size
            return None
        return width

    def graph_size(self, plan: StepPlan, window_width: int | None) -> int | None:
        """The captured size a fixed-K speculative step (laid out with window_width, from
        window_width(plan)) pads to, or None (eager, the reason counted)."""
        if self.graphs is None:
            return None
        if window_width is None:
            self.stats["eager_spec_steps_not_all_windows"] += 1
            return None
        if any(r.num_draft < self.spec.num_verify for r in plan.rows):
            self.stats["spec_graph_steps_with_short_windows"] += 1
        i = bisect.bisect_left(self.graphs.sizes, len(plan.rows))
        if i == len(self.graphs.sizes):
            self.stats["eager_spec_steps_batch_too_large"] += 1
            return None
        return self.graphs.sizes[i]

    # ---- the step ---------------------------------------------------------------------------

    def run(
        self, plan: StepPlan, layout: StepLayout, window_rows: list[int], graph_size: int | None
    ) -> SpecStepOutput:
        """Stage the windows and run the speculative step: a captured graph when the step is
        all full windows of a captured size, else eagerly (mixed batches, short windows)."""
        cu = layout.cu_num_tokens_cpu
        rows = []
        for i in window_rows:
            r = plan.rows[i]
            req, sp = r.request, r.request.sampling_params
            rows.append(WindowRow(
                anchor=req.token_ids[r.start], anchor_pos=r.start, verify_len=r.num_draft,
                token_offset=cu[i], page_ids=req.page_ids, temperature=sp.temperature,
                top_k=sp.top_k if sp.top_k > 0 else self.vocab_size, top_p=sp.top_p,
                seed=req.seed,
            ))  # fmt: skip
        mode = SamplingMode.of(rows, self.vocab_size)
        width = layout.window_width
        if graph_size is not None:  # every plan row is a window: pad rows follow them
            self.spec.stage(rows, graph_size, pad_token_offset=cu[len(rows)], window_width=width)
            self.stats["spec_graph_steps"] += 1
            return self.graphs.replay(graph_size, mode)
        self.spec.stage(rows, len(rows), window_width=width)
        self.stats["eager_spec_steps"] += 1
        b, dev = self.buffers, self.device
        all_windows = window_rows == list(range(layout.num_rows))
        block_table = b.block_table
        window_index = None
        if not all_windows:  # mixed with plain rows: gather the windows' page rows and logits
            block_table = b.block_table[torch.tensor(window_rows, device=dev)]
            logit_rows, row0 = [], 0
            for r in plan.rows:
                if r.num_draft:
                    logit_rows += range(row0, row0 + r.num_tokens)
                row0 += r.num_tokens if r.num_draft else int(r.do_sample)
            window_index = torch.tensor(logit_rows, device=dev)
        return self.spec.step(len(rows), mode, self._target_step(layout, block_table), window_index)

    def _target_step(self, layout: StepLayout, block_table: torch.Tensor) -> TargetStep:
        b, t = self.buffers, layout.num_tokens
        return TargetStep(
            run=lambda: self.run_model(layout, self.spec.taps),
            input_ids=b.input_ids[:t],
            positions=b.positions[:t],
            slot_mapping=b.slot_mapping[:t],
            block_table=block_table,
        )

    # ---- results ----------------------------------------------------------------------------

    def queue_results(
        self,
        step: InFlightStep,
        plan: StepPlan,
        layout: StepLayout,
        window_rows: list[int],
        out: SpecStepOutput,
    ) -> None:
        """Queue the host copies of the windows' results (live rows only) behind the step."""
        R = len(window_rows)
        step.window_rows = window_rows
        step.verify_len = [plan.rows[i].num_draft for i in window_rows]
        step.verified = to_host((out.tokens[:R], out.num_accepted[:R]))
        if out.confidence_logits is not None:  # (R x K floats: the metrics' survivals too)
            step.confidence = to_host(out.confidence_logits[:R].float())
        cu = layout.cu_num_tokens_cpu
        widths = [cu[i + 1] - cu[i] for i in window_rows]  # window tokens in window_logits
        step.window_logprobs = to_host(self._window_logprobs(plan, out, step.verify_len, widths))

    def assign(self, step: InFlightStep, results: list[SampledTokens | None]) -> None:
        """After the step's sync: each window row's emitted tokens (and logprobs) into results;
        the counters and observers see the step."""
        plan = step.plan
        emitted, accepted = (x.tolist() for x in step.verified)
        greedy = [plan.rows[i].request.sampling_params.is_greedy for i in step.window_rows]
        self.spec.record(step.verify_len, accepted, step.confidence, greedy)
        if step.confidence is not None:
            ids = [plan.rows[i].request.request_id for i in step.window_rows]
            for sink in self.confidence_sinks:
                sink(ids, step.confidence, greedy)
        wlp = None
        if step.window_logprobs is not None:
            wlp = [x.tolist() for x in step.window_logprobs]
        row0 = 0
        for j, i in enumerate(step.window_rows):
            toks = tuple(emitted[j][: accepted[j] + 1])
            n = plan.rows[i].request.sampling_params.logprobs
            logprobs = None
            if n is not None and wlp is not None:
                chosen, top_ids, top_vals = wlp
                logprobs = tuple(
                    TokenLogprobs(t, chosen[row0 + k], dict(zip(top_ids[row0 + k][:n],
                                  top_vals[row0 + k][:n], strict=True)))
                    for k, t in enumerate(toks)
                )  # fmt: skip
            results[i] = SampledTokens(toks, logprobs)
            row0 += 1 + step.verify_len[j]

    def _window_logprobs(
        self, plan: StepPlan, out: SpecStepOutput, verify_len: list[int], widths: list[int]
    ):
        """The target's logprobs of each emittable window token, packed 1 + verify_len per
        window: emitted token i of a window is scored by window row i (the anchor's row scores
        the first). Window j's rows start at sum(widths[:j]) in window_logits. None if nobody
        asked.

          verify_len [2, 1], widths [4, 4] (K = 3): logit rows [0 1 2 | 4 5], owners [0 0 0 1 1]
        """
        wants = [r.request.sampling_params.logprobs for r in plan.rows if r.num_draft]
        if all(n is None for n in wants):
            return None
        lens = [1 + n for n in verify_len]
        total = sum(lens)
        dev = self.device
        owner = torch.repeat_interleave(
            torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev), output_size=total
        )
        packed = torch.tensor([0, *itertools.accumulate(lens[:-1])], device=dev)
        start = torch.tensor([0, *itertools.accumulate(widths[:-1])], device=dev)
        offset = torch.arange(total, device=dev) - packed[owner]
        tokens = out.tokens[owner, offset]  # [Tw] the token each window row would emit
        logits = out.window_logits[start[owner] + offset]
        return top_logprobs(logits, tokens, max(n or 0 for n in wants))

    # ---- graph capture ----------------------------------------------------------------------

    def _prepare_graph(self, size: int) -> None:
        """Fill the buffers with `size` pad windows (capture inputs: the scratch page only)."""
        b, width = self.buffers, 1 + self.spec.num_verify
        b.write_pad_rows(0, 0, size, width)
        b.np("logits_indices")[: size * width] = range(size * width)
        b.upload(window_layout(size, width))
        self.spec.stage([], size)

    def _graph_step(self, size: int, mode: SamplingMode) -> SpecStepOutput:
        layout = window_layout(size, 1 + self.spec.num_verify)
        return self.spec.step(size, mode, self._target_step(layout, self.buffers.block_table), None)
