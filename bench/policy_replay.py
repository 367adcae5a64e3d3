"""The drafting policy's choices at concurrency C, priced by a GPU's cost table, on the CPU.

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

    PYTHONPATH=. python bench/policy_replay.py --table dspark/drafters/smollm2_135m_instruct/\\
        cost_tables/h200_torch2.11_cu130.json --concurrency 1,4 --num-prompts 12 \\
        --output-len 256 --ahead --out r.json
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
from collections import Counter
from dataclasses import replace
from pathlib import Path
from unittest import mock

from dspark import LLM, SamplingParams
from dspark.benchmarks.prompts import default_prompts_dir, load_prompts
from dspark.engine.spec_setup import probe_steps
from dspark.models.loader import default_model_path
from dspark.policy.cost_table import CostTable, full_block_tokens, parse_table
from dspark.policy.policy import DraftingPolicy
from dspark.policy.tuning import TUNING

MAX_MODEL_LEN = 1024  # the benchmark's prompts and 256 tokens fit


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


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--table", required=True, help="a GPU's cost table (dspark profile)")
    ap.add_argument(
        "--arms",
        default='{"scheduled": {}}',
        help="JSON: name -> PolicyTuning fields (and decision_lag) of a policy arm",
    )
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument(
        "--ahead",
        action="store_true",
        help="drafting steps launch ahead of the one in flight (as on a GPU)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()  # fmt: skip
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


if __name__ == "__main__":
    sys.exit(main())
