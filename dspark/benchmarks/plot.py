"""Draw a bench results JSON: throughput and TPOT against concurrency (`dspark bench --plot-from`).

The plot is drawn from the JSON alone, so any earlier run can be redrawn. matplotlib's Figure is
used without pyplot: no GUI backend is chosen, and a caller's interactive session is untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.benchmarks.report import measured_levels


def _title(results: dict) -> str:
    commit = results.get("git_commit") or "no commit"
    return (
        f"{Path(str(results.get('model_path') or results['model'])).name}  {results['dtype']}  "
        f"output_len {results['output_len']}  on {results['device']}  ({commit})"
    )


def plot_results(json_path: str | Path, png_path: str | Path) -> Path:
    """Two panels: output tokens/s (both engines) and dspark's TPOT p50/p99, log-x concurrency."""
    from matplotlib.figure import Figure

    results = json.loads(Path(json_path).read_text())
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    throughput, tpot = fig.subplots(1, 2)
    for label, key, marker in (("dspark", "dspark", "o"), ("HF transformers", "hf", "s")):
        levels = measured_levels(results.get(key))
        if levels:
            xs = [lv["concurrency"] for lv in levels]
            tok_s = [lv["output_tokens_per_s"] for lv in levels]
            throughput.plot(xs, tok_s, marker=marker, label=label)
    throughput.set(xscale="log", xlabel="concurrency (requests at once)", ylabel="output tok/s")
    throughput.set_title("throughput")
    levels = [
        lv for lv in measured_levels(results.get("dspark")) if lv["tpot_ms"]["p50"] is not None
    ]
    if levels:
        xs = [lv["concurrency"] for lv in levels]
        tpot.plot(xs, [lv["tpot_ms"]["p50"] for lv in levels], marker="o", label="dspark p50")
        tpot.plot(xs, [lv["tpot_ms"]["p99"] for lv in levels], marker="^", label="dspark p99")
    tpot.set(xscale="log", xlabel="concurrency (requests at once)", ylabel="TPOT ms")
    tpot.set_title("time per output token")
    for ax in (throughput, tpot):
        # the levels themselves as ticks: 1, 4, 16 read better than 10^0, 10^1
        ax.set_xticks(results["concurrency"], labels=[str(c) for c in results["concurrency"]])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(_title(results), fontsize=9)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=120)
    return png_path
