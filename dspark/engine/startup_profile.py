"""The cost table measured at start-up, when none matches this engine (docs/SPECULATION.md 6.3).

A fresh install (a GPU or a torch the drafter ships no table for) would otherwise draft the
full block every step, which at high load runs below plain decoding. So an engine that has a
drafting policy to build and finds no table measures one itself, with `dspark profile`'s
measurement (engine/cost_profile.py) over its captured graph sizes, shows a progress bar, logs
one line, and saves the table under the user's cache directory (cost_table.user_tables_dir),
where the next start with the same fingerprint finds it without measuring.

The rule: measure only where the steps run captured (CUDA graphs), the steps the table
prices. An eager engine (the CPU, or CUDA without graphs) keeps the warning and fixed K: its
step times are slow to gather over every G and noisy, and nobody schedules a CPU for
throughput. speculative_config "profile_at_startup": false skips it (tests, a deployment that
ships its own table, a start that must be quick).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dspark.engine.cost_profile import measure_cost_table, num_cells
from dspark.policy.cost_table import flatness_reason, table_file_name, user_tables_dir

# the engine hands itself in (engine.py imports this module, so it cannot import engine.py)
LLMEngine = Any

logger = logging.getLogger(__name__)

# timed steps, untimed warm-up steps and rounds per cell: `dspark profile`'s defaults, the
# measurement the shipped tables were made with (engine/cost_profile.py says why two rounds)
STEPS, WARMUP, ROUNDS = 8, 3, 2


def startup_profile_blocker(engine: LLMEngine) -> str | None:
    """Why this engine does not measure a cost table at start-up (None: it does)."""
    if not engine.config.spec().profile_at_startup:
        return 'speculative_config "profile_at_startup" is false'
    if not engine.spec.drafter.config.use_confidence:
        return "the drafter has no confidence head"
    if engine.runner.spec_runner.graphs is None:
        return "its steps run eagerly (no CUDA graphs): measured only where steps are captured"
    return None


def measure_at_startup(engine: LLMEngine) -> tuple[Path | None, str]:
    """The start-up profile where the rule allows it: (the saved table, "") or (None, why
    none)."""
    why = startup_profile_blocker(engine)
    if why is not None:
        return None, why
    path = profile_at_startup(engine, startup_batches(engine))
    return path, "" if path else "the table measured was flat"


def startup_batches(engine: LLMEngine) -> list[int]:
    """The G a start-up profile measures: every captured graph size, the G the policy prices."""
    return list(engine.runner.spec_runner.graphs.sizes)


def profile_at_startup(engine: LLMEngine, batches: list[int]) -> Path | None:
    """Measure this engine's cost table over `batches` (its captured graph sizes) and save it
    where the next start finds it; the path, or None (the reason logged, counted in
    runner.stats["startup_profile_not_written"]) when the table is flat."""
    start = time.perf_counter()
    with tqdm(
        total=num_cells(engine, batches, ROUNDS),
        desc="measuring the cost table (profile_at_startup)",
        unit="cell",
    ) as bar:
        table = measure_cost_table(engine, batches, STEPS, WARMUP, rounds=ROUNDS,
                                   on_cell=bar.update)  # fmt: skip
    seconds = time.perf_counter() - start
    engine.forget_profile_steps()
    why = flatness_reason(table)
    if why:
        logger.warning("speculation: the cost table measured at start-up is not saved (%s): "
                       "every step drafts the full block (fixed K)", why)  # fmt: skip
        engine.runner.stats["startup_profile_not_written"] += 1
        return None
    measured = {"at_startup": True, "seconds": round(seconds, 1)}
    if engine.synthetic is not None:  # (a benchmark's engine: real forwards, marked)
        measured["synthetic"] = engine.synthetic.record(engine.spec.num_verify)
    table = replace(table, measured=measured)
    path = user_tables_dir() / table_file_name(table.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table.to_json())
    logger.info("speculation: cost table measured at start-up in %.1f s, G %s, saved to %s "
                "(the next start with this fingerprint uses it; speculative_config "
                '"profile_at_startup": false skips this)', seconds, batches, path)  # fmt: skip
    return path
