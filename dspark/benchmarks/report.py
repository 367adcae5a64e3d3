"""The bench's record: environment, dspark/HF and arm ratios, the JSON file, terminal tables."""

from __future__ import annotations

import json
import logging
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from importlib.util import find_spec
from pathlib import Path

import torch

from dspark import envs

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]


def ratios(concurrency: tuple[int, ...], dspark: dict | None, hf: dict | None) -> list[dict]:
    """dspark/HF output tokens/s per level; None where either side did not run."""
    dspark_tok = {lv["concurrency"]: lv["output_tokens_per_s"] for lv in measured_levels(dspark)}
    hf_tok = {lv["concurrency"]: lv["output_tokens_per_s"] for lv in measured_levels(hf)}
    rows = []
    for c in concurrency:
        d, h = dspark_tok.get(c), hf_tok.get(c)
        rows.append({"concurrency": c, "dspark_tok_s": d, "hf_tok_s": h, "ratio": _div(d, h)})
    return rows


def arm_ratios(concurrency: tuple[int, ...], arms: dict[str, dict]) -> list[dict]:
    """Per level: each arm's output tokens/s (the median of its repeats), over the first arm's
    (the baseline) and over the best other arm's; None where an arm did not run, or
    (vs_best_other) there is no other arm.

    The arms run each repeat in turn (offline_sweep.py), so a repeat's arms share the host's
    state: the paired ratios take each repeat's ratio within it, then the median over repeats
    ("paired_vs_first", "paired_vs_best_other"). On a host whose throughput drifts between
    repeats (docs/PERFORMANCE.md, Measurement noise) they spread less than the ratio of medians.

    e.g. {"concurrency": 4, "output_tokens_per_s": {"plain": 100.0, "k7": 150.0},
          "vs_first": {"plain": 1.0, "k7": 1.5}, "vs_best_other": {"plain": 0.67, "k7": 1.5},
          "paired_vs_first": {...}, "paired_vs_best_other": {...}}
      runs plain [100, 50, 120], k7 [150, 80, 150] -> paired k7 / plain median(1.5, 1.6, 1.25)
    """
    measured = {name: {lv["concurrency"]: lv for lv in measured_levels(arm)}
                for name, arm in arms.items()}  # fmt: skip
    baseline = next(iter(arms))
    rows = []
    for c in concurrency:
        levels = {name: by_c.get(c) for name, by_c in measured.items()}
        tok_s = {name: lv and lv["output_tokens_per_s"] for name, lv in levels.items()}
        best_other = {name: _best_other(tok_s, name) for name in tok_s}
        runs = {name: lv and lv.get("output_tokens_per_s_runs") for name, lv in levels.items()}
        rows.append(
            {
                "concurrency": c,
                "output_tokens_per_s": tok_s,
                "vs_first": {name: _div(x, tok_s[baseline]) for name, x in tok_s.items()},
                "vs_best_other": {name: _div(x, best_other[name]) for name, x in tok_s.items()},
                "paired_vs_first": {name: _paired(runs[name], [runs[baseline]]) for name in runs},
                "paired_vs_best_other": {
                    name: _paired(runs[name], [r for other, r in runs.items() if other != name])
                    for name in runs
                },
            }
        )
    return rows


def _paired(runs: list[float] | None, others: list[list[float] | None]) -> float | None:
    """The median over repeats of runs[i] / max(other[i] over others), over the other arms that
    ran as many repeats; None without runs or such an arm."""
    others = [o for o in others if o is not None and runs and len(o) == len(runs)]
    if not runs or not others:
        return None
    return statistics.median(x / max(o[i] for o in others) for i, x in enumerate(runs))


def _best_other(tok_s: dict[str, float | None], name: str) -> float | None:
    others = [x for other, x in tok_s.items() if other != name and x is not None]
    return max(others, default=None)


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None else None


def measured_levels(engine_results: dict | None) -> list[dict]:
    """The levels that ran (the HF peer records skipped ones with their reason)."""
    levels = (engine_results or {}).get("levels", [])
    return [lv for lv in levels if not lv.get("skipped", False)]


def environment(device: torch.device) -> dict:
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        **git_state(),
    }


def git_state() -> dict:
    """The commit measured, and whether uncommitted edits were part of it. DSPARK_GIT_COMMIT,
    when set, names the commit instead: a tree copied without its .git (the device machine's)
    would otherwise report whatever repository git finds above it."""
    named = envs.ENVS.git_commit
    if named:
        return {"git_commit": named, "git_dirty": None}

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    status = git("status", "--porcelain") if commit else None
    return {"git_commit": commit, "git_dirty": bool(status) if status is not None else None}


def write_results(results: dict, out: Path, plot: Path | None, draw) -> None:
    """The JSON first (the record), then the plot drawn from it by `draw(json, png)`."""
    has_plot = plot is not None and find_spec("matplotlib") is not None
    if plot is not None and not has_plot:
        logger.warning("matplotlib is not installed: no plot (pip install matplotlib)")
    results["plot"] = str(plot) if has_plot else None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    if has_plot:
        draw(out, plot)
    print(f"wrote {out}" + (f" and {plot}" if has_plot else ""), file=sys.stderr)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def synthetic_banner(results: dict) -> str:
    """The line above every table of a synthetic-acceptance run."""
    synthetic = results["synthetic"]
    taus = ", ".join(f"{k}: {t:.2f}" for k, t in synthetic["expected_tau_by_k"].items())
    return (f"SYNTHETIC acceptance {synthetic['profile']} (rates {synthetic['rates']}, seed "
            f"{synthetic['seed']}; expected tau by K {taus}): real forwards, acceptance by the "
            "profile")  # fmt: skip


def format_overhead_table(results: dict) -> str | None:
    """Per arm with a drafting policy and level: its host time per step (decide, observe, the
    trace line, total, microseconds) and the total's share of the level's wall time; None
    when no arm has a policy."""
    sweeps = results.get("arms") or {"dspark": results.get("dspark") or {}}
    lines = []
    for name, sweep in sweeps.items():
        for level in sweep.get("levels", []):
            o = level.get("scheduling_overhead")
            if o is None:
                continue
            share = None if o["share_of_wall"] is None else 100 * o["share_of_wall"]
            lines.append(
                f"{name:>12} {level['concurrency']:>5} {o['decide_us_per_step']:>9.1f} "
                f"{o['observe_us_per_step']:>10.1f} {o['trace_us_per_step']:>8.1f} "
                f"{o['total_us_per_step']:>8.1f} {_fmt(share, '.2f'):>8}"
            )
    if not lines:
        return None
    header = f"{'arm':>12} {'C':>5} {'decide us':>9} {'observe us':>10} {'trace us':>8} "
    header += f"{'total us':>8} {'% wall':>8}"
    return "\n".join(["scheduling overhead per step", header, *lines])


def format_table(results: dict) -> str:
    """C | dspark tok/s | HF tok/s | ratio | TTFT p50/p99 ms | TPOT p50/p99 ms (dspark's)."""
    dspark = {lv["concurrency"]: lv for lv in measured_levels(results["dspark"])}
    hf_all = {lv["concurrency"]: lv for lv in (results["hf"] or {}).get("levels", [])}
    header = f"{'C':>5} {'dspark tok/s':>13} {'HF tok/s':>10} {'ratio':>6} "
    header += f"{'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>17}"
    lines = [synthetic_banner(results), header] if results.get("synthetic") else [header]
    for row in results["ratios"]:
        c = row["concurrency"]
        hf = hf_all.get(c)
        hf_text = "skipped" if hf and hf["skipped"] else _fmt(row["hf_tok_s"], ".1f")
        lv = dspark.get(c, {})
        ttft, tpot = lv.get("ttft_ms", {}), lv.get("tpot_ms", {})
        lat = [f"{_fmt(d.get('p50'), '.1f')}/{_fmt(d.get('p99'), '.1f')}" for d in (ttft, tpot)]
        lines.append(
            f"{c:>5} {_fmt(row['dspark_tok_s'], '.1f'):>13} {hf_text:>10} "
            f"{_fmt(row['ratio'], '.2f'):>6} {lat[0]:>17} {lat[1]:>17}"
        )
    return "\n".join(lines)


def format_arms_table(results: dict) -> str:
    """C | each arm's tok/s | each other arm / the first arm (the baseline)."""
    names = list(results["arms"])
    first = names[0]
    headers = [f"{name} tok/s" for name in names] + [f"{name}/{first}" for name in names[1:]]
    widths = [max(len(h), 8) for h in headers]
    lines = [f"{'C':>5} " + " ".join(f"{h:>{w}}" for h, w in zip(headers, widths, strict=True))]
    if results.get("synthetic"):
        lines.insert(0, synthetic_banner(results))
    for row in results["arm_ratios"]:
        cells = [_fmt(row["output_tokens_per_s"][name], ".1f") for name in names]
        cells += [_fmt(row["vs_first"][name], ".2f") for name in names[1:]]
        text = " ".join(f"{cell:>{w}}" for cell, w in zip(cells, widths, strict=True))
        lines.append(f"{row['concurrency']:>5} {text}")
    return "\n".join(lines)


def format_paired_table(results: dict) -> str:
    """C | each arm over the best other arm, paired within each repeat (arm_ratios)."""
    names = list(results["arms"])
    widths = [max(len(name), 6) for name in names]
    lines = [
        "each arm / the best other arm, the median of each repeat's ratio",
        f"{'C':>5} " + " ".join(f"{n:>{w}}" for n, w in zip(names, widths, strict=True)),
    ]
    for row in results["arm_ratios"]:
        cells = [_fmt(row["paired_vs_best_other"][name], ".3f") for name in names]
        text = " ".join(f"{cell:>{w}}" for cell, w in zip(cells, widths, strict=True))
        lines.append(f"{row['concurrency']:>5} {text}")
    return "\n".join(lines)
