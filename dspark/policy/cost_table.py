"""The measured cost table: whole-step seconds per runnable cell, and the fingerprint that says
which engine on which GPU measured them (docs/SPECULATION.md, the cost table).

A cell is (G, V): a step of G rows (the graph batch size) verifying V target tokens in all.
V = G is plain decoding (no drafting), V = G * (K + 1) the full block (fixed K); ragged cells
lie between. Each value is the median whole-step time (draft + verify + sampling + host work).

  {"fingerprint": {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", ...},
   "cells": {"1": {"1": 0.00104, "8": 0.00151},            G = 1: plain, full block (K = 7)
             "16": {"16": 0.00099, "64": 0.00141, "128": 0.00183}},
   "sampled_cells": {"1": {"1": 0.00109, "8": 0.00178}, ...}}        optional, same shape

A fingerprint's "trimmed_widths" (absent in tables older than trimmed cells: none) says which
trimmed cells the engine runs: for each w, the cell (G, w G) of every G, and the table must hold
each of them.

"cells" are measured with greedy requests. A step of rows that sample costs more (every draft
slot's distribution, rejection sampling, the sampler itself), so a table may also hold
"sampled_cells", measured with requests at temperature 1, for the same G: the drafting policy
prices a batch with any sampling row by them (policy.py). A table without them
prices such batches by the greedy cells, counted.

Loading is authentication: the table is used only if its fingerprint equals the live engine's
and every G it lists has its full-block cell and every value is a finite positive number. On any
failure `load_cost_table` returns no table and the reason; the engine then verifies full blocks
(fixed K), logs the reason and counts it. Unmeasured cells are never interpolated.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from dspark import envs
from dspark.version import __version__

# What a step's time depends on, and nothing else (a key more would refuse tables that price
# this engine right, and a fresh start would measure again for nothing):
#   gpu, torch, triton      the kernels that run and the GPU they run on
#   target_hash, drafter_hash, draft_len, dtype    the work of a step: the two networks, K
#   graph_sizes, trimmed_widths   the captured shapes, hence each G's padding and its cells
#   page_size               the attention kernels' tiling of the KV
#   engine_version          the engine's own code: the host work inside every whole step
# Not in it: how many GPUs the host has (the engine runs on one), the KV size or
# max_model_len (a cell's context is the profile's fixed prompt), mixed_prefill_tokens (no
# cell carries prefill). A table's extra keys (tables from before a key left) are ignored.
FINGERPRINT_KEYS = (
    "gpu", "torch", "triton", "target_hash", "drafter_hash", "draft_len", "dtype",
    "graph_sizes", "page_size", "engine_version", "trimmed_widths", "tensor_parallel_size",
)  # fmt: skip
# keys a table may lack, with the value that absence means (tables written before the key)
FINGERPRINT_DEFAULTS = {"trimmed_widths": [], "tensor_parallel_size": 1}
# tables shipped beside a drafter (one per engine they were measured on), used when their
# fingerprint matches and speculative_config names none
COST_TABLES_DIR = "cost_tables"
# a table whose step time varies less than this across the cells of every G is flat
MIN_SPREAD = 0.05


def user_tables_dir() -> Path:
    """The directory of the tables `dspark profile` measured on this machine: cost_tables/
    under dspark's cache directory (envs.cache_dir: $DSPARK_CACHE_DIR, else
    $XDG_CACHE_HOME/dspark, else ~/.cache/dspark), where `dspark profile` writes by default. A
    table there is used like one shipped beside the drafter: when its fingerprint equals the
    live engine's."""
    return envs.cache_dir() / COST_TABLES_DIR


def table_file_name(fingerprint: dict) -> str:
    """A file name that tells tables of different engines apart: what the GPU, drafter, K and
    torch are, then a digest of the whole fingerprint, e.g.
    "nvidia_h100_80gb_hbm3_5b106d5f638fe6b5_k7_torch2.11.0_cu130_3f2a9c1e.json". The digest keeps
    apart engines the readable part does not (another target, graph ladder, dtype or trimmed
    widths), which would otherwise overwrite each other's table at every start and each measure
    its own again (a bench's policy arms with and without trimmed cells did). The fingerprint
    inside is what authenticates a table, not its name."""
    parts = (fingerprint["gpu"], fingerprint["drafter_hash"], f"k{fingerprint['draft_len']}",
             f"torch{fingerprint['torch']}")  # fmt: skip
    readable = re.sub(r"[^a-z0-9.]+", "_", "_".join(map(str, parts)).lower()).strip("_")
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:8]
    return f"{readable}_{digest}.json"


@dataclass(frozen=True)
class CostTable:
    fingerprint: dict
    cells: dict[int, dict[int, float]]  # G -> V -> seconds per step, greedy requests
    sampled_cells: dict[int, dict[int, float]] | None = None  # the same, at temperature 1
    # how the cells were measured (the GPU's clocks before and after: gpu_state.py); a record
    # for people, never authenticated or used by the engine
    measured: dict | None = None

    def step_seconds(self, g: int, v: int) -> float | None:
        """The measured time of cell (G, V), or None if it was not measured."""
        return self.cells.get(g, {}).get(v)

    def for_sampling(self) -> CostTable | None:
        """The sampled cells as a table of their own (None without them)."""
        if self.sampled_cells is None:
            return None
        return CostTable(self.fingerprint, self.sampled_cells)

    def to_json(self) -> str:
        def encode(cells):
            return {str(g): {str(v): t for v, t in sorted(row.items())}
                    for g, row in sorted(cells.items())}  # fmt: skip

        raw = {"fingerprint": self.fingerprint, "cells": encode(self.cells)}
        if self.sampled_cells is not None:
            raw["sampled_cells"] = encode(self.sampled_cells)
        if self.measured is not None:
            raw["measured"] = self.measured
        return json.dumps(raw, indent=1)


def make_fingerprint(
    device,  # torch.device the table is for
    target_hash: str,
    drafter_hash: str,
    draft_len: int,
    dtype: str,
    graph_sizes: list[int],
    page_size: int,
    trimmed_widths: tuple[int, ...] = (),
    tensor_parallel_size: int = 1,  # (a step's time includes its all-reduces)
) -> dict:
    """The live fingerprint: what a table's measurements depend on (FINGERPRINT_KEYS)."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = device.type == "cuda"
    return {
        "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "target_hash": target_hash,
        "drafter_hash": drafter_hash,
        "draft_len": draft_len,
        "dtype": dtype,
        "graph_sizes": list(graph_sizes),
        "page_size": page_size,
        "engine_version": __version__,
        "trimmed_widths": list(trimmed_widths),
        "tensor_parallel_size": tensor_parallel_size,
    }


def full_block_tokens(g: int, draft_len: int) -> int:
    """V of the full-block cell of G rows: every row verifies its K drafts after its anchor."""
    return g * (draft_len + 1)


def check_table(table: CostTable, live: dict) -> str | None:
    """Why this table may not be used by the live engine, or None if it may."""
    fingerprint = {**FINGERPRINT_DEFAULTS, **table.fingerprint}
    missing = [k for k in FINGERPRINT_KEYS if k not in fingerprint]
    if missing:
        return f"fingerprint lacks {missing}"
    for key in FINGERPRINT_KEYS:
        if fingerprint[key] != live.get(key, FINGERPRINT_DEFAULTS.get(key)):
            return (f"fingerprint mismatch on {key}: table {fingerprint[key]!r}, "
                    f"live {live.get(key)!r}")  # fmt: skip
    if not table.cells:
        return "no cells"
    k = live["draft_len"]
    sampled = table.sampled_cells
    if sampled is not None and set(sampled) != set(table.cells):
        return (f"sampled cells are for G {sorted(sampled)}, the greedy cells for "
                f"{sorted(table.cells)}")  # fmt: skip
    for kind, cells in (("", table.cells), ("sampled ", sampled or {})):
        for g, row in cells.items():
            full = full_block_tokens(g, k)
            if full not in row:
                return f"G={g} has no {kind}full-block cell V={full}"
            unmeasured = [g * w for w in fingerprint["trimmed_widths"] if g * w not in row]
            if unmeasured:
                return f"G={g} has no {kind}trimmed cell V={unmeasured[0]} (unmeasured)"
            for v, t in row.items():
                if not (g <= v <= full):
                    return f"{kind}cell G={g} V={v} is outside [{g}, {full}]"
                if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
                    return f"{kind}cell G={g} V={v} has a malformed time {t!r}"
    return None


def parse_table(text: str) -> CostTable:
    """CostTable from JSON text; ValueError naming what is malformed."""
    try:
        raw = json.loads(text)
        fingerprint, cells = raw["fingerprint"], raw["cells"]
        parsed = {int(g): {int(v): t for v, t in row.items()} for g, row in cells.items()}
        sampled = raw.get("sampled_cells")
        if sampled is not None:
            sampled = {int(g): {int(v): t for v, t in row.items()} for g, row in sampled.items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"malformed cost table: {type(e).__name__}: {e}") from None
    if not isinstance(fingerprint, dict):
        raise ValueError("malformed cost table: fingerprint is not an object")
    return CostTable(fingerprint, parsed, sampled, raw.get("measured"))


def load_cost_table(path: str | Path, live: dict) -> tuple[CostTable | None, str | None]:
    """(table, None) if the file authenticates against the live fingerprint, else (None, why)."""
    try:
        table = parse_table(Path(path).read_text())
    except OSError as e:
        return None, f"cannot read {path}: {e.strerror or e}"
    except ValueError as e:
        return None, str(e)
    reason = check_table(table, live)
    return (None, reason) if reason else (table, None)


def flatness_reason(table: CostTable) -> str | None:
    """Why the profiler should refuse to write this table as flat, or None.

    Flat: in every G the step time of the cheapest and the dearest cell differ by less than
    MIN_SPREAD, so verifying fewer tokens (or not drafting) never saves measurable time and
    the planner could only ever pick the full block.
    """
    spreads = [max(row.values()) / min(row.values()) - 1 for row in table.cells.values()
               if len(row) > 1]  # fmt: skip
    if not spreads:
        return "every G has a single cell: nothing to choose between"
    if max(spreads) < MIN_SPREAD:
        return f"flat: step time varies by at most {max(spreads):.1%} within any G"
    return None
