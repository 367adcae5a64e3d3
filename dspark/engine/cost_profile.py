"""Measuring a cost table on a live engine: the whole-step time of every cell it can run
(docs/SPECULATION.md 6.1; the format is policy/cost_table.py). `dspark profile` and the
engine's start-up profile (engine/startup_profile.py) both measure with `measure_cost_table`.

For each batch size G and each cell: G greedy requests (a fixed synthetic prompt, ignore_eos)
are prefilled, then the engine steps in the cell's mode, drafting off (plain decoding, V = G)
or on (the full block, V = G (K + 1)), `warmup` steps untimed and then `steps` steps timed one
by one, and the requests are dropped; `rounds` rounds of every cell, and a cell's value is the
lowest of its rounds' medians. Every cell starts from the same context (fresh requests each
time), so the KV growth of one cell's steps never leaks into the next: with five cells of
eleven steps in two rounds on the same requests, the last cells would run some hundreds of
tokens further into their contexts than the first. One round is not enough on a shared GPU: a
one-off slow stretch (on an H200, G = 1's full block read 3.17 ms in one round against a
realised 2.7 ms) is not a property of the cell, and the lowest median of the rounds is the
steady cost the drafting policy prices. The step is `LLMEngine.step()`: drafting, the target,
sampling, verification and the host's work, what a user's step costs. Greedy windows over a
fixed prompt keep acceptance (and so KV growth) alike across cells. The engine runs without a
drafting policy (drafting is set here).

  G 16: plain 1.02 ms, full block 2.41 ms  ->  {"16": {"16": 0.00102, "128": 0.00241}}

With trimmed cells (speculative_config "trimmed_widths"), each trimmed cell (G, w G) is
measured the same way beside the full block: the scheduler is handed the cell as the drafting
policy would, and the device picks each row's share of the budget.

With `sampled` (the default) every cell is measured again with requests at temperature 1
(request i seeded with i), into the table's "sampled_cells": a sampled step draws every draft
slot from its distribution and verifies by rejection sampling, and prices differently.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from dspark.policy.cost_table import CostTable, full_block_tokens
from dspark.sampling_params import SamplingParams

# the engine hands itself in (engine.py imports this module, so it cannot import engine.py)
LLMEngine = Any


def measure_cost_table(
    engine: LLMEngine, batches: list[int], steps: int = 8, warmup: int = 3,
    prompt_len: int = 64, rounds: int = 2, sampled: bool = True,
    on_cell: Callable[[], None] | None = None,  # called after each cell measured (progress)
) -> CostTable:  # fmt: skip
    """Measure (G, G), (G, w G) and (G, G (K + 1)) for each G in batches on this engine,
    greedy and (with `sampled`) at temperature 1."""
    if engine.spec is None or engine.policy is not None:
        raise ValueError("profiling needs a speculative engine without a drafting policy")
    if steps < 5:
        raise ValueError(f"steps must be >= 5 (a median of at least five), got {steps}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    K = engine.spec.num_verify
    # enough room for every timed step to draft a full block without reaching max_tokens
    max_tokens = (steps + warmup + 2) * (K + 1)
    if prompt_len + max_tokens > engine.max_model_len:
        raise ValueError(f"prompt_len {prompt_len} + {max_tokens} tokens exceed max_model_len "
                         f"{engine.max_model_len}")  # fmt: skip
    for g in batches:
        if g > engine.config.max_num_seqs:
            raise ValueError(f"batch {g} exceeds max_num_seqs {engine.config.max_num_seqs}")
    prompt = [(7 * j + 11) % engine.model_config.vocab_size for j in range(prompt_len)]
    timing = _Timing(steps, warmup, rounds, on_cell or (lambda: None))
    cells = [
        _measure_cells(engine, batches, prompt, temperature, max_tokens, timing)
        for temperature in ((0.0, 1.0) if sampled else (0.0,))
    ]
    return CostTable(engine.cost_fingerprint(), cells[0], cells[1] if sampled else None)


def num_cells(engine: LLMEngine, batches: list[int], rounds: int = 2, sampled: bool = True) -> int:
    """How many cell measurements measure_cost_table makes (a progress bar's total)."""
    per_g = 2 + len(engine.runner.spec_runner.trimmed_widths)
    return len(batches) * per_g * rounds * (2 if sampled else 1)


@dataclasses.dataclass(frozen=True)
class _Timing:
    steps: int
    warmup: int
    rounds: int
    on_cell: Callable[[], None]


def _measure_cells(
    engine: LLMEngine, batches: list[int], prompt: list[int], temperature: float,
    max_tokens: int, timing: _Timing,
) -> dict[int, dict[int, float]]:  # fmt: skip
    """G -> {G: plain, w G: trimmed, G (K + 1): full block} seconds, with G requests at this
    temperature."""
    K = engine.spec.num_verify
    widths = engine.runner.spec_runner.trimmed_widths
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    cells: dict[int, dict[int, float]] = {}
    for g in batches:
        # the cells in the order measured each round: plain, the trimmed ones, the full block
        order = [g, *(g * w for w in widths), full_block_tokens(g, K)]
        best = dict.fromkeys(order, math.inf)
        for _ in range(timing.rounds):
            for v in order:
                trimmed = (g, v) if g < v < order[-1] else None
                seconds = _measure_cell(engine, g, v > g, trimmed, prompt, params, timing)
                best[v] = min(best[v], seconds)
                timing.on_cell()
        cells[g] = best
    return cells


def _measure_cell(
    engine: LLMEngine, g: int, drafting: bool, trimmed: tuple[int, int] | None,
    prompt: list[int], params: SamplingParams, timing: _Timing,
) -> float:  # fmt: skip
    """One cell's median step (seconds): G fresh requests prefilled, then steps in the mode."""
    sched = engine.scheduler
    for i in range(g):  # (request i seeded with i when it samples)
        seeded = dataclasses.replace(params, seed=i) if params.temperature else params
        engine.add_request(f"profile-{g}-{i}-{next(_serial)}", prompt, seeded)
    sched.drafting, sched.trimmed_cell = False, None
    while sched.waiting or any(r.is_prefilling for r in sched.running):
        engine.step()
    sched.drafting, sched.trimmed_cell = drafting, trimmed
    ran = _trimmed_steps(engine)
    seconds = _median_step(engine, timing.steps, timing.warmup)
    ran = _trimmed_steps(engine) - ran
    sched.drafting, sched.trimmed_cell = True, None
    drain(engine)
    if trimmed and ran < timing.steps + timing.warmup:
        raise RuntimeError(f"trimmed cell G={g} V={trimmed[1]} did not run as one (fallbacks: "
                           f"{_fallbacks(engine)}): not measured")  # fmt: skip
    return seconds


def _median_step(engine: LLMEngine, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()  # one launched and one collected: in steady state, one step's period
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def drain(engine: LLMEngine) -> None:
    """Abort every request of the engine and step until it has forgotten them."""
    for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(req.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # reports the aborted requests (and forgets them)


_serial = itertools.count()  # request ids stay unique across cells and rounds


def _trimmed_steps(engine: LLMEngine) -> int:
    stats = engine.runner.stats
    return stats["spec_graph_steps_trimmed"] + stats["spec_steps_trimmed_eager"]


def _fallbacks(engine: LLMEngine) -> dict[str, int]:
    return {k: v for k, v in engine.runner.stats.items() if k.startswith("trimmed_fallback_")}
