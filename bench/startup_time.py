"""How long `LLM(model)` takes to start, in fresh processes: the import, then the engine's start.

    python bench/startup_time.py [--model default] [--repeats 3] [--device cpu] [--out X.json]
    python bench/startup_time.py --device cuda --dtype bfloat16 --max-num-seqs 256 \
        --speculative-config '{"method": "dspark"}'      # the speculative engine, graphs captured

Each repeat is a new Python process (imports and first-use costs included, as a user's
`dspark generate` pays them); the file cache is warm after the first. Prints each repeat and
the medians; --out writes them with the commit. Run it from another checkout's root (with
PYTHONPATH=.) to compare two commits side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time
t = time.perf_counter()
from dspark import LLM
imported = time.perf_counter() - t
t = time.perf_counter()
LLM(**json.loads(sys.argv[1]))
print(json.dumps({"import_s": imported, "init_s": time.perf_counter() - t}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--speculative-config", default=None, help="JSON, as `dspark generate`")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    engine = {"model": args.model, "dtype": args.dtype, "device": args.device}
    if args.max_num_seqs:
        engine["max_num_seqs"] = args.max_num_seqs
    if args.speculative_config:
        engine["speculative_config"] = json.loads(args.speculative_config)
    runs = []
    for i in range(args.repeats):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(engine)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"repeat {i}: import {runs[-1]['import_s']:.2f} s, start {runs[-1]['init_s']:.2f} s")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    result = {
        "commit": commit,
        "model": args.model,
        "engine": engine,
        "runs": runs,
        "median_import_s": statistics.median(r["import_s"] for r in runs),
        "median_init_s": statistics.median(r["init_s"] for r in runs),
    }
    print(f"{commit}: median import {result['median_import_s']:.2f} s, "
          f"start {result['median_init_s']:.2f} s")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
