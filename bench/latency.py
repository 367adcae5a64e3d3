"""Latency streams see from the engine: the silence of running streams while a long prompt
is chunked in, and the time to first token of a conversation's turns with prefix caching.

    python bench/latency.py prefill-silence --device cpu --budgets 8192,2048 --streams 4
    python bench/latency.py prefill-silence --device cuda --budgets 8192,2048 --streams 64
    python bench/latency.py prefix-caching --turns 8 --user-words 300 --out prefix_ttft.json
    python bench/latency.py prefix-caching --speculative-config '{"method": "dspark"}' ...

prefill-silence  the longest silence of running streams while a maximal prompt arrives, per
                 token budget. For each budget (max_num_batched_tokens) one engine starts
                 `--streams` streamed requests, waits until each has its first token, then adds
                 one prompt of max_model_len - 1 tokens. Decode rows run in every step, but a
                 step lasts as long as the prefill chunk it carries, so a stream is silent for
                 the longest step while the prompt is chunked. Reported per budget, as JSON
                 lines: the longest gap between two of a stream's outputs from the prompt's
                 arrival to its first token (`max_silence_s`), the long prompt's time to first
                 token (`long_ttft_s`), and the steps it took.
prefix-caching   time to first token of a multi-turn conversation's turns, prefix caching on
                 against off. Each turn's prompt is the chat template over the whole
                 conversation so far (the earlier user messages and the model's replies) plus a
                 new user message, so from the second turn on all but the new message is a
                 prefix the previous turn computed. One conversation runs at a time, turn after
                 turn, on one engine per arm (the same weights, greedy); `--repeats`
                 conversations with different messages, the median TTFT per turn reported, with
                 the cache's hits. TTFT is the engine's: from add_request to the step that
                 emitted the first token.
                 Replies. With caching on, a turn's new tokens are prefilled against cached
                 pages, another kernel path than the whole prompt's prefill: in half precision
                 the rounding differs, and a greedy argmax at a near-tie can flip (often with
                 random weights, whose logits are nearly flat). So each reply with caching on is
                 compared with the reply without: the count of equal ones and, per turn, the
                 first token where they differ (null: equal) are reported. Both arms continue
                 the conversation with the caching-off arm's replies (the on arm runs second),
                 so their prompts stay the same tokens turn after turn and each turn's TTFT
                 compares one prompt; after a reply that differs, the on arm recomputes the
                 pages of the reply it did not make (at most --max-tokens tokens, seen in the
                 hits). `--require-equal` (the default in float32 on the CPU, where the outputs
                 must not change) fails the run, after writing --out, when a reply differs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from dspark import LLM, SamplingParams

# ---- prefill silence -----------------------------------------------------------------------


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(llm: LLM, num_streams: int, device: str) -> dict:
    engine = llm.engine
    max_len = engine.max_model_len
    stream_params = SamplingParams(temperature=0.0, max_tokens=max_len // 2, ignore_eos=True,
                                   output_kind="delta")  # fmt: skip
    for i in range(num_streams):
        engine.add_request(f"stream-{i}", [100 + (3 * i + j) % 5000 for j in range(16)],
                           stream_params)  # fmt: skip
    last_output = {}
    while len(last_output) < num_streams:
        for out in engine.step():
            last_output[out.request_id] = time.perf_counter()
    long_prompt = [200 + (11 * j) % 5000 for j in range(max_len - 1)]
    _synchronize(device)
    arrival = time.perf_counter()
    engine.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=1))
    last_output = dict.fromkeys(last_output, arrival)
    max_silence, steps, long_done = 0.0, 0, None
    while long_done is None:
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outputs:
            if out.request_id == "long":
                long_done = now
            elif out.token_ids:
                max_silence = max(max_silence, now - last_output[out.request_id])
                last_output[out.request_id] = now
    for rid in list(last_output):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {"max_silence_s": round(max_silence, 3), "long_ttft_s": round(long_done - arrival, 3),
            "steps": steps, "prompt_tokens": len(long_prompt)}  # fmt: skip


def prefill_silence(args: argparse.Namespace) -> None:
    for budget in (int(b) for b in args.budgets.split(",")):
        llm = LLM(args.model, device=args.device, max_num_batched_tokens=budget,
                  max_model_len=args.max_model_len)  # fmt: skip
        result = measure(llm, args.streams, args.device)
        print(json.dumps({"budget": budget, "streams": args.streams, "device": args.device,
                          **result}), flush=True)  # fmt: skip
        del llm


# ---- prefix caching ------------------------------------------------------------------------

WORDS = ("the river stone light garden number window paper music station forest bridge letter "
         "engine market winter summer valley signal island road table doctor planet story "
         "machine circle silver yellow ocean").split()  # fmt: skip


def user_message(rng: random.Random, turn: int, num_words: int) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(num_words))
    return f"Turn {turn}. Summarise this in one sentence, then add a fact: {body}"


def run_arm(args: argparse.Namespace, caching: bool, history: list | None = None) -> dict:
    """One engine's conversations. history[turn][repeat]: the assistant messages the
    conversations continue with (the other arm's replies); None: the arm's own."""
    llm = LLM(args.model, device=args.device, enable_prefix_caching=caching,
              speculative_config=args.speculative_config, max_model_len=args.max_model_len,
              log_stats_interval_s=0)  # fmt: skip
    engine, tok = llm.engine, llm.engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(["warm-up: compile and settle the kernels"] * 2, params, use_tqdm=False)
    ttft = [[] for _ in range(args.turns)]  # [turn][repeat] seconds
    prompt_tokens = [[] for _ in range(args.turns)]
    replies = [[] for _ in range(args.turns)]  # [turn][repeat] token ids
    texts = [[] for _ in range(args.turns)]
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
            replies[turn].append(final.outputs[0].token_ids)
            texts[turn].append(final.outputs[0].text)
            reply = texts[turn][repeat] if history is None else history[turn][repeat]
            messages.append({"role": "assistant", "content": reply})
    cache = engine.prefix_cache
    return {
        "enable_prefix_caching": caching,
        "ttft_s": ttft,
        "prompt_tokens": prompt_tokens,
        "prefix_cache_queries": cache.num_queries if cache else 0,
        "prefix_cache_hits": cache.num_hits if cache else 0,
        "prompt_tokens_computed": engine.scheduler.num_prompt_tokens_computed,
        "replies": replies,
        "reply_texts": texts,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two replies differ; None when they are equal."""
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def report(off: dict, on: dict) -> list[dict]:
    rows = []
    print(f"{'turn':>4} {'prompt tok':>10} {'TTFT off ms':>12} {'TTFT on ms':>11} {'speed-up':>8} "
          f"{'equal':>6}")  # fmt: skip
    for turn, (t_off, t_on) in enumerate(zip(off["ttft_s"], on["ttft_s"], strict=True)):
        a, b = statistics.median(t_off), statistics.median(t_on)
        n = statistics.median(on["prompt_tokens"][turn])
        diffs = [first_difference(x, y) for x, y in
                 zip(off["replies"][turn], on["replies"][turn], strict=True)]  # fmt: skip
        equal = diffs.count(None)
        rows.append({"turn": turn, "prompt_tokens": n, "ttft_off_ms": 1e3 * a,
                     "ttft_on_ms": 1e3 * b, "speedup": a / b, "equal_replies": equal,
                     "first_difference": diffs})  # fmt: skip
        print(f"{turn:>4} {n:>10.0f} {1e3 * a:>12.2f} {1e3 * b:>11.2f} {a / b:>7.2f}x "
              f"{equal:>3}/{len(diffs)}")  # fmt: skip
    print(f"hits {on['prefix_cache_hits']:,} of {on['prefix_cache_queries']:,} query tokens; "
          f"prompt tokens computed {on['prompt_tokens_computed']:,} (on) against "
          f"{off['prompt_tokens_computed']:,} (off)")  # fmt: skip
    return rows


def prefix_caching(args: argparse.Namespace) -> None:
    start = time.monotonic()
    off = run_arm(args, caching=False)
    on = run_arm(args, caching=True, history=off["reply_texts"])
    rows = report(off, on)
    equal, total = sum(r["equal_replies"] for r in rows), args.turns * args.repeats
    where = f"{on['dtype']} on {on['device']}"
    print(f"replies equal with caching on: {equal} of {total} ({where})")
    if args.out is not None:
        settings = {k: v for k, v in vars(args).items() if k not in ("out", "func", "command")}
        result = {"args": settings, "turns": rows, "equal_replies": equal, "replies": total,
                  "off": off, "on": on, "wall_s": time.monotonic() - start}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    strict = args.require_equal
    if strict is None:
        strict = on["device"] == "cpu" and on["dtype"] == "float32"
    if strict and equal < total:
        raise SystemExit(f"{total - equal} of {total} replies differ with caching on ({where}): "
                         "prefix caching changed an output")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("prefill-silence", help="running streams' silence while a prompt arrives")
    s.add_argument("--model", default="default")
    s.add_argument("--device", default="auto")
    s.add_argument("--budgets", default="8192,2048", help="max_num_batched_tokens values")
    s.add_argument("--streams", type=int, default=4)
    s.add_argument("--max-model-len", type=int, default=None)
    s.set_defaults(func=prefill_silence)
    p = sub.add_parser("prefix-caching", help="each turn's TTFT, prefix caching on and off")
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="auto")
    p.add_argument("--speculative-config", type=json.loads, default=None)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-words", type=int, default=300, help="words of each user message")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens of each reply")
    p.add_argument("--repeats", type=int, default=3, help="conversations per arm (median)")
    p.add_argument(
        "--require-equal",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fail if a reply differs with caching on (default: float32 on CPU)",
    )
    p.add_argument("--out", type=Path, default=None)
    p.set_defaults(func=prefix_caching)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
