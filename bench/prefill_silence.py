"""The longest silence of running streams while a maximal prompt arrives, per token budget.

    python bench/prefill_silence.py --device cpu --budgets 8192,2048 --streams 4
    python bench/prefill_silence.py --device cuda --budgets 8192,2048 --streams 64

For each budget (max_num_batched_tokens) one engine starts `--streams` streamed requests, waits
until each has its first token, then adds one prompt of max_model_len - 1 tokens. Decode rows
run in every step, but a step lasts as long as the prefill chunk it carries, so a stream is
silent for the longest step while the prompt is chunked. Reported per budget, as JSON lines:
the longest gap between two of a stream's outputs from the prompt's arrival to its first
token (`max_silence_s`), the long prompt's time to first token (`long_ttft_s`), and the steps
it took.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dspark import LLM, SamplingParams


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--budgets", default="8192,2048", help="max_num_batched_tokens values")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args()
    for budget in (int(b) for b in args.budgets.split(",")):
        llm = LLM(args.model, device=args.device, max_num_batched_tokens=budget,
                  max_model_len=args.max_model_len)  # fmt: skip
        result = measure(llm, args.streams, args.device)
        print(json.dumps({"budget": budget, "streams": args.streams, "device": args.device,
                          **result}), flush=True)  # fmt: skip
        del llm


if __name__ == "__main__":
    main()
