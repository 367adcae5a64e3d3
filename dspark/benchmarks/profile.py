"""`dspark profile`: measure the whole-step time of every cell the engine can run and write the
cost table (docs/SPECULATION.md 6; the format is in policy/cost_table.py).

For each batch size G and each cell: G greedy requests (a fixed synthetic prompt, ignore_eos)
are prefilled, then the engine steps in the cell's mode, drafting off (plain decoding, V = G)
or on (the full block, V = G (K + 1)), `warmup` steps untimed and then `steps` steps timed one
by one, and the requests are dropped; `rounds` rounds of every cell, and a cell's value is the
lowest of its rounds' medians. Every cell starts from the same context (fresh requests each
time), so the KV growth of one cell's steps never leaks into the next: with five cells of
eleven steps in two rounds on the same requests, the last cells would run some hundreds of
tokens further into their contexts than the first. One round is not enough
on a shared GPU: on the H200 (2026-12-03) the first cell measured, G = 1's full block, read
3.17 ms against 2.26 ms at G = 2, while the bench's K = 7 arm realised about 2.7 ms per step at
concurrency 1. The lowest median of the rounds is the steady cost, which is what the drafting
policy prices (a one-off slow stretch is not a property of the cell). The step is
`LLMEngine.step()`: drafting, the target, sampling, verification and the host's work, what a
user's step costs. Greedy windows over a fixed prompt keep acceptance (and so KV growth) alike
across cells. The engine runs without a cost table (drafting is set here).

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

from dspark.llm import LLM
from dspark.policy.cost_table import CostTable, full_block_tokens
from dspark.sampling_params import SamplingParams


def _median_step(llm: LLM, steps: int, warmup: int) -> float:
    engine = llm.engine
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()  # one launched and one collected: in steady state, one step's period
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def drain(llm: LLM) -> None:
    """Abort every request of the engine and step until it has forgotten them."""
    engine = llm.engine
    for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(req.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # reports the aborted requests (and forgets them)


def profile_cost_table(
    llm: LLM, batches: list[int], steps: int = 8, warmup: int = 3, prompt_len: int = 64,
    rounds: int = 2, sampled: bool = True,
) -> CostTable:  # fmt: skip
    """Measure (G, G) and (G, G (K + 1)) for each G in batches on this engine, greedy and (with
    `sampled`) at temperature 1."""
    engine = llm.engine
    if engine.spec is None or engine.policy is not None:
        raise ValueError("profiling needs a speculative engine without a cost table")
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
    cells = [
        _measure_cells(llm, batches, prompt, temperature, max_tokens, steps, warmup, rounds)
        for temperature in ((0.0, 1.0) if sampled else (0.0,))
    ]
    return CostTable(engine.cost_fingerprint(), cells[0], cells[1] if sampled else None)


def _measure_cells(
    llm: LLM, batches: list[int], prompt: list[int], temperature: float, max_tokens: int,
    steps: int, warmup: int, rounds: int,
) -> dict[int, dict[int, float]]:  # fmt: skip
    """G -> {G: plain, G (K + 1): full block, w G: trimmed} seconds, with G requests at this
    temperature."""
    engine = llm.engine
    K = engine.spec.num_verify
    widths = engine.runner.spec_runner.trimmed_widths
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    cells: dict[int, dict[int, float]] = {}
    for g in batches:
        # the cells in the order measured each round: plain, the trimmed ones, the full block
        order = [g, *(g * w for w in widths), full_block_tokens(g, K)]
        best = dict.fromkeys(order, math.inf)
        for _ in range(rounds):
            for v in order:
                trimmed = (g, v) if g < v < order[-1] else None
                best[v] = min(best[v], _measure_cell(llm, g, v > g, trimmed, prompt, params,
                                                     steps, warmup))  # fmt: skip
        cells[g] = best
    return cells


def _measure_cell(
    llm: LLM, g: int, drafting: bool, trimmed: tuple[int, int] | None, prompt: list[int],
    params: SamplingParams, steps: int, warmup: int,
) -> float:  # fmt: skip
    """One cell's median step (seconds): G fresh requests prefilled, then steps in the mode."""
    engine, sched = llm.engine, llm.engine.scheduler
    for i in range(g):  # (request i seeded with i when it samples)
        seeded = dataclasses.replace(params, seed=i) if params.temperature else params
        engine.add_request(f"profile-{g}-{i}-{next(_serial)}", prompt, seeded)
    sched.drafting, sched.trimmed_cell = False, None
    while sched.waiting or any(r.is_prefilling for r in sched.running):
        engine.step()
    sched.drafting, sched.trimmed_cell = drafting, trimmed
    ran = _trimmed_steps(engine)
    seconds = _median_step(llm, steps, warmup)
    ran = _trimmed_steps(engine) - ran
    sched.drafting, sched.trimmed_cell = True, None
    drain(llm)
    if trimmed and ran < steps + warmup:
        raise RuntimeError(f"trimmed cell G={g} V={trimmed[1]} did not run as one (fallbacks: "
                           f"{_fallbacks(engine)}): not measured")  # fmt: skip
    return seconds


_serial = itertools.count()  # request ids stay unique across cells and rounds


def _trimmed_steps(engine) -> int:
    stats = engine.runner.stats
    return stats["spec_graph_steps_trimmed"] + stats["spec_steps_trimmed_eager"]


def _fallbacks(engine) -> dict[str, int]:
    return {k: v for k, v in engine.runner.stats.items() if k.startswith("trimmed_fallback_")}


def format_table(table: CostTable, draft_len: int) -> str:
    rows = [
        "    G   plain ms   full ms   full / plain"
        + ("   sampled: plain ms   full ms   full / plain" if table.sampled_cells else "")
    ]
    for g, row in sorted(table.cells.items()):
        line = _cells_text(row, g, draft_len)
        if table.sampled_cells:
            line += "           " + _cells_text(table.sampled_cells[g], g, draft_len)
        rows.append(f"{g:>5} " + line)
    trimmed = _trimmed_text(table, draft_len)
    return "\n".join(rows + ([trimmed] if trimmed else []))


def _trimmed_text(table: CostTable, draft_len: int) -> str:
    """The trimmed cells, as tokens per row w: step ms (over plain), greedy then sampled."""
    lines = []
    for name, cells in (("greedy", table.cells), ("sampled", table.sampled_cells or {})):
        for g, row in sorted(cells.items()):
            full = full_block_tokens(g, draft_len)
            trimmed = [(v, t) for v, t in sorted(row.items()) if g < v < full]
            if trimmed:
                text = "  ".join(f"w={v // g}: {t * 1e3:.3f} ({t / row[g]:.2f})"
                                 for v, t in trimmed)  # fmt: skip
                lines.append(f"{g:>5} {name} trimmed cells ms (/ plain): {text}")
    return "\n".join(lines)


def _cells_text(row: dict[int, float], g: int, draft_len: int) -> str:
    plain, full = row[g], row[full_block_tokens(g, draft_len)]
    return f"{plain * 1e3:>10.3f} {full * 1e3:>9.3f} {full / plain:>14.2f}"


# a new table whose cells read this much above (or below) a reference table's, in median, is
# worth profiling again: one of five profiles on the H200 read 8-53% high in most cells
DRIFT_WARNING = 0.05


def reference_drift(table: CostTable, reference: CostTable) -> tuple[float, int] | None:
    """The median of new / reference step time over the cells both tables measured (greedy and
    sampled), and how many there were; None when they share no cell.

      new {1: {1: 0.8, 8: 1.4}}, reference {1: {1: 0.7, 8: 1.2}}  ->  (1.155, 2)
    """
    ratios = []
    for new, ref in ((table.cells, reference.cells),
                     (table.sampled_cells or {}, reference.sampled_cells or {})):  # fmt: skip
        for g, row in new.items():
            ratios += [t / ref[g][v] for v, t in row.items() if v in ref.get(g, {})]
    return (statistics.median(ratios), len(ratios)) if ratios else None
