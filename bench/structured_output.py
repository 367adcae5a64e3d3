"""Host cost of structured output: the grammar's bitmasks per row and window position, and the
host synchronisations a speculative step adds (docs/SPECULATION.md 4.9).

    python bench/structured_output.py --rows 1,8,32 --k 7 --out structured_output_cost.json

Masks: with the default model's tokenizer (49,152 tokens), each constraint below is walked
along a valid output; at every prefix, M rows (matchers at different prefixes) get
  - their next-token mask (a plain row: BitmaskFiller.anchor_bitmasks), and
  - their K + 1 window masks after K drafts, the output's next K tokens (a window whose
    drafts the grammar takes: every mask computed; BitmaskFiller.window_bitmasks),
and the device half, the masks applied to M (K + 1) rows of float32 logits on the CPU
(sample/token_bitmask.py), and a matcher advanced by one emitted token. Figures are the
median and the least over the prefixes, in microseconds per row and position (on a shared
host the least is the closer to the work's own cost: other processes only add).

Syncs: the default model and its shipped drafter (float32, CPU; or --model, --drafter, --device)
serve the same prompts greedily without and with a JSON schema (and, beside them, with
penalties: PENALTIES), once to warm and once timed: the
speculative steps, those whose windows carry a grammar, how many of those had their drafts come
with the wait for the step before and how many waited for them on their own (the extra host
synchronisations, runner/grammar_masks.py), and the wall time a step. Drafting is fixed K
(no policy). On a GPU the same again with CUDA graphs off (`syncs_without_cuda_graphs`): what
a step costs eagerly, against the captured step a grammar step replays before it verifies
again with its masks (runner/spec_graphs.py).

On a GPU host without the model (random weights: the sync counts and step times do not depend
on them; the acceptance does):

    python bench/random_models.py smollm2 --out rs --tokenizer TOK && \
    python bench/random_models.py drafter --target rs --out rd && \
    python bench/structured_output.py --tokenizer TOK --model rs --drafter rd \
        --device cuda --out structured_output_cost.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from dspark import LLM, SamplingParams, StructuredOutputsParams
from dspark.models.loader import resolve_model
from dspark.models.tokenizer import Tokenizer, load_tokenizer
from dspark.sample.token_bitmask import apply_token_bitmask
from dspark.structured.compiler import GrammarCompiler
from dspark.structured.masks import BitmaskFiller

S = StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "city": {"type": "string"}, "tags": {"type": "array",
                                                        "items": {"type": "string"}}},
    "required": ["name", "age", "city"],
}  # fmt: skip
# the third arm of the sync run: a step with such rows verifies again, eagerly, with the shaping
# (runner/spec_graphs.py), as one with grammar rows does with the masks
PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.5}
# (constraint, a valid output to walk)
CASES = {
    "json_schema": (
        StructuredOutputsParams(json=PERSON),
        '{\n  "name": "Alice Martin",\n  "age": 30,\n  "city": "Paris",\n  "tags": ["engineer",'
        ' "cyclist", "reader"]\n}',
    ),
    "json_object": (
        StructuredOutputsParams(json_object=True),
        '{"colours": ["red", "green", "blue"], "count": 3, "nested": {"ok": true}}',
    ),
    "regex": (
        StructuredOutputsParams(regex=r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]( [a-z ]+)?"),
        "1989-11-09 the wall fell in berlin",
    ),
    "choice": (
        StructuredOutputsParams(choice=["positive", "negative", "neutral", "mixed feelings"]),
        "mixed feelings",
    ),
}


def _mask_costs(compiler: GrammarCompiler, spec, text: str, rows: int, k: int) -> dict:
    tokens = compiler.tokenizer.encode(text, add_special_tokens=False)
    n = len(tokens)
    filler = BitmaskFiller(compiler.vocab_size)
    anchor, window, apply, advance = [], [], [], []
    for p in range(n):
        prefixes = [(p + 3 * i) % n for i in range(rows)]  # (rows at different prefixes)
        matchers = []
        for q in prefixes:
            m = compiler.matcher(spec)
            assert m.advance(tokens[:q]) == q
            matchers.append(m)
        drafts = [tokens[q : q + k] for q in prefixes]
        start = time.perf_counter()
        filler.anchor_bitmasks(matchers)
        anchor.append((time.perf_counter() - start) / rows)
        start = time.perf_counter()
        bits = filler.window_bitmasks(matchers, drafts, k + 1)
        masks = sum(1 + len(d) for d in drafts)
        window.append((time.perf_counter() - start) / masks)
        logits = torch.randn(rows * (k + 1), compiler.vocab_size)
        flat = torch.from_numpy(bits.reshape(rows * (k + 1), -1))
        start = time.perf_counter()
        apply_token_bitmask(logits, flat, torch.arange(rows * (k + 1)))
        apply.append((time.perf_counter() - start) / (rows * (k + 1)))
        m = compiler.matcher(spec)
        m.advance(tokens[:p])
        start = time.perf_counter()
        m.advance(tokens[p : p + 1])
        advance.append(time.perf_counter() - start)

    def us(values):  # (median, and the least: a loaded host's noise only adds)
        return [round(statistics.median(values) * 1e6, 2), round(min(values) * 1e6, 2)]

    return {
        "tokens": n, "rows": rows, "k": k, "plain_mask_us_per_row": us(anchor),
        "window_mask_us_per_row_position": us(window), "apply_us_per_row_position": us(apply),
        "advance_us_per_token": us(advance),
    }  # fmt: skip


PROMPTS = [
    "Describe a person named Alice, 30, from Paris, as JSON with keys name, age, city.",
    "Give me a JSON object for Bob who is 42 and lives in Berlin (keys: name, age, city).",
    "Invent a character and give their name, age and home city as JSON.",
    "Describe your favourite teacher as JSON: name, age, city.",
]


def _syncs(llm: LLM, max_tokens: int, chat: bool) -> dict:
    """The same prompts greedily without and with a JSON schema, and with penalties: steps,
    speculative steps, those with grammar windows, the extra host syncs and the wall time a
    step."""
    runner = llm.engine.runner
    counted = {"steps": 0, "spec_steps": 0}
    real_launch = runner.launch

    def launch(plan):
        counted["steps"] += 1
        counted["spec_steps"] += any(r.num_draft for r in plan.rows)
        return real_launch(plan)

    def run(so, shaping):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so,
                                **shaping)  # fmt: skip
        if chat:
            llm.chat([[{"role": "user", "content": t}] for t in PROMPTS], params, use_tqdm=False)
        else:
            llm.generate(PROMPTS, params, use_tqdm=False)

    result = {}
    arms = (("without_grammar", None, {}), ("with_json_schema", S(json=PERSON), {}),
            ("with_penalties", None, PENALTIES))  # fmt: skip
    for arm, so, shaping in arms:
        run(so, shaping)  # (warm: the grammar compiled, the kernels built)
        runner.launch = launch
        stats = runner.stats
        before = (dict(counted), stats["structured_output_syncs"],
                  stats["structured_output_steps_behind"])  # fmt: skip
        start = time.perf_counter()
        run(so, shaping)
        seconds = time.perf_counter() - start
        runner.launch = real_launch
        steps = {key: counted[key] - before[0][key] for key in counted}
        syncs = stats["structured_output_syncs"] - before[1]
        # (a step with grammar windows launched behind another waits for its drafts with it)
        behind = stats["structured_output_steps_behind"] - before[2]
        # (a step with grammar windows waits for its drafts once: with the step before, or
        # alone)
        result[arm] = {**steps, "grammar_window_steps": behind + syncs,
                       "drafts_with_previous_wait": behind, "extra_syncs": syncs,
                       "extra_syncs_per_step": round(syncs / steps["steps"], 3),
                       "ms_per_step": round(seconds / steps["steps"] * 1e3, 3)}  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32", help="rows masked together")
    parser.add_argument("--k", type=int, default=7, help="drafts a window")
    parser.add_argument("--max-tokens", type=int, default=48, help="of the sync run's requests")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a saved tokenizer directory (default: the default model's)",
    )
    parser.add_argument("--model", default="default", help="the sync run's target")
    parser.add_argument("--drafter", default=None, help="its drafter (default: the shipped one)")
    parser.add_argument("--device", default="cpu", help="the sync run's device")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2, help="torch's CPU threads")
    parser.add_argument("--out", default="structured_output_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.tokenizer is None:
        tokenizer = load_tokenizer(resolve_model("default", None))
    else:
        from transformers import AutoTokenizer

        tokenizer = Tokenizer(AutoTokenizer.from_pretrained(args.tokenizer))
    compiler = GrammarCompiler(tokenizer, 49152, [2])
    masks = [{"constraint": name, **_mask_costs(compiler, spec, text, rows, args.k)}
             for name, (spec, text) in CASES.items()
             for rows in map(int, args.rows.split(","))]  # fmt: skip
    # (fixed K: the drafting policy would decode plain where a random drafter's drafts fail)
    spec_config = {"method": "dspark", "scheduling": False}
    if args.drafter is not None:
        spec_config["model"] = args.drafter
    llm = LLM(args.model, dtype=args.dtype, device=args.device, speculative_config=spec_config)
    syncs = _syncs(llm, args.max_tokens, chat=args.model == "default")
    eager = None
    if args.device == "cuda":  # (the eager baseline)
        del llm
        gc.collect()
        llm = LLM(args.model, dtype=args.dtype, device=args.device, use_cuda_graphs=False,
                  speculative_config=spec_config)  # fmt: skip
        eager = _syncs(llm, args.max_tokens, chat=args.model == "default")
    # (the carried tree's commit first: a device's copy may hold another commit's git metadata)
    commit = (
        os.environ.get("DSPARK_GIT_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "args": vars(args), "masks": masks,
              "syncs": syncs, "syncs_without_cuda_graphs": eager}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("us per row (and window position): median / least")
    names = ("plain_mask_us_per_row", "window_mask_us_per_row_position",
             "apply_us_per_row_position", "advance_us_per_token")  # fmt: skip
    print(f"{'constraint':>12} {'rows':>4} {'plain':>15} {'window':>15} {'apply':>15} "
          f"{'advance':>15}")  # fmt: skip
    for r in masks:
        cells = " ".join(f"{r[n][0]:7.1f}/{r[n][1]:7.1f}" for n in names)
        print(f"{r['constraint']:>12} {r['rows']:4d} {cells}")
    print(json.dumps(result["syncs"], indent=1))
    if eager is not None:
        print("without CUDA graphs:", json.dumps(eager, indent=1))


if __name__ == "__main__":
    main()
