"""One level of the sweep: its requests timed on every arm, and the level's summary.

For each concurrency C, C requests are submitted at once (the first C prompts of the mixed list,
cycling if C is larger) and run greedily (or at `--temperature T`, request i seeded with i) to
exactly `output_len` tokens (ignore_eos), so every level does a known amount of decoding. The
wall time of the whole generate call gives output tokens/s; each request's metrics give TTFT
(first token - submit) and TPOT (the mean gap between its later tokens).

`--waves W` runs W C requests with at most C in flight (a closed loop); `--min-requests N`
makes that at least N (C = 1 with 4 waves and N 32 runs 32 requests, one at a time). With one
length for all, plain decoding stays in lockstep: each wave ends at one step and the next is
admitted at once, which a server never sees. `--output-len-spread S` gives the requests
seeded lengths in output_len * [1 - S, 1 + S], the same for every arm, so they end at
different steps and admissions meet running requests.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace

import numpy as np

from dspark.benchmarks.gpu_state import held_down, read_gpu_state
from dspark.benchmarks.hf_peer import synchronize
from dspark.benchmarks.offline_config import BenchConfig
from dspark.benchmarks.prompts import output_lengths
from dspark.engine.collector import steady_collector
from dspark.server.gc_pauses import GCPauses


def run_dspark_once(
    llm,
    prompts: list[list[int]],
    output_len: int | list[int],
    max_in_flight: int | None = None,
    temperature: float = 0.0,
) -> dict:
    """All prompts, greedy (or at temperature, prompt i seeded with i) to output_len tokens
    (one length, or one per prompt): wall time and per-request latencies. Without max_in_flight
    (or with it >= the prompts) one generate call submits them at once; else a closed loop
    keeps max_in_flight requests running, submitting the next as one ends."""
    from dspark.sampling_params import SamplingParams

    lengths = [output_len] * len(prompts) if isinstance(output_len, int) else output_len
    params = [
        SamplingParams(
            temperature=temperature, seed=i if temperature else None, max_tokens=n, ignore_eos=True
        )  # fmt: skip
        for i, n in enumerate(lengths)
    ]
    synchronize(llm.engine.device)
    gc_pauses = GCPauses()  # the cyclic collector's pauses inside the timed window
    gc_pauses.install()
    start = time.perf_counter()
    if max_in_flight is None or max_in_flight >= len(prompts):
        submit = [time.monotonic()] * len(prompts)  # the clock RequestOutput.metrics uses
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params,
                               use_tqdm=False)  # fmt: skip
    else:
        outputs, submit = _closed_loop(llm, prompts, params, max_in_flight)
    synchronize(llm.engine.device)
    wall = time.perf_counter() - start
    gc_pauses.uninstall()
    num_tokens = [len(o.outputs[0].token_ids) for o in outputs]
    ttft = [o.metrics["first_token_time"] - t for o, t in zip(outputs, submit, strict=True)]
    tpot = [
        (o.metrics["finished_time"] - o.metrics["first_token_time"]) / (n - 1)
        for o, n in zip(outputs, num_tokens, strict=True)
        if n > 1
    ]
    preemptions = sum(int(o.metrics.get("num_preemptions", 0)) for o in outputs)
    return dict(
        start=start,
        wall=wall,
        tokens=sum(num_tokens),
        ttft=ttft,
        tpot=tpot,
        preemptions=preemptions,
        gc_ms={g: round(1e3 * s, 2) for g, s in sorted(gc_pauses.seconds.items())},
        gc_collections=dict(sorted(gc_pauses.counts.items())),
    )


def _closed_loop(llm, prompts: list[list[int]], params: list, max_in_flight: int):
    """Keep max_in_flight requests in the engine: each that ends is replaced by the next prompt
    in the same step loop. Returns the outputs in prompt order and each one's submit time."""
    engine = llm.engine
    params = [replace(p, output_kind="final_only") for p in params]
    tag = f"bench-{time.monotonic_ns()}"
    outputs: dict[int, object] = {}
    submit: dict[int, float] = {}
    next_prompt = 0
    with steady_collector():  # as LLM.generate runs its loop
        while len(outputs) < len(prompts):
            while next_prompt < len(prompts) and next_prompt - len(outputs) < max_in_flight:
                submit[next_prompt] = time.monotonic()
                request_id = f"{tag}-{next_prompt}"
                engine.add_request(request_id, prompts[next_prompt], params[next_prompt])
                next_prompt += 1
            for out in engine.step():
                if out.finished and out.request_id.startswith(tag):
                    outputs[int(out.request_id.rsplit("-", 1)[1])] = out
        while engine.has_unfinished_requests() and not engine.scheduler.has_unfinished:
            engine.step()  # a step launched ahead for requests that just ended: collect it
    order = range(len(prompts))
    return [outputs[i] for i in order], [submit[i] for i in order]


def percentiles_ms(samples: list[float]) -> dict[str, float | None]:
    if not samples:  # output_len 1 has no TPOT
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(np.asarray(samples) * 1e3, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}


def summarize_level(prompts: list[list[int]], runs: list[dict], concurrency: int) -> dict:
    """Median throughput over repeats; latency percentiles over every request of every repeat."""
    tok_per_s = [r["tokens"] / r["wall"] for r in runs]
    return {
        "concurrency": concurrency,
        "num_requests": len(prompts),
        "mean_prompt_len": statistics.fmean(len(p) for p in prompts),
        "output_tokens": runs[0]["tokens"],
        "wall_s": [r["wall"] for r in runs],
        "output_tokens_per_s_runs": tok_per_s,
        "output_tokens_per_s": statistics.median(tok_per_s),
        "requests_per_s": statistics.median(len(prompts) / r["wall"] for r in runs),
        "ttft_ms": percentiles_ms([t for r in runs for t in r["ttft"]]),
        "tpot_ms": percentiles_ms([t for r in runs for t in r["tpot"]]),
        "num_preemptions": sum(r["preemptions"] for r in runs),
        # per repeat, the cyclic collector's pauses in it, by generation (server/gc_pauses.py)
        "gc_ms_runs": [r["gc_ms"] for r in runs],
        "gc_collections_runs": [r["gc_collections"] for r in runs],
        # per repeat, the GPU's clocks before and after it (None where nvidia-smi cannot say)
        "gpu_state_runs": [r.get("gpu_state") for r in runs],
    }


def _spec_delta(before: dict, after: dict) -> dict:
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    d = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    d["mean_acceptance_length"] = (
        1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None
    )
    windows = after.get("num_survival_windows", 0) - before.get("num_survival_windows", 0)
    if windows:  # calibration at this level: mean predicted vs realised survival per position
        for key in ("predicted_survival_per_pos", "realised_survival_per_pos"):
            b = before.get(key) or [0] * len(after[key])
            d[key.replace("_per_pos", "_mean")] = [
                (x - y) / windows for x, y in zip(after[key], b, strict=True)
            ]
        d["num_survival_windows"] = windows
    d["scheduling"] = after.get("scheduling")  # policy or fixed K, and why
    if "synthetic" in after:  # drafts kept by a profile, not the target (spec/synthetic.py)
        d["synthetic"] = after["synthetic"]
    # the policy's state at the end of the level: its survival corrections and each cell's
    # realised / table step-time ratio ("G=64 V=512 greedy": 1.4)
    for key in ("survival_correction", "survival_persistence", "realised_cost_ratios"):
        if key in after:
            d[key] = after[key]
    for key in ("steps", "fallbacks"):  # this level's steps by path, eager ones by reason
        b, a = before.get(key, {}), after.get(key, {})
        d[key] = {k: a[k] - b.get(k, 0) for k in a if a[k] - b.get(k, 0)}
    if "async_spec_steps" in after:  # drafting steps launched ahead, and why others were not
        b, a = before.get("async_spec_steps", {}), after["async_spec_steps"]
        not_before = b.get("not_ahead", {})
        not_ahead = {k: n - not_before.get(k, 0) for k, n in a["not_ahead"].items()}
        d["async_spec_steps"] = {
            "launched_ahead": a["launched_ahead"] - b.get("launched_ahead", 0),
            "not_ahead": {k: n for k, n in not_ahead.items() if n},
        }
        # (mixed steps ahead, drafting steps behind a plain one, where counted)
        for key in ("admitting", "behind_mixed", "after_plain"):
            if n := a.get(key, 0) - b.get(key, 0):
                d["async_spec_steps"][key] = n
    if "drafting_policy" in after:  # steps with and without drafting at this level
        b, a = before.get("drafting_policy", {}), after["drafting_policy"]
        d["drafting_policy"] = {k: a[k] - b.get(k, 0) for k in a if a[k] - b.get(k, 0)}
    return d


def scheduling_overhead(before: dict, after: dict, wall_s: float) -> dict | None:
    """The drafting policy's host time at this level (None without a policy): microseconds
    per step in decide (with record_step), observe and the trace line, their total, and its
    share of the level's wall time (a decision precedes every step, so that is its share of
    the step). decide 30 us + observe 20 us over 2,000 steps in 50 s -> total 50 us, 0.2 %.
    """
    if "scheduling_host_time" not in after:
        return None
    b, a = before.get("scheduling_host_time", {}), after["scheduling_host_time"]
    steps = a.get("decisions", 0) - b.get("decisions", 0)
    if steps <= 0:
        return None
    spent = {k: a.get(f"{k}_s", 0.0) - b.get(f"{k}_s", 0.0) for k in ("decide", "observe", "trace")}
    total = sum(spent.values())
    return {
        "steps": steps,
        **{f"{k}_us_per_step": 1e6 * t / steps for k, t in spent.items()},
        "total_us_per_step": 1e6 * total / steps,
        "share_of_wall": total / wall_s if wall_s > 0 else None,
    }


def run_level(
    llms: dict, prompts: list[list[int]], config: BenchConfig, sweep_start: float,
    concurrency: int | None = None,  # requests in flight at most (None: all the prompts)
) -> dict[str, dict]:  # fmt: skip
    """One level on every arm: each repeat runs every arm once, in arm order, so drift on a shared
    host hits all arms alike. With --arms each level records when its runs began ("start_s",
    seconds since the first level began): the interleaving, and any drift, in the data."""
    before = {name: llm.get_metrics() for name, llm in llms.items()}
    runs = {name: [] for name in llms}
    lengths = output_lengths(len(prompts), config.output_len, config.output_len_spread,
                             config.seed)  # fmt: skip
    for _ in range(config.repeats):
        for name, llm in llms.items():
            device = llm.engine.device
            before_run = read_gpu_state(device)  # clocks and heat, outside the timed window
            if (trace := llm.engine.policy_trace) is not None:  # (policy/trace.py)
                trace.mark(arm=name, concurrency=concurrency or len(prompts),
                           repeat=len(runs[name]))  # fmt: skip
            run = run_dspark_once(llm, prompts, lengths, concurrency, config.temperature)
            run["gpu_state"] = {"before": before_run, "after": read_gpu_state(device)}
            held = held_down(before_run, run["gpu_state"]["after"])
            if held:  # a repeat that ran on held-down clocks reads slow: say so beside it
                print(
                    f"{name} C={concurrency or len(prompts)} repeat {len(runs[name])}: the "
                    f"GPU's clocks were held down ({', '.join(held)})",
                    file=sys.stderr,
                )
            runs[name].append(run)
    levels = {}
    c = concurrency or len(prompts)
    for name, llm in llms.items():
        level = summarize_level(prompts, runs[name], c)
        if config.arms is not None:
            level["start_s"] = [r["start"] - sweep_start for r in runs[name]]
        if before[name]:  # speculation: this level's drafts and acceptance
            after = llm.get_metrics()
            level["speculation"] = _spec_delta(before[name], after)
            overhead = scheduling_overhead(before[name], after, sum(level["wall_s"]))
            if overhead is not None:
                level["scheduling_overhead"] = overhead
        tok_s = level["output_tokens_per_s"]
        print(f"{name} C={c}: {tok_s:.1f} output tok/s", file=sys.stderr, flush=True)
        levels[name] = level
    return levels
