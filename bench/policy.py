"""The drafting policy on the CPU: its trace summarised, its choices replayed at a GPU's
prices, its host work a step.

    python bench/policy.py trace TRACE.jsonl [...] [--stretches N] [--decisions N]
    PYTHONPATH=. python bench/policy.py replay --table dspark/drafters/smollm2_135m_instruct/\\
        cost_tables/h200_torch2.11_cu130.json --concurrency 1,4 --num-prompts 12 \\
        --output-len 256 --ahead --out r.json
    python bench/policy.py host-cost --batch 1,16,64,256 --out policy_host_cost.json

trace      summarises a trace (DSPARK_POLICY_TRACE=DIR): time by graph size and mode, every
           stretch without drafting and what ended it
replay     the policy's choices at concurrency C with the real target and drafter on the CPU,
           priced by a GPU's cost table: which arms are worth taking to the GPU
host-cost  the policy's host work a step (decide, observe, the trace line) at R running rows:
           the scheduling overhead

`python bench/policy.py COMMAND --help` tells each one's method.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

from dspark import LLM, SamplingParams
from dspark.benchmarks.prompts import default_prompts_dir, load_prompts
from dspark.engine.spec_setup import probe_steps
from dspark.models.loader import default_model_path
from dspark.policy.cost_table import COST_TABLES_DIR, CostTable, full_block_tokens, parse_table
from dspark.policy.policy import DraftingPolicy
from dspark.policy.survival import host_survivals
from dspark.policy.trace import PolicyTrace
from dspark.policy.tuning import TUNING
from dspark.spec.calibration import load_calibration

TRACE_DOC = """\
Summarise a drafting policy's trace (DSPARK_POLICY_TRACE, dspark/policy/trace.py).

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

REPLAY_DOC = """\
The drafting policy's choices at concurrency C, priced by a GPU's cost table, on the CPU.

Each arm runs the real target and drafter (fp32, on the CPU) over the benchmark's held-out
prompts with C requests in flight (`generate` with max_num_seqs C: as one ends the next is
admitted), greedy, so every arm emits the same tokens and only the steps differ (with
--temperature T > 0 each request samples with its own seed: the arms' tokens then differ, their
distribution does not, and the steps are priced by the table's sampled cells). Every arm's
policy decides from a copy of a table under this engine's fingerprint, by the table alone (no
realised step cost counts: CPU step times say nothing about the GPU's), and every step it
decides is priced by the GPU's table:

    modeled time = sum over steps of t(G, V) of the step's cell
                   (V = G: plain decoding; V = G (K + 1): the full block)

    arm "plain": a table where drafting never pays (plain decoding, priced as plain cells)
    arm "k7":    a table where drafting always pays (fixed K, priced as full blocks)
    other arms:  the GPU's own table, with other policy constants (--arms: PolicyTuning fields,
                 dspark/policy/tuning.py)

    H200 table, t(1, 1) 0.727 ms, t(1, 8) 1.293 ms; 2,048 decode tokens at C = 1:
      plain decoding       2,048 steps                     -> 1,489 ms
      fixed K, tau 2.5       819 drafting steps             -> 1,059 ms   (1.41x plain)
      a policy, tau 2.6      700 drafting + 230 plain steps -> 1,072 ms   (1.39x plain)

--ahead lays every arm's windows out K + 1 wide, as CUDA graphs do, so drafting steps launch
ahead of the one in flight and each decision reads survivals two blocks old, as on a GPU (the
CPU computes each step before the next is decided all the same; only the order of decisions and
reads changes). The arm key "decision_lag" (1 or 2) overrides the policy's persistence fit's
pairing there (policy/survival.py).

A model, not a measurement of the GPU: it leaves out what the table does not hold (prefill
carried by a step, switches between plain and drafting graphs, host gaps), and the CPU's fp32
acceptance is close to the GPU's bf16, not equal. What it shows is what each arm's choices are
worth at the GPU's prices, with the acceptance the real drafter has, in minutes on the CPU:
which arms to take to the GPU.
"""

HOST_COST_DOC = """\
Host cost of the drafting policy per engine step (the scheduling overhead issue 6 bounds).

With the shipped drafter's H200 cost table and calibration, R running requests whose last
blocks were observed: times decide() (before every step: the O(R) survival sum and the cell
choice; after a drafting step, its blocks just observed, and while drafting is off, no block
observed between decisions and two requests ending and two arriving a step: "not drafting"),
the survivals of a drafting step's [R, K] raw confidences (computed once a step for the
metrics and the policy: every speculative engine pays them), observe_survivals() (the policy's
share after a drafting step: its estimates and the recalibration) and a step trace's line
after a decision (DSPARK_POLICY_TRACE), medians over --steps calls in microseconds. The list
of running ids is built per call, as the engine builds it. The policy does no device work: the
confidences it reads come back with the drafting step's one sync. Its share of a step is these
figures over the step times of docs/PERFORMANCE.md.
"""

DRAFTER = Path(__file__).resolve().parents[1] / "dspark/drafters/smollm2_135m_instruct"
MAX_MODEL_LEN = 1024  # replay: the benchmark's prompts and 256 tokens fit


# ---- trace ---------------------------------------------------------------------------------


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


def trace(args: argparse.Namespace) -> int:
    for path in args.trace:  # (one file a traced engine: a bench's arms, a server's processes)
        if len(args.trace) > 1:
            print(f"# {path}")
        print(report(path, args.stretches, args.decisions))
    return 0


# ---- replay --------------------------------------------------------------------------------


def tables(gpu: CostTable, fingerprint: dict, draft_len: int, folder: Path) -> dict[str, Path]:
    """The GPU table's cells under this engine's fingerprint, and the never / always drafting
    tables of the plain and fixed-K arms (the same G, V cells)."""

    def scaled(table: CostTable | None, full_over_plain: float) -> dict | None:
        if table is None:  # (no sampled cells)
            return None
        return {g: {g: row[g], full_block_tokens(g, draft_len): full_over_plain * row[g]}
                for g, row in table.cells.items()}  # fmt: skip

    paths = {}
    for name, cells, sampled in (
        ("gpu", gpu.cells, gpu.sampled_cells),
        ("never", scaled(gpu, 100.0), scaled(gpu.for_sampling(), 100.0)),
        ("always", scaled(gpu, 0.5), scaled(gpu.for_sampling(), 0.5)),
    ):
        paths[name] = folder / f"{name}.json"
        paths[name].write_text(CostTable(fingerprint, cells, sampled).to_json())
    return paths


def run_arm(model: str, spec: dict, prompts: list[list[int]], output_len: int,
            concurrency: int, gpu: CostTable, temperature: float = 0.0,
            ahead: bool = False, tuning: dict | None = None) -> dict:  # fmt: skip
    """The arm's tokens, its steps by cell and their modeled time (at temperature > 0 priced
    by the table's sampled cells, request i seeded with i). ahead: drafting steps launch
    ahead of the one in flight, as with CUDA graphs (windows laid out K + 1 wide), and the
    policy knows it (probe_steps and decision_lag 2, what engine/spec_setup.py gives it on a
    GPU); `tuning`: the arm's PolicyTuning fields, and "decision_lag", which overrides the
    policy's."""
    tuning = dict(tuning or {})
    decision_lag = tuning.pop("decision_lag", None)
    # the engine's policy built with the arm's constants, pricing by the table alone
    constants = replace(TUNING, min_price_steps=math.inf, **tuning)
    tuned = functools.partial(DraftingPolicy, tuning=constants)
    with mock.patch("dspark.engine.spec_setup.DraftingPolicy", tuned):
        llm = LLM(model, dtype="float32", device="cpu", max_num_seqs=concurrency,
                  max_model_len=MAX_MODEL_LEN, speculative_config=spec)  # fmt: skip
    policy = llm.engine.policy
    assert policy is not None and policy.table is not None, llm.get_metrics()["scheduling"]
    if ahead:  # (what build_policy derives on a GPU, where graphs lay the windows out so)
        llm.engine.runner.spec_runner.uniform_windows = True
        policy.probe_steps = policy.estimates.decision_lag = probe_steps(
            llm.engine.config, llm.engine.runner.spec_runner
        )
    if decision_lag is not None:
        policy.estimates.decision_lag = decision_lag
    cells: list[tuple[int, int]] = []
    decide = policy.decide

    def logged(request_ids, sampled=False):
        decision = decide(request_ids, sampled)
        if decision.cell is not None:
            cells.append(decision.cell)
        return decision

    policy.decide = logged
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=output_len,
                             ignore_eos=True) for i in range(len(prompts))]  # fmt: skip
    prices = gpu.for_sampling() if temperature > 0 else gpu
    assert prices is not None, "the table has no sampled cells to price temperature > 0 by"
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params,
                           use_tqdm=False)  # fmt: skip
    m = llm.get_metrics()
    by_cell = Counter(cells)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "steps_by_cell": {f"G={g} V={v}": n for (g, v), n in sorted(by_cell.items())},
        "drafting_steps": sum(n for (g, v), n in by_cell.items() if v > g),
        "plain_steps": sum(n for (g, v), n in by_cell.items() if v == g),
        "modeled_ms": 1e3 * sum(n * prices.cells[g][v] for (g, v), n in by_cell.items()),
        "acceptance_length": m.get("mean_acceptance_length"),
        "policy": dict(m.get("drafting_policy", {})), "cpu_seconds": time.perf_counter() - start,
        "persistence": policy.estimates.persistence,  # the fitted rho at the end
        "launched_ahead": llm.engine.runner.stats["spec_steps_launched_ahead"],
    }  # fmt: skip


def replay(args: argparse.Namespace) -> int:
    model = args.model or str(default_model_path())

    gpu = parse_table(Path(args.table).read_text())
    probe = LLM(model, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
                speculative_config={"method": "dspark", "scheduling": False})  # fmt: skip
    k, tok = probe.engine.spec.draft_len, probe.get_tokenizer()
    paths = tables(gpu, probe.engine.cost_fingerprint(), k, Path(tempfile.mkdtemp()))
    del probe
    convs = load_prompts(default_prompts_dir())  # the package's held-out prompts
    prompts = [tok.apply_chat_template(c) for c in convs[: args.num_prompts]]
    arms = {"plain": ({"method": "dspark", "cost_table": str(paths["never"])}, {}),
            "k7": ({"method": "dspark", "cost_table": str(paths["always"])}, {})}  # fmt: skip
    for name, tuning in json.loads(args.arms).items():
        arms[name] = ({"method": "dspark", "cost_table": str(paths["gpu"])}, tuning)

    levels = []
    for c in (int(x) for x in args.concurrency.split(",")):
        results = {}
        for name, (spec, tuning) in arms.items():
            results[name] = run_arm(
                model,
                spec,
                prompts,
                args.output_len,
                c,
                gpu,
                args.temperature,
                args.ahead,
                tuning,
            )
            r = results[name]
            print(f"C={c} {name}: {r['drafting_steps']} drafting + {r['plain_steps']} plain "
                  f"steps, {r['modeled_ms']:.0f} ms modeled ({r['cpu_seconds']:.0f} s on the "
                  f"CPU)", file=sys.stderr, flush=True)  # fmt: skip
        same = all(r["tokens"] == results["plain"]["tokens"] for r in results.values())
        for r in results.values():
            r.pop("tokens")
        levels.append({"concurrency": c, "tokens_equal_plain": same, "arms": results})

    g1 = (gpu.for_sampling() if args.temperature > 0 else gpu).cells[1]
    kind = f"temperature {args.temperature:g}" if args.temperature > 0 else "greedy"
    print(
        f"{len(prompts)} prompts x {args.output_len} {kind} tokens; GPU table t(1,1) "
        f"{g1[1] * 1e3:.3f} ms, t(1,{k + 1}) {g1[full_block_tokens(1, k)] * 1e3:.3f} ms"
    )
    print(
        f"{'C':>4} {'arm':>12} {'drafting':>9} {'plain':>7} {'tau':>5} {'switches':>9} "
        f"{'modeled ms':>11} {'x plain':>8} {'x k7':>6} {'rho':>5} {'ahead':>6}"
    )
    for level in levels:
        arms_ = level["arms"]
        for name, r in arms_.items():
            tau = r["acceptance_length"] or 0
            switches = r["policy"].get("drafting_switches", 0)
            print(f"{level['concurrency']:>4} {name:>12} {r['drafting_steps']:>9} "
                  f"{r['plain_steps']:>7} {tau:>5.2f} {switches:>9} {r['modeled_ms']:>11.0f} "
                  f"{arms_['plain']['modeled_ms'] / r['modeled_ms']:>8.2f} "
                  f"{arms_['k7']['modeled_ms'] / r['modeled_ms']:>6.2f} "
                  f"{r['persistence']:>5.2f} {r['launched_ahead']:>6}")  # fmt: skip
        if not level["tokens_equal_plain"] and args.temperature == 0:
            print(f"C={level['concurrency']}: an arm's tokens differ from plain decoding's")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "table": args.table, "num_prompts": len(prompts), "output_len": args.output_len,
            "median_prompt_len": statistics.median(len(p) for p in prompts), "levels": levels,
        }, indent=1))  # fmt: skip
    return 0 if all(level["tokens_equal_plain"] for level in levels) else 1


# ---- host cost -----------------------------------------------------------------------------


def _median_us(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(times)


class _Request:  # the engine passes [req.request_id for req in scheduler.running]
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


def _measure(r: int, table, temperatures: dict, steps: int, greedy_rows: str = "half") -> dict:
    # as the engine builds it with drafting steps launched ahead (engine/spec_setup.py
    # build_policy): a probe of two steps, each decision a block behind its evidence
    policy = DraftingPolicy(table, temperatures, draft_len=7, probe_steps=2, decision_lag=2)
    ids = [f"req-{i}" for i in range(r)]
    for rid in ids:  # (the engine's scheduler reports each request joining and leaving)
        policy.running(rid, True)
    logits = torch.randn(r, 7)
    greedy = [{"all": True, "half": i % 2 == 0, "none": False}[greedy_rows] for i in range(r)]
    accepted, verify_len = [2] * r, [7] * r
    policy.observe(ids, logits, greedy, accepted, verify_len)
    running = [_Request(i) for i in ids]
    # a drafting step's decide: the blocks of the step before it were just observed
    times = []
    for _ in range(steps):
        policy.observe(ids, logits, greedy, accepted, verify_len)
        start = time.perf_counter_ns()
        policy.decide([q.request_id for q in running])
        times.append((time.perf_counter_ns() - start) / 1e3)
    decide = statistics.median(times)
    # drafting off: no block observed between decisions, and two requests a step end and two
    # arrive (a closed loop of R requests of ~128 tokens)
    churn = iter(range(10**9))

    def not_drafting_decide() -> None:
        if r >= 2:
            for q in running[:2]:
                policy.running(q.request_id, False)
                policy.forget(q.request_id)
            running[:2] = []
            running.extend(_Request(f"new-{next(churn)}") for _ in range(2))
            for q in running[-2:]:
                policy.running(q.request_id, True)
        policy.decide([q.request_id for q in running])

    decide_off = _median_us(not_drafting_decide, steps)
    for q in running:
        policy.running(q.request_id, False)
    running[:] = [_Request(i) for i in ids]
    for rid in ids:
        policy.running(rid, True)
    # after a drafting step: the survivals, computed once for the metrics and the policy
    # (SpecDecoder.survivals: every speculative engine pays them), then the policy's share
    survivals = _median_us(lambda: host_survivals(logits, greedy, policy.estimates.temperatures),
                           steps)  # fmt: skip
    a = host_survivals(logits, greedy, policy.estimates.temperatures)
    observe = _median_us(lambda: policy.observe_survivals(ids, a, accepted, verify_len), steps)
    # a step trace's line after the decision (DSPARK_POLICY_TRACE, policy/trace.py)
    with tempfile.TemporaryDirectory() as directory:
        trace = PolicyTrace(policy, Path(directory) / "trace.jsonl")
        decoding = SimpleNamespace(num_computed_tokens=300, num_prompt_tokens=100,
                                   is_prefilling=False)  # fmt: skip
        scheduler = SimpleNamespace(running=[decoding] * r, waiting=[], max_num_seqs=max(r, 1))
        stats = {f"counter_{i}": i for i in range(40)}  # (about a runner's stats)
        decision = policy.decide(ids)
        line = _median_us(lambda: trace.decided(decision, ids, scheduler, stats, None, 0.0), steps)
        trace.close()
    return {"batch": r, "decide_us": decide, "decide_not_drafting_us": decide_off,
            "survivals_us": survivals, "observe_us": observe,
            "trace_line_us": line}  # fmt: skip


def host_cost(args: argparse.Namespace) -> int:
    table_path = next(iter(sorted((DRAFTER / COST_TABLES_DIR).glob("*.json"))))
    table = parse_table(table_path.read_text())
    temperatures = {g: torch.tensor(load_calibration(DRAFTER, 7, greedy=g)) for g in (False, True)}
    rows = [_measure(r, table, temperatures, args.steps, args.greedy)
            for r in map(int, args.batch.split(","))]  # fmt: skip
    result = {"date": time.strftime("%Y-%m-%d"), "table": table_path.name,
              "greedy": args.greedy, "rows": rows}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'batch':>5} {'decide us':>10} {'off us':>9} {'survivals us':>13} {'observe us':>11} "
          f"{'trace line us':>14}")  # fmt: skip
    for row in rows:
        print(f"{row['batch']:5d} {row['decide_us']:10.1f} {row['decide_not_drafting_us']:9.1f} "
              f"{row['survivals_us']:13.1f} {row['observe_us']:11.1f} "
              f"{row['trace_line_us']:14.1f}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, doc: str, func):
        p = sub.add_parser(name, help=doc.splitlines()[0], description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        p.set_defaults(func=func)
        return p

    t = command("trace", TRACE_DOC, trace)
    t.add_argument("trace", nargs="+", help="trace files (DIR/policy_trace_<pid>_<n>.jsonl)")
    t.add_argument("--stretches", type=int, default=20, help="stretches listed a segment")
    t.add_argument(
        "--decisions",
        type=int,
        default=0,
        help="a segment's first N decisions listed one by one (a first wave)",
    )
    r = command("replay", REPLAY_DOC, replay)
    r.add_argument("--model", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    r.add_argument("--table", required=True, help="a GPU's cost table (dspark profile)")
    r.add_argument(
        "--arms",
        default='{"scheduled": {}}',
        help="JSON: name -> PolicyTuning fields (and decision_lag) of a policy arm",
    )
    r.add_argument("--concurrency", default="1")
    r.add_argument("--num-prompts", type=int, default=12)
    r.add_argument("--output-len", type=int, default=256)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument(
        "--ahead",
        action="store_true",
        help="drafting steps launch ahead of the one in flight (as on a GPU)",
    )
    r.add_argument("--out", default=None)
    h = command("host-cost", HOST_COST_DOC, host_cost)
    h.add_argument("--batch", default="1,16,64,256")
    h.add_argument("--steps", type=int, default=2000)
    h.add_argument("--out", default="policy_host_cost.json")
    h.add_argument("--greedy", choices=("all", "half", "none"), default="half",
                   help="which rows are greedy (the rest sample)")  # fmt: skip
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
