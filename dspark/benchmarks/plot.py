"""Draw a bench results JSON: throughput and TPOT against concurrency (`dspark bench --plot-from`),
one line per arm when the run had --arms.

The plot is drawn from the JSON alone, so any earlier run can be redrawn. matplotlib's Figure is
used without pyplot: no GUI backend is chosen, and a caller's interactive session is untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.benchmarks.report import measured_levels

ARM_MARKERS = ("o", "D", "v", "P", "X", "*", "<", ">")  # the HF peer's line is "s"


def save_png(fig, path: Path, dpi: int) -> Path:
    """fig as a PNG of 256 palette colours: line plots lose nothing visible and take about a
    third of the bytes (the committed result plots travel to the device with the tree)."""
    import io

    from PIL import Image  # (matplotlib's own dependency)

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    image = Image.open(buf).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, optimize=True)
    return path


def _title(results: dict) -> str:
    commit = results.get("git_commit") or "no commit"
    return (
        f"{Path(str(results.get('model_path') or results['model'])).name}  {results['dtype']}  "
        f"output_len {results['output_len']}  on {results['device']}  ({commit})"
    )


def _arm_lines(results: dict) -> list[tuple[str, dict | None, str]]:
    """(name, sweep, marker) per arm; a run without --arms has one, "dspark"."""
    arms = results.get("arms") or {"dspark": results.get("dspark")}
    markers = [ARM_MARKERS[i % len(ARM_MARKERS)] for i in range(len(arms))]
    return [(name, sweep, m) for (name, sweep), m in zip(arms.items(), markers, strict=True)]


def _throughput(ax, results: dict) -> None:
    """One line per arm (or the one dspark sweep), then the HF peer's."""
    lines = [*_arm_lines(results), ("HF transformers", results.get("hf"), "s")]
    for label, sweep, marker in lines:
        levels = measured_levels(sweep)
        if levels:
            xs = [lv["concurrency"] for lv in levels]
            ax.plot(xs, [lv["output_tokens_per_s"] for lv in levels], marker=marker, label=label)
    ax.set(xscale="log", xlabel="concurrency (requests at once)", ylabel="output tok/s")
    ax.set_title("throughput")


def _tpot(ax, results: dict) -> None:
    """Each arm's p50, or without arms dspark's p50 and p99."""
    if "arms" in results:
        curves = [(f"{name} p50", sweep, "p50", m) for name, sweep, m in _arm_lines(results)]
    else:
        dspark = results.get("dspark")
        curves = [("dspark p50", dspark, "p50", "o"), ("dspark p99", dspark, "p99", "^")]
    for label, sweep, key, marker in curves:
        levels = [lv for lv in measured_levels(sweep) if lv["tpot_ms"][key] is not None]
        if levels:
            xs = [lv["concurrency"] for lv in levels]
            ax.plot(xs, [lv["tpot_ms"][key] for lv in levels], marker=marker, label=label)
    ax.set(xscale="log", xlabel="concurrency (requests at once)", ylabel="TPOT ms")
    ax.set_title("time per output token")


def _verify_budget(ax, results: dict) -> None:
    """Per speculative arm: drafted tokens sent to verification per output token, the verify
    budget the arm chose on average (fixed K = 7 sends about 7 / tau; plain decoding 0)."""
    for i, (label, sweep, marker) in enumerate(_arm_lines(results)):
        levels = [lv for lv in measured_levels(sweep) if lv.get("speculation")]
        if levels:  # a level's speculation counters cover all its repeats
            xs = [lv["concurrency"] for lv in levels]
            ys = [lv["speculation"]["num_draft_tokens"]
                  / max(1, lv["output_tokens"] * len(lv.get("output_tokens_per_s_runs") or [1]))
                  for lv in levels]  # fmt: skip
            ax.plot(xs, ys, marker=marker, label=label, color=f"C{i}")  # the arm's colour
    ax.set(xscale="log", xlabel="concurrency (requests at once)",
           ylabel="verified draft tokens per output token")  # fmt: skip
    ax.set_title("verify budget")


def _has_speculation(results: dict) -> bool:
    return any(lv.get("speculation") for _, sweep, _ in _arm_lines(results)
               for lv in measured_levels(sweep))  # fmt: skip


def plot_results(json_path: str | Path, png_path: str | Path) -> Path:
    """Log-x concurrency panels: output tokens/s (each arm or dspark, and HF), TPOT (each arm's
    p50, or dspark's p50/p99) and, when an arm speculates, its verify budget."""
    from matplotlib.figure import Figure

    results = json.loads(Path(json_path).read_text())
    spec = _has_speculation(results)
    fig = Figure(figsize=(16.5 if spec else 11, 4.5), layout="constrained")
    axes = fig.subplots(1, 3 if spec else 2)
    _throughput(axes[0], results)
    _tpot(axes[1], results)
    if spec:
        _verify_budget(axes[2], results)
    for ax in axes:
        # the levels themselves as ticks: 1, 4, 16 read better than 10^0, 10^1
        ax.set_xticks(results["concurrency"], labels=[str(c) for c in results["concurrency"]])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(_title(results), fontsize=9)
    return save_png(fig, Path(png_path), dpi=120)
