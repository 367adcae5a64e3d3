"""`dspark bench serve`'s figures: one level's summary, the terminal table and the plot.

Goodput (DistServe's measure, as vLLM's bench reports it) is the rate of requests that met
every given SLO: a server that is fast on average but misses the TTFT target for a third of its
requests has a goodput a third below its throughput.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dspark.benchmarks.serve_client import RequestRecord

SLO_NAMES = ("ttft", "tpot", "e2e")


def stats_ms(samples: list[float]) -> dict[str, float | None]:
    if not samples:
        return {"mean": None, "median": None, "p99": None}
    ms = np.asarray(samples) * 1e3
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "p99": float(np.percentile(ms, 99)),
    }


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.e2e}
    for name, limit in slos_ms.items():
        value = values[name]
        if name == "tpot" and value is None and record.output_tokens == 1:
            continue  # one token: no time per output token to judge
        if value is None or value * 1e3 > limit:
            return False
    return record.ok


def summarize(records: list[RequestRecord], wall_s: float, slos_ms: dict[str, float]) -> dict:
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    errors = sorted({r.error for r in records if not r.ok and r.error})
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "errors": errors[:5],
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(done) / wall_s if wall_s > 0 else None,
        "goodput_requests_per_s": (
            sum(meets_slos(r, slos_ms) for r in done) / wall_s if slos_ms and wall_s > 0 else None
        ),
        "ttft_ms": stats_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": stats_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": stats_ms([gap for r in done for gap in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in done if r.e2e is not None]),
    }


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: dict) -> str:
    """level | ok/sent | tok/s | goodput | TTFT, TPOT, ITL median/p99 ms | acceptance length."""
    head = f"{'level':>10} {'ok/sent':>9} {'tok/s':>9} {'goodput':>8}"
    head += "".join(f" {name + ' med/p99 ms':>19}" for name in ("TTFT", "TPOT", "ITL"))
    lines = [head + f" {'tau':>5}"]
    for level in results["levels"]:
        s = level["summary"]
        row = f"{level['label']:>10} {s['num_completed']:>4}/{s['num_requests']:<4} "
        row += f"{_fmt(s['output_tokens_per_s']):>9} {_fmt(s['goodput_requests_per_s'], '.2f'):>8}"
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            cell = f"{_fmt(s[key]['median'])}/{_fmt(s[key]['p99'])}"
            row += f" {cell:>19}"
        tau = (level.get("speculation") or {}).get("mean_acceptance_length")
        lines.append(row + f" {_fmt(tau, '.2f'):>5}")
    return "\n".join(lines)


def plot_results(json_path: str | Path, png_path: str | Path) -> Path:
    """Two panels over the levels: output tokens/s (and goodput); TTFT, TPOT, ITL median/p99."""
    from matplotlib.figure import Figure

    from dspark.benchmarks.plot import save_png

    results = json.loads(Path(json_path).read_text())
    levels = results["levels"]
    xs = list(range(len(levels)))  # evenly spaced, labelled with the levels (a rate may be inf)
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    throughput, latency = fig.subplots(1, 2)
    throughput.plot(
        xs,
        [lv["summary"]["output_tokens_per_s"] for lv in levels],
        marker="o",
        label="output tok/s",
    )
    throughput.set(xlabel=results["level_name"], ylabel="output tok/s", title="throughput")
    goodput = [lv["summary"]["goodput_requests_per_s"] for lv in levels]
    if any(g is not None for g in goodput):
        requests = throughput.twinx()
        requests.plot(xs, goodput, marker="s", color="tab:green", label="goodput req/s")
        requests.set_ylabel("goodput req/s (all SLOs met)")
        requests.legend(loc="lower right", fontsize=8)
    for key, marker in (("ttft_ms", "o"), ("tpot_ms", "^"), ("itl_ms", "s")):
        for stat, style in (("median", "-"), ("p99", "--")):
            ys = [lv["summary"][key][stat] for lv in levels]
            name = key.removesuffix("_ms").upper()
            latency.plot(xs, ys, style, marker=marker, label=f"{name} {stat}")
    latency.set(xlabel=results["level_name"], ylabel="ms", yscale="log", title="latency")
    for ax in (throughput, latency):
        ax.set_xticks(xs, labels=[lv["label"] for lv in levels])
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(
        f"{results['model']} at {results['base_url']} "
        f"({results['endpoint']}, output_len {results['output_len']}, "
        f"{results.get('git_commit') or 'no commit'})",
        fontsize=9,
    )
    return save_png(fig, Path(png_path), dpi=120)
