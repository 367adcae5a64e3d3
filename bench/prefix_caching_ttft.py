"""Time to first token of a multi-turn conversation's turns, prefix caching on against off.

Each turn's prompt is the chat template over the whole conversation so far (the earlier user
messages and the model's own replies) plus a new user message, so from the second turn on all
but the new message is a prefix the previous turn computed. One conversation runs at a time, turn
after turn, on one engine per arm (the same weights, greedy, so both arms see the same
conversation); `--repeats` conversations with different messages, the median TTFT per turn
reported. TTFT is the engine's: from add_request to the step that emitted the first token.

    python bench/prefix_caching_ttft.py --turns 8 --user-words 300 --out prefix_ttft.json
    python bench/prefix_caching_ttft.py --speculative-config '{"method": "dspark"}' ...
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

WORDS = ("the river stone light garden number window paper music station forest bridge letter "
         "engine market winter summer valley signal island road table doctor planet story "
         "machine circle silver yellow ocean").split()  # fmt: skip


def user_message(rng: random.Random, turn: int, num_words: int) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(num_words))
    return f"Turn {turn}. Summarise this in one sentence, then add a fact: {body}"


def run_arm(args: argparse.Namespace, caching: bool) -> dict:
    from dspark import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, enable_prefix_caching=caching,
              speculative_config=args.speculative_config, max_model_len=args.max_model_len,
              log_stats_interval_s=0)  # fmt: skip
    engine, tok = llm.engine, llm.engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(["warm-up: compile and settle the kernels"] * 2, params, use_tqdm=False)
    ttft = [[] for _ in range(args.turns)]  # [turn][repeat] seconds
    prompt_tokens = [[] for _ in range(args.turns)]
    replies = []
    for repeat in range(args.repeats):
        rng = random.Random(1000 + repeat)
        messages: list[dict[str, str]] = []
        for turn in range(args.turns):
            messages.append({"role": "user", "content": user_message(rng, turn, args.user_words)})
            ids = tok.apply_chat_template(messages)
            rid = f"r{repeat}t{turn}"
            engine.add_request(rid, ids, params)
            final = None
            while final is None:
                final = next((o for o in engine.step() if o.finished), None)
            m = final.metrics
            ttft[turn].append(m["first_token_time"] - m["arrival_time"])
            prompt_tokens[turn].append(len(ids))
            text = final.outputs[0].text
            replies.append(final.outputs[0].token_ids)
            messages.append({"role": "assistant", "content": text})
    cache = engine.prefix_cache
    return {
        "enable_prefix_caching": caching,
        "ttft_s": ttft,
        "prompt_tokens": prompt_tokens,
        "prefix_cache_queries": cache.num_queries if cache else 0,
        "prefix_cache_hits": cache.num_hits if cache else 0,
        "prompt_tokens_computed": engine.scheduler.num_prompt_tokens_computed,
        "replies": replies,
        "device": str(engine.device),
    }


def report(off: dict, on: dict) -> list[dict]:
    rows = []
    print(f"{'turn':>4} {'prompt tok':>10} {'TTFT off ms':>12} {'TTFT on ms':>11} {'speed-up':>8}")
    for turn, (t_off, t_on) in enumerate(zip(off["ttft_s"], on["ttft_s"], strict=True)):
        a, b = statistics.median(t_off), statistics.median(t_on)
        n = statistics.median(on["prompt_tokens"][turn])
        rows.append({"turn": turn, "prompt_tokens": n, "ttft_off_ms": 1e3 * a,
                     "ttft_on_ms": 1e3 * b, "speedup": a / b})  # fmt: skip
        print(f"{turn:>4} {n:>10.0f} {1e3 * a:>12.2f} {1e3 * b:>11.2f} {a / b:>7.2f}x")
    print(f"hits {on['prefix_cache_hits']:,} of {on['prefix_cache_queries']:,} query tokens; "
          f"prompt tokens computed {on['prompt_tokens_computed']:,} (on) against "
          f"{off['prompt_tokens_computed']:,} (off)")  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="auto")
    p.add_argument("--speculative-config", type=json.loads, default=None)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-words", type=int, default=300, help="words of each user message")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens of each reply")
    p.add_argument("--repeats", type=int, default=3, help="conversations per arm (median)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    start = time.monotonic()
    off = run_arm(args, caching=False)
    on = run_arm(args, caching=True)
    if on["replies"] != off["replies"]:
        raise SystemExit("the replies differ with caching on: prefix caching changed an output")
    rows = report(off, on)
    if args.out is not None:
        result = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "turns": rows,
                  "off": off, "on": on, "wall_s": time.monotonic() - start}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
