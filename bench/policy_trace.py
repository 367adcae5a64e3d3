"""Summarise a drafting policy's trace (DSPARK_POLICY_TRACE, dspark/policy/trace.py).

    python bench/policy_trace.py TRACE.jsonl [--stretches N] [--decisions N]

Per segment (between the bench's marks: arm, concurrency, repeat):
- steps, time and the median step period by graph size G, mode and arrivals (a step's period
  runs to the next line: under async scheduling the pipeline's period), comparable across
  arms (an engine without a policy, plain or fixed K, has no G in its trace: its R rounded up
  to a power of two stands in);
- with a policy, the realised step periods it was taught by cell, split by arrivals, as
  medians;
- beside the period, the medians of its parts (traces that record them, host_split): the
  wait in the host synchronisation (the GPU's share), host work, and time off the CPU;
- every stretch without drafting: where it began (G, the full block's price over plain's as
  priced and in the table, the expected tokens per row drafting, the rows by kind, arrivals)
  and what ended it (the first drafting decision's reason and its stale and unseen rows),
  counted by cause (end_cause: stale rows, smaller G, new requests or prices);
- with --decisions N, the first N decisions one by one (e.g. how a fresh server's first wave
  seats and when drafting first goes off).

Break-even, for reading the stretches: drafting pays when (R + S) / full > R / plain, that is
when 1 + S / R (expected tokens per row) exceeds full / plain (the price ratio).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
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


def graph_size(line: dict) -> int:
    """The step's G: the decision's, or without a policy R rounded up to a power of two."""
    if line.get("cell"):
        return line["cell"][0]
    return 1 << max(line["R"] - 1, 0).bit_length()


def step_periods(lines: list[dict]) -> dict[tuple[int, bool, bool], list[float]]:
    """(G, drafting, arrivals) -> each step's period (its line to the next), idle ones left
    out (no running request)."""
    out: dict[tuple[int, bool, bool], list[float]] = defaultdict(list)
    for line, after in pairwise(lines):
        if line["R"]:
            out[(graph_size(line), line["drafting"], arrivals(line))].append(after["t"] - line["t"])
    return out


def host_split(lines: list[dict]) -> dict[tuple[int, bool, bool], list[tuple[float, ...]]]:
    """(G, drafting, arrivals) -> each step's (waiting in the host synchronisation, host work,
    off the CPU) in seconds, the keys of step_periods; empty for a trace written without them.

    The CUDA synchronisation spins, so the engine thread's CPU time includes its wait: host
    work is CPU time less the wait, and what the period holds beyond the CPU time is time the
    thread did not run (descheduled, or the GIL elsewhere)."""
    out: dict[tuple[int, bool, bool], list[tuple[float, ...]]] = defaultdict(list)
    for line, after in pairwise(lines):
        if line["R"] and "cpu_s" in line:
            cpu = after["cpu_s"] - line["cpu_s"]
            wait = after["wait_s"] - line["wait_s"]
            period = after["t"] - line["t"]
            key = (graph_size(line), line["drafting"], arrivals(line))
            out[key].append((wait, cpu - wait, period - cpu))
    return out


def periods(lines: list[dict]) -> dict[tuple[int, int, bool], list[float]]:
    """(G, V, arrivals) -> the realised periods StepPeriods counted for that cell."""
    out: dict[tuple[int, int, bool], list[float]] = defaultdict(list)
    for before, line in pairwise(lines):
        if line.get("period") is not None and line["period"]["cell"] is not None:
            g, v = line["period"]["cell"]  # (None: a decision without a table's cell)
            out[(g, v, arrivals(before))].append(line["period"]["seconds"])
    return out


def stretches(lines: list[dict]) -> list[dict]:
    """Each run of decisions without drafting (idle decisions end none), with its start and
    its end (None: the segment ended first)."""
    found, start = [], None
    for i, line in enumerate(lines):
        if line.get("cell") is None:
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


def end_cause(stretch: dict) -> str:
    """What brought drafting back: "stale rows" (survivals that went stale count K: the probe),
    "smaller G" (load fell, where the full block costs relatively less), "new requests"
    (unseen rows, at the population's mean), else "prices" (realised costs moved), or "none"
    (the segment ended first)."""
    a, e = stretch["start"], stretch["end"]
    if e is None:
        return "none"
    if e.get("stale"):
        return "stale rows"
    if e["cell"][0] < a["cell"][0]:
        return "smaller G"
    if e.get("unseen", 0) > a.get("unseen", 0):
        return "new requests"
    return "prices"


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def decisions(lines: list[dict], count: int) -> list[str]:
    """A segment's first `count` decisions, one a line: what a first wave looks like to the
    policy (its time from the segment's first decision, the rows, the decision and the full
    block's price over plain decoding's as priced then)."""
    out = [f"   first {min(count, len(lines))} decisions: ms, running R, waiting, prefilling, "
           "drafting, reason, cell, price full/plain, tokens/row drafting"]  # fmt: skip
    t0 = lines[0]["t"]
    for i, line in enumerate(lines[:count]):
        per_row = 1 + line.get("survival_sum", 0) / max(line["R"], 1)
        out.append(
            f"   {i:5d} {(line['t'] - t0) * 1e3:9.1f} R={line['R']:<4} w={line['waiting']:<4} "
            f"pf={line['prefilling']} {'draft' if line['drafting'] else 'plain'} "
            f"{line.get('reason', '-')!r} cell={line.get('cell')} "
            f"price {_fmt(price_ratio(line))} tokens/row {_fmt(per_row)}"
        )  # fmt: skip
    return out


def report(path: str, max_stretches: int = 20, max_decisions: int = 0) -> str:
    out = []
    for mark, lines in load(path):
        label = " ".join(f"{k}={v}" for k, v in mark.items()) if mark else "(before any mark)"
        wall = lines[-1]["t"] - lines[0]["t"]
        if any("reason" in line for line in lines):
            drafting = sum(line["drafting"] for line in lines if line.get("cell") is not None)
            decided = sum(line.get("cell") is not None for line in lines)
            what = f"{drafting} of {decided} priced decisions drafting"
        else:
            what = "no policy: " + ("fixed K" if lines[0]["drafting"] else "plain decoding")
        out.append(f"== {label}: {len(lines)} steps over {wall * 1e3:.1f} ms, {what}")
        split = host_split(lines)
        for key, seconds in sorted(step_periods(lines).items()):
            g, d, arr = key
            mode, when = "drafting" if d else "plain", "arrivals" if arr else "steady"
            median_ms = statistics.median(seconds) * 1e3
            text = (f"   G={g:<4} {mode:8} {when:8} {len(seconds):5d} steps "
                    f"{sum(seconds) * 1e3:9.1f} ms, median {median_ms:.3f} ms")  # fmt: skip
            if key in split:  # the period's parts (medians of each part)
                parts = zip(*split[key], strict=True)
                wait, work, off = (statistics.median(x) * 1e3 for x in parts)
                text += f" (sync wait {wait:.3f}, host work {work:.3f}, off CPU {off:.3f})"
            out.append(text)
        for (g, v, arr), seconds in sorted(periods(lines).items()):
            median_ms = statistics.median(seconds) * 1e3
            out.append(f"   taught G={g} V={v} {'arrivals' if arr else 'steady'}: "
                       f"{len(seconds)} x median {median_ms:.3f} ms")  # fmt: skip
        if max_decisions:
            out += decisions(lines, max_decisions)
        found = stretches(lines)
        if found:
            causes = Counter(end_cause(s) for s in found)
            out.append(f"   {len(found)} stretches without drafting, "
                       f"{sum(s['steps'] for s in found)} steps; ended by "
                       + ", ".join(f"{c}: {n}" for c, n in causes.most_common()) + ":")  # fmt: skip
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
    parser.add_argument(
        "--decisions",
        type=int,
        default=0,
        help="a segment's first N decisions listed one by one (a first wave)",
    )
    args = parser.parse_args()
    print(report(args.trace, args.stretches, args.decisions))


if __name__ == "__main__":
    main()
