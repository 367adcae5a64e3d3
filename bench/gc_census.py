"""What the cyclic collector finds after a closed loop: the run with the collector off, then one
full collection with DEBUG_SAVEALL, so its garbage (objects only the collector frees: reference
cycles) can be counted by type, with the live objects the run added.

    python bench/gc_census.py --model /tmp/rs [--drafter /tmp/rd] --requests 768

The twenty-fourth look of docs/PERFORMANCE.md ran it on an H100 (random weights, 256 in flight):
plain decoding left no cyclic garbage; the speculative engine did not start there (its graph
capture ran out of memory, the reason for the memory plan's graph pool reserve).
"""

import argparse
import gc
import time
from collections import Counter

from dspark import LLM, SamplingParams
from dspark.benchmarks.offline_level import _closed_loop


def census() -> Counter:
    return Counter(type(o).__name__ for o in gc.get_objects())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", help="a DSpark drafter: fixed K = 7 (scheduling off)")
    ap.add_argument("--requests", type=int, default=768)
    ap.add_argument("--concurrency", type=int, default=256)
    args = ap.parse_args()
    spec = args.drafter and {"method": "dspark", "scheduling": False, "model": args.drafter}
    llm = LLM(args.model, max_num_seqs=args.concurrency, speculative_config=spec or None)
    prompts = [[1, 2, 3, 4 + i % 500] * 8 for i in range(args.requests)]
    params = [SamplingParams(max_tokens=96 + (i * 37) % 96, ignore_eos=True, temperature=0)
              for i in range(args.requests)]  # fmt: skip
    c = args.concurrency
    _closed_loop(llm, prompts[:c], params[:c], c)  # warm-up
    gc.collect()
    before = census()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    start = time.perf_counter()
    outputs, _ = _closed_loop(llm, prompts, params, c)
    wall = time.perf_counter() - start
    grown = census() - before
    del outputs
    start = time.perf_counter()
    unreachable = gc.collect()
    collect_ms = 1e3 * (time.perf_counter() - start)
    print(f"wall {wall:.2f} s; unreachable {unreachable}; one full collection {collect_ms:.0f} ms"
          f" over {len(gc.get_objects())} tracked objects")  # fmt: skip
    print("garbage by type:", Counter(type(o).__name__ for o in gc.garbage).most_common(25))
    print("live objects the run added (its outputs among them):", grown.most_common(15))
    gc.garbage.clear()
    gc.set_debug(0)
    gc.enable()


if __name__ == "__main__":
    main()
