"""The engine's host work per step, on the CPU: what the step loop costs beside the device.

    PYTHONPATH=. python bench/host_loop.py --concurrency 4,64 --out host_loop.json

(from the repository root: PYTHONPATH=. lets it import tests/tiny_models.py and
tests/spec/eager_replay.py)

On a GPU a step of a small target is host-bound at low and middle load: the policy's traces of
the default model on an H100 show drafting steps at G = 4 spending ~2 ms of host work a step
against ~1.3 ms of GPU time in the cost table. The host's part of a step does not depend on the
device, so it can be measured here: a tiny target and a tiny K = 7 drafter on the CPU, windows
laid out as the CUDA graphs lay them out, async scheduling, and the graph replays emulated by
tests/spec/eager_replay.py. Acceptance is SYNTHETIC (the shipped drafter's "smollm2" profile,
spec/synthetic.py), so windows emit what they would with a trained drafter; the text is not a
model's. Per arm and concurrency C (4 waves of C requests of --output-len tokens):

  host_us    a step's wall time less the time inside the device's work (the emulated graph
             replays and the eager model forwards): what the host spends a step, median and mean
  parts      time inside the named host functions, per step (each includes what it calls);
             the policy's decide and observe as it times them itself (scheduling_overhead)

Arms: plain decoding, fixed K = 7 ("scheduling": false) and the drafting policy pricing by a
table under which the full block always wins (always_drafting_table): it drafts every step as
K = 7 does, so what it adds to K = 7's host work is the scheduling overhead. The figures are
the development machine's CPU; a GPU host's differ in scale, not in which part costs most.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from dspark import LLM, SamplingParams
from dspark.config import EngineConfig
from dspark.engine.engine import LLMEngine
from dspark.engine.spec_setup import probe_steps
from dspark.policy.cost_table import CostTable, full_block_tokens
from dspark.spec.synthetic import SyntheticAcceptance
from tests.spec.eager_replay import EagerReplay
from tests.tiny_models import make_tiny_drafter, make_tiny_vocab_model

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# (object path from the engine, method) -> label: the host functions timed per step
PARTS = {
    ("scheduler", "schedule"): "schedule",
    ("scheduler", "advance"): "advance",
    ("scheduler", "update"): "scheduler.update",
    ("runner", "collect"): "collect (sync + results)",
    ("runner.spec_runner", "queue_results"): "queue_results",
    ("runner.spec_runner", "assign"): "assign",
    ("runner.spec_runner.spec", "record"): "record",
    ("runner.stager", "stage"): "stage",
    ("", "_update"): "engine._update",
}


class _Clock:
    """Wall time inside wrapped methods; nested device work counts once."""

    def __init__(self) -> None:
        self.device_s, self.depth = 0.0, 0
        self.parts: Counter[str] = Counter()

    def device(self, fn):
        def timed(*args, **kwargs):
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.device_s += time.perf_counter() - start

        return timed

    def part(self, label: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.parts[label] += time.perf_counter() - start

        return timed


def _engine(
    target: Path,
    drafter: Path | None,
    concurrency: int,
    table: Path | None = None,
    replay: bool = True,  # False: as built (the fingerprint a table must carry)
) -> LLMEngine:
    spec = None
    if drafter is not None:  # fixed K, or the policy pricing by `table`
        spec = {"model": str(drafter)}
        spec.update({"cost_table": str(table)} if table else {"scheduling": False})
    engine = LLMEngine(
        EngineConfig(model=str(target), dtype="float32", device="cpu", max_num_seqs=concurrency,
                     num_kv_pages=8192, async_scheduling=True, speculative_config=spec),
        synthetic=None if drafter is None else SyntheticAcceptance.parse("smollm2"),
    )  # fmt: skip
    if replay and engine.runner.spec_runner is not None:
        spec_runner = engine.runner.spec_runner
        spec_runner.uniform_windows = True  # (windows K + 1 wide, as the graph steps lay them)
        sizes = [g for g in GRAPH_SIZES if g <= max(concurrency, 1) * 2]
        spec_runner.graphs = EagerReplay(spec_runner, sizes)
        if engine.policy is not None:  # (what the engine derives with graph layouts)
            lag = probe_steps(engine.config, spec_runner)
            engine.policy.probe_steps = engine.policy.estimates.decision_lag = lag
    return engine


def always_drafting_table(target: Path, drafter: Path, folder: Path) -> Path:
    """A cost table with this engine's fingerprint whose full block costs half a plain step
    at every G: the policy drafts every step, as fixed K = 7 does, so the two arms' host work
    differs by the policy's own."""
    probe = _engine(target, drafter, 1, replay=False)
    fingerprint, k = probe.cost_fingerprint(), probe.spec.draft_len
    cells = {g: {g: 1e-3, full_block_tokens(g, k): 0.5e-3} for g in GRAPH_SIZES}
    path = folder / "always.json"
    path.write_text(CostTable(fingerprint, cells, cells).to_json())
    return path


def _resolve(engine: LLMEngine, path: str):
    obj = engine
    for name in filter(None, path.split(".")):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def measure(target: Path, drafter: Path | None, concurrency: int, num_requests: int,
            output_len: int, table: Path | None = None) -> dict:  # fmt: skip
    engine = _engine(target, drafter, concurrency, table)
    clock = _Clock()
    runner = engine.runner
    runner._run_model = clock.device(runner._run_model)
    runner._forward = clock.device(runner._forward)  # (plain steps)
    if runner.spec_runner is not None:
        spec_runner = runner.spec_runner
        spec_runner.run_model = clock.device(spec_runner.run_model)
        graphs = spec_runner.graphs
        graphs.replay = clock.device(graphs.replay)
        graphs.replay_scored = clock.device(graphs.replay_scored)
    for (path, method), label in PARTS.items():
        obj = _resolve(engine, path)
        if obj is not None:  # (None: a speculative part of the plain arm)
            setattr(obj, method, clock.part(label, getattr(obj, method)))
    llm = LLM.from_engine(engine)
    prompts = [[2 + (i * 7 + j) % 9 for j in range(12 + i % 9)] for i in range(num_requests)]
    params = SamplingParams(
        temperature=0, max_tokens=output_len, ignore_eos=True, output_kind="final_only"
    )  # (as LLM.generate runs them)
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:concurrency]], params, use_tqdm=False
    )  # fmt: skip (warm-up)
    clock.parts.clear()
    if engine.policy is not None:  # (its own account of its host work: the bench's overhead)
        engine.policy.host_time.clear()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    hosts, start = [], time.perf_counter()
    while engine.has_unfinished_requests():
        clock.device_s = 0.0
        t = time.perf_counter()
        engine.step()
        hosts.append(time.perf_counter() - t - clock.device_s)
    wall = time.perf_counter() - start
    steps = len(hosts)
    if engine.policy is not None:
        for key in ("decide_s", "observe_s"):
            clock.parts[f"policy {key[:-2]}"] = engine.policy.host_time[key]
    metrics = engine.get_metrics()
    return {
        "concurrency": concurrency,
        "steps": steps,
        "wall_s": round(wall, 3),
        "host_us": {
            "median": round(statistics.median(hosts) * 1e6, 1),
            "mean": round(statistics.mean(hosts) * 1e6, 1),
        },  # fmt: skip
        "parts_us_per_step": {k: round(v * 1e6 / steps, 1) for k, v in clock.parts.most_common()},
        "acceptance_length": metrics.get("mean_acceptance_length"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--concurrency", default="4,64")
    p.add_argument("--num-requests", type=int, default=0, help="default: 4 waves of C")
    p.add_argument("--output-len", type=int, default=128, help="tokens a request")
    p.add_argument("--arms", default="plain,k7,policy",
                   help="comma-separated: plain, k7, policy")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="the median repeat is reported")
    p.add_argument("--out", default="host_loop.json")
    args = p.parse_args(argv)
    # one thread: the CPU's intra-op workers spin after each op and would steal the host's time
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    directory = Path(tempfile.mkdtemp())
    target = make_tiny_vocab_model(directory / "target")
    drafter = make_tiny_drafter(target, directory / "drafter", taps=(0,), draft_len=7)
    table = always_drafting_table(target, drafter, directory)
    levels = []
    for c in (int(x) for x in args.concurrency.split(",")):
        for arm in args.arms.split(","):
            runs = [measure(target, None if arm == "plain" else drafter, c,
                            args.num_requests or 4 * c, args.output_len,
                            table if arm == "policy" else None)
                    for _ in range(args.repeats)]  # fmt: skip
            run = sorted(runs, key=lambda r: r["host_us"]["median"])[len(runs) // 2]
            run["arm"] = arm
            run["host_us_median_runs"] = [r["host_us"]["median"] for r in runs]
            levels.append(run)
            print(f"C={c:4d} {arm:6s} host {run['host_us']['median']:8.1f} us/step median "
                  f"(runs {run['host_us_median_runs']}), {run['steps']} steps, "
                  f"acceptance length {run['acceptance_length']}", flush=True)  # fmt: skip
            for label, us in run["parts_us_per_step"].items():
                print(f"      {label:26s} {us:8.1f} us/step")
    result = {
        "command": "bench/host_loop.py",
        "arguments": vars(args),
        "date": time.strftime("%Y-%m-%d"),
        "device": "cpu (host work only: device work emulated and subtracted)",
        "synthetic": "acceptance by the smollm2 profile (spec/synthetic.py): not a model's text",
        "git_commit": _git_commit(),
        "levels": levels,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
