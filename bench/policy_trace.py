"""Summarise a drafting policy's trace (DSPARK_POLICY_TRACE, dspark/spec/policy_trace.py).

    python bench/policy_trace.py TRACE.jsonl [--stretches N]

Per segment (between the bench's marks: arm, concurrency, repeat):
- steps and time by graph size G and mode (a decision's time runs to the next decision);
- the realised step periods by cell, split by whether the step admitted arrivals or carried a
  prefill (the condition the decision saw: waiting requests and free seats, or prefilling
  rows), as medians;
- every stretch without drafting: where it began (G, the full block's price over plain's as
  priced and in the table, the expected tokens per row drafting, the rows by kind, arrivals)
  and what ended it (the first drafting decision's reason and its stale and unseen rows).

Break-even, for reading the stretches: drafting pays when (R + S) / full > R / plain, that is
when 1 + S / R (expected tokens per row) exceeds full / plain (the price ratio).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from itertools import pairwise


def load(path: str) -> list[tuple[dict | None, list[dict]]]:
    """The trace's segments: (the mark that opened it, or None, its decisions)."""
    segments: list[tuple[dict | None, list[dict]]] = [(None, [])]
    with open(path) as f:
        for text in f:
            line = json.loads(text)
            if "mark" in line:
                segments.append((line["mark"], []))
            else:
                segments[-1][1].append(line)
    return [(mark, lines) for mark, lines in segments if lines]


def arrivals(line: dict) -> bool:
    """Whether the step decided here admits requests or carries a prefill."""
    return (line["waiting"] > 0 and line["seats"] > 0) or line["prefilling"] > 0


def price_ratio(line: dict, key: str = "priced") -> float | None:
    """The full block's price over plain decoding's at the decision's G."""
    cells = line.get(key)
    if not cells or line["cell"] is None:
        return None
    g = line["cell"][0]
    full = max(int(v) for v in cells)
    return cells[str(full)] / cells[str(g)] if full != g else None


def by_mode(lines: list[dict]) -> dict[tuple[int, bool], list[float]]:
    """(G, drafting) -> [steps, seconds] (a decision's time: until the next decision)."""
    out: dict[tuple[int, bool], list[float]] = defaultdict(lambda: [0, 0.0])
    for line, after in pairwise([*lines, None]):
        if line["cell"] is None:
            continue
        cell = out[(line["cell"][0], line["drafting"])]
        cell[0] += 1
        cell[1] += (after["t"] - line["t"]) if after is not None else 0.0
    return out


def periods(lines: list[dict]) -> dict[tuple[int, int, bool], list[float]]:
    """(G, V, arrivals) -> the realised periods StepPeriods counted for that cell."""
    out: dict[tuple[int, int, bool], list[float]] = defaultdict(list)
    for before, line in pairwise(lines):
        if line["period"] is not None:
            g, v = line["period"]["cell"]
            out[(g, v, arrivals(before))].append(line["period"]["seconds"])
    return out


def stretches(lines: list[dict]) -> list[dict]:
    """Each run of decisions without drafting (idle decisions end none), with its start and
    its end (None: the segment ended first)."""
    found, start = [], None
    for i, line in enumerate(lines):
        if line["cell"] is None:
            continue
        if not line["drafting"] and start is None:
            start = i
        elif line["drafting"] and start is not None:
            found.append({"start": lines[start], "steps": i - start, "end": line,
                          "seconds": line["t"] - lines[start]["t"]})  # fmt: skip
            start = None
    if start is not None:
        found.append({"start": lines[start], "steps": len(lines) - start, "end": None,
                      "seconds": lines[-1]["t"] - lines[start]["t"]})  # fmt: skip
    return found


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def report(path: str, max_stretches: int = 20) -> str:
    out = []
    for mark, lines in load(path):
        label = " ".join(f"{k}={v}" for k, v in mark.items()) if mark else "(before any mark)"
        wall = lines[-1]["t"] - lines[0]["t"]
        drafting = sum(line["drafting"] for line in lines if line["cell"] is not None)
        decided = sum(line["cell"] is not None for line in lines)
        out.append(f"== {label}: {len(lines)} decisions over {wall * 1e3:.1f} ms, "
                   f"{drafting} of {decided} priced ones drafting")  # fmt: skip
        for (g, d), (steps, seconds) in sorted(by_mode(lines).items()):
            mode = "drafting" if d else "plain"
            out.append(f"   G={g:<4} {mode:8} {steps:5d} steps {seconds * 1e3:9.1f} ms")
        for (g, v, arr), seconds in sorted(periods(lines).items()):
            median_ms = statistics.median(seconds) * 1e3
            out.append(f"   period G={g} V={v} {'arrivals' if arr else 'steady'}: "
                       f"{len(seconds)} x median {median_ms:.3f} ms")  # fmt: skip
        found = stretches(lines)
        if found:
            out.append(f"   {len(found)} stretches without drafting, "
                       f"{sum(s['steps'] for s in found)} steps:")  # fmt: skip
        for s in found[:max_stretches]:
            a, e = s["start"], s["end"]
            rows = max(a["R"], 1)
            out.append(
                f"     {s['steps']:4d} steps {s['seconds'] * 1e3:7.1f} ms from G={a['cell'][0]}: "
                f"price full/plain {_fmt(price_ratio(a))} (table {_fmt(price_ratio(a, 'table'))}), "
                f"tokens/row drafting {_fmt(1 + a.get('survival_sum', 0) / rows)}, "
                f"fresh/stale/unseen {a.get('fresh')}/{a.get('stale')}/{a.get('unseen')}, "
                f"arrivals {'yes' if arrivals(a) else 'no'}"
            )
            if e is not None:
                per_row = 1 + e.get("survival_sum", 0) / max(e["R"], 1)
                out.append(
                    f"          ended at G={e['cell'][0]} by {e['reason']!r}: price "
                    f"{_fmt(price_ratio(e))}, tokens/row {_fmt(per_row)}, "
                    f"stale {e.get('stale')}, unseen {e.get('unseen')}"
                )  # fmt: skip
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--stretches", type=int, default=20, help="stretches listed a segment")
    args = parser.parse_args()
    print(report(args.trace, args.stretches))


if __name__ == "__main__":
    main()
