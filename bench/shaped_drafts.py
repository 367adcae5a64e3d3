"""What drafting unshaped costs in acceptance: penalised requests on the graph steps against the
eager ones.

    PYTHONPATH=. python bench/shaped_drafts.py --num-prompts 8 --max-tokens 64

(from the repository root: PYTHONPATH=. lets it import tests/spec/eager_replay.py)

A speculative step replayed from a CUDA graph drafts its windows from the drafter's unshaped
distribution, since no graph holds a request's penalties, logit_bias, bad words or min_p; the
target verifies the window again, eagerly, with the shaping. An eager step shapes the drafter's
distribution too. Both are lossless (acceptance compares with the distribution the drafts came
from), but unshaped drafts that the shaped target disfavours are rejected more often: the drop
in acceptance is the price of keeping shaped requests on the graphs.

The default model and its shipped drafter (float32, CPU, fixed K: every window drafts the full
block) serve the held-out benchmark prompts, chat-rendered, at each temperature, without shaping
and with penalties (SHAPINGS), with the drafts
  - "shaped": eager steps (runner/spec_runner.py, windows laid out uniformly as a graph's are),
  - "unshaped": the graph steps, emulated on the CPU by tests/spec/eager_replay.py.
Per arm: drafts (windows), accepted drafts a window, the speculative steps by path and those
that shaped (spec_graph_steps_logits_shaping: graph steps verified again with the shaping), and
the wall time. Greedy outputs of the two modes must be equal token for token (speculation is
lossless); the script fails if they are not. Sampled requests are seeded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from dspark import LLM, SamplingParams
from dspark.benchmarks.prompts import default_prompts_dir, load_prompts
from tests.spec.eager_replay import EagerReplay

SHAPINGS = {
    "none": {},
    "penalties": {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.3},
}
MODES = ("shaped", "unshaped")
GRAPH_SIZES = [1, 2, 4, 8, 16, 32]
# the runner's counters an arm records (their increments)
COUNTERS = ("eager_spec_steps", "spec_graph_steps", "spec_steps_logits_shaping",
            "spec_graph_steps_logits_shaping")  # fmt: skip


def _build(mode: str) -> LLM:
    llm = LLM(dtype="float32", device="cpu",
              speculative_config={"method": "dspark", "scheduling": False})  # fmt: skip
    spec_runner = llm.engine.runner.spec_runner
    spec_runner.uniform_windows = True  # (windows K + 1 wide, as the graph steps lay them out)
    if mode == "unshaped":
        spec_runner.graphs = EagerReplay(spec_runner, GRAPH_SIZES)
    return llm


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[dict, list]:
    """One arm: the increments of the acceptance metrics and the runner's counters."""
    stats = llm.engine.runner.stats
    before, counters = llm.get_metrics(), {k: stats[k] for k in COUNTERS}
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.get_metrics()
    drafts, accepted = (after[k] - before.get(k, 0) for k in ("num_drafts", "num_accepted_tokens"))
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    per_window = accepted / drafts if drafts else 0
    row = {"num_drafts": drafts, "num_accepted_tokens": accepted,
           "accepted_per_window": round(per_window, 3),
           "mean_acceptance_length": round(1 + per_window, 3),  # (vLLM's: emitted a window)
           "num_output_tokens": sum(map(len, tokens)),
           **{k: stats[k] - counters[k] for k in COUNTERS},
           "wall_s": round(seconds, 2)}  # fmt: skip
    return row, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", default="0,1", help="comma-separated")
    parser.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    parser.add_argument("--out", default="bench/results/shaped_drafts_cpu/shaped_drafts.json")
    args = parser.parse_args()
    llms = {mode: _build(mode) for mode in MODES}
    tokenizer = llms["shaped"].get_tokenizer()
    conversations = load_prompts(default_prompts_dir())  # (the held-out split)
    prompts = [tokenizer.apply_chat_template(c) for c in conversations[: args.num_prompts]]
    for llm in llms.values():  # (warm: the first step's one-off costs out of the timings)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    rows = []
    for temperature in map(float, args.temperature.split(",")):
        for shaping, penalties in SHAPINGS.items():
            params = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                     seed=args.seed + i, **penalties)
                      for i in range(len(prompts))]  # fmt: skip
            tokens = {}
            for mode, llm in llms.items():
                row, tokens[mode] = _run(llm, prompts, params)
                same = tokens[mode] == tokens["shaped"]
                rows.append({"temperature": temperature, "shaping": shaping, "drafting": mode,
                             **row, "same_tokens_as_shaped": same})  # fmt: skip
            # (speculation is lossless: greedy decoding emits the same tokens either way)
            if temperature == 0 and tokens["unshaped"] != tokens["shaped"]:
                raise AssertionError(f"greedy outputs differ between the modes ({shaping})")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    result = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "commit": commit or None, "device": "cpu", "dtype": "float32",
              "model": "default", "drafter": "shipped",
              "num_speculative_tokens": llms["shaped"].engine.spec.num_verify,
              "num_prompts": len(prompts), "penalties": SHAPINGS["penalties"],
              "graph_sizes": GRAPH_SIZES,
              "args": {k: v for k, v in vars(args).items() if k != "out"},
              "rows": rows}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    # steps: eager and graph speculative steps, those with shaping, graph ones among them
    print(f"{'temp':>4} {'shaping':>9} {'drafting':>8} {'windows':>7} {'acc/win':>7} "
          f"{'eager':>5} {'graph':>5} {'shaped':>6} {'g_shaped':>8} {'same':>4} "
          f"{'wall_s':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['temperature']:4.1f} {r['shaping']:>9} {r['drafting']:>8} "
              f"{r['num_drafts']:7d} {r['accepted_per_window']:7.3f} {r['eager_spec_steps']:5d} "
              f"{r['spec_graph_steps']:5d} {r['spec_steps_logits_shaping']:6d} "
              f"{r['spec_graph_steps_logits_shaping']:8d} {str(r['same_tokens_as_shaped']):>4} "
              f"{r['wall_s']:6.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
