"""The step loop's collector settings A/B in one engine: closed loops alternated with
`DSPARK_STEADY_GC` off (the collector as before dspark/engine/collector.py) and on, each run's
throughput and the collector's pauses by generation.

    python bench/gc_steady_ab.py --model /tmp/rs [--drafter /tmp/rd] --concurrency 256 --rounds 3
    PYTHONPATH=. python bench/gc_steady_ab.py --model tiny --drafter tiny --output-len 48  # CPU

`--model tiny` builds the suite's tiny-vocabulary model (one layer) in a temporary directory,
and `--drafter tiny` a random K = 7 drafter for it (tests/tiny_models.py): the CPU's version.

One engine serves both modes (the variable is read as each loop starts), so start-up and
capture cost once and the runs alternate on one warm GPU. With --drafter the engine runs fixed
K = 7 (scheduling off), where the twenty-fourth look of docs/PERFORMANCE.md saw a 200-280 ms
full collection in two of every three runs at 256 in flight. Prompts are synthetic token ids
(as bench/gc_census.py): the loop's host work and allocations do not depend on their text.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from dspark import LLM, SamplingParams
from dspark.benchmarks.hf_peer import synchronize
from dspark.benchmarks.offline_level import _closed_loop
from dspark.server.gc_pauses import GCPauses


def timed_loop(llm, prompts, params, concurrency: int) -> dict:
    pauses = GCPauses()
    pauses.install()
    synchronize(llm.engine.device)
    start = time.perf_counter()
    outputs, _ = _closed_loop(llm, prompts, params, concurrency)
    synchronize(llm.engine.device)
    wall = time.perf_counter() - start
    pauses.uninstall()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "tok_s": tokens / wall,
        "counts": dict(sorted(pauses.counts.items())),
        "ms": {g: round(1e3 * s, 1) for g, s in sorted(pauses.seconds.items())},
    }


def _tiny(root: Path, with_drafter: bool) -> str:
    from tests.tiny_models import make_tiny_drafter, make_tiny_vocab_model

    make_tiny_vocab_model(root / "model")
    if with_drafter:
        make_tiny_drafter(root / "model", root / "drafter", taps=(0,), draft_len=7)
    return str(root / "model")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", help="a DSpark drafter: fixed K = 7 (scheduling off)")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--requests", type=int, help="per run (default 4 x concurrency)")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    spec = args.drafter and {"method": "dspark", "scheduling": False, "model": args.drafter}
    c = args.concurrency
    n = args.requests or 4 * c
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            args.model = _tiny(Path(tmp), args.drafter == "tiny")
            if spec:
                spec["model"] = str(Path(tmp) / "drafter")
        llm = LLM(args.model, max_num_seqs=c, max_model_len=2 * args.output_len + 64,
                  speculative_config=spec or None)  # fmt: skip
    vocab = min(llm.engine.model_config.vocab_size, 504)
    prompts = [[1, 2, 3, 4 + i % (vocab - 4)] * 8 for i in range(n)]
    # lengths in [0.5, 1.5] x output_len, so requests end at different steps
    half = args.output_len // 2
    params = [SamplingParams(max_tokens=half + (i * 37) % (2 * half), ignore_eos=True,
                             temperature=0) for i in range(n)]  # fmt: skip
    _closed_loop(llm, prompts[:c], params[:c], c)  # warm-up
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for mode, value in (("off", "0"), ("on", "1")):
            os.environ["DSPARK_STEADY_GC"] = value
            run = timed_loop(llm, prompts, params, c)
            runs[mode].append(run)
            print(f"{mode:>3} {run['tok_s']:>9.0f} tok/s  collections {run['counts']}  "
                  f"ms {run['ms']}", flush=True)  # fmt: skip
    print(f"\nC = {c}, {'K = 7' if spec else 'plain'}, {n} requests a run, {args.rounds} rounds")
    for mode, rs in runs.items():
        med = statistics.median(r["tok_s"] for r in rs)
        gc_ms = [sum(r["ms"].values()) for r in rs]
        full = [r["ms"].get(2, 0.0) for r in rs]
        print(f"{mode:>3}: median {med:>9.0f} tok/s; collector ms a run {gc_ms}, full {full}")
    on, off = (statistics.median(r["tok_s"] for r in runs[m]) for m in ("on", "off"))
    print(f"on / off: {on / off:.3f}")


if __name__ == "__main__":
    main()
