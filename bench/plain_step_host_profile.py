"""Where the host time of a steady plain decode step goes, with and without a drafter (GPU).

    PYTHONPATH=. python bench/plain_step_host_profile.py --model M --drafter D --batch 256

For the plain engine, then the speculative engine with drafting off (what the drafting policy
runs at high load): `batch` requests (greedy, or at `--temperature`, seeded) decode to a steady
state, then `--steps` steps run once untimed by the profiler (the median period printed) and
once under cProfile (the top functions by own time written to --out). The two periods differ
by host work alone when their graphs cost the same (bench/spec_step_profile.py measures the
graphs). With several temperatures (`--temperature 1,0,1,0`) each engine measures them in
turn, its requests aborted between them; the thirtieth look's single-temperature runs put the
machine's slow first seconds on whichever ran first.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics

import torch

from bench.spec_step_trace import _period_us, _steady
from dspark import LLM
from dspark.spec.profile import drain


def _profiled(llm: LLM, steps: int, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        llm.engine.step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--temperature", default="0",
                        help="the requests' temperature (0: greedy), or several comma-separated: "
                        "each engine measures them in that order, e.g. 1,0,1,0 alternates so "
                        "that a slow stretch of the host does not fall on one")  # fmt: skip
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", default="plain_step_host_profile.txt")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: keep)")
    parser.add_argument("--gc", default="on", choices=("on", "freeze", "off"),
                        help="the collector while stepping: as is, the start-up heap frozen, "
                        "or disabled")  # fmt: skip
    parser.add_argument("--no-profile", action="store_true", help="the step periods alone")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = max(2048, 8 * args.batch)
    common = dict(dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device,
                  max_num_seqs=args.batch, max_model_len=args.max_model_len,
                  kv_cache_memory_gb=8.0, max_num_batched_tokens=tokens)  # fmt: skip
    temperatures = [float(t) for t in args.temperature.split(",")]
    report, periods = [], {}
    for name, spec in (("plain", None), ("drafting off", {"method": "dspark",
                                                          "model": args.drafter})):  # fmt: skip
        llm = LLM(args.model, speculative_config=spec, **common)
        if spec is not None:
            llm.engine.scheduler.drafting = False  # (no cost table: nothing turns it back on)
        if args.gc != "on":
            gc.collect()
            gc.freeze()
        if args.gc == "off":
            gc.disable()
        for k, t in enumerate(temperatures):
            if k:  # (the previous temperature's requests leave first)
                drain(llm)
            _steady(llm, args.batch, args.prompt_len, t, prefix=f"k{k}-")
            key = f"{name}, T={t:g}"
            periods.setdefault(key, []).append(_period_us(llm, args.steps))
            report.append(f"==== {key}: step period {periods[key][-1]:.0f} us (median of "
                          f"{args.steps})")  # fmt: skip
            if not args.no_profile and temperatures.index(t) == k:  # each temperature once
                report.append(_profiled(llm, args.steps, args.top))
        gc.enable()
        gc.unfreeze()
        report.append(f"runner stats: {dict(llm.engine.runner.stats)}")
        del llm
        if args.device == "cuda":
            torch.cuda.empty_cache()
    summary = "  ".join(f"{k} {statistics.median(v):.0f} us ({' / '.join(f'{x:.0f}' for x in v)})"
                        for k, v in periods.items())  # fmt: skip
    settings = f"temperatures {args.temperature}, threads {torch.get_num_threads()}, gc {args.gc}"
    report.insert(0, f"batch {args.batch} ({settings}): {summary}")
    with open(args.out, "w") as f:
        f.write("\n".join(report))
    print(report[0])


if __name__ == "__main__":
    main()
