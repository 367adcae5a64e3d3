"""The Hugging Face transformers peer: the same checkpoint, prompts and output length as dspark.

transformers has no continuous batching in `generate`, so its best offline form is one
left-padded batch per concurrency level with a static KV cache (which transformers also compiles
on CUDA). Every sequence runs exactly `output_len` tokens (min_new_tokens = max_new_tokens
suppresses EOS), matching dspark's ignore_eos, so both engines do the same amount of decoding.
The static cache allocates (and on CUDA compiles) per batch shape, so each level is warmed up once
on its own batch before the timed runs.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from dspark.models.loader import resolve_model

CACHE_IMPLEMENTATIONS = ("static", "dynamic")


@dataclass(frozen=True)
class HFPeerConfig:
    output_len: int
    repeats: int
    max_concurrency: int  # levels above this are skipped: one padded batch grows without bound
    cache_implementation: str  # "static" (the fast path) or "dynamic" (reported as such)
    pad_token_id: int  # any in-vocabulary id: padded positions are masked out


def load_hf_model(model: str, dtype: torch.dtype, device: torch.device):
    """AutoModelForCausalLM from the checkpoint dspark loads (GGUF is dequantised to `dtype`)."""
    from transformers import AutoModelForCausalLM

    source = resolve_model(model)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    hf_model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=dtype, **kwargs)
    return hf_model.to(device).eval()


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so the host clock measures finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def left_pad(
    prompts: list[list[int]], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding keeps every prompt's last token in the final column, where decoding starts.

    prompts [[5, 6, 7], [8]], pad 0  ->  input_ids [[5, 6, 7], [0, 0, 8]]
                                         mask      [[1, 1, 1], [0, 0, 1]]
    """
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)  # (C, T)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (C, T)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    return input_ids.to(device), attention_mask.to(device)


@torch.inference_mode()
def timed_generate(
    hf_model, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: HFPeerConfig
) -> tuple[float, int]:
    """One greedy batch of exactly output_len new tokens: (wall seconds, output tokens)."""
    device = input_ids.device
    synchronize(device)
    start = time.perf_counter()
    out = hf_model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=config.output_len,
        min_new_tokens=config.output_len,
        pad_token_id=config.pad_token_id,
        cache_implementation=config.cache_implementation,
    )  # (C, T + output_len)
    synchronize(device)
    wall = time.perf_counter() - start
    return wall, out.shape[0] * (out.shape[1] - input_ids.shape[1])


def run_hf_level(hf_model, prompts: list[list[int]], config: HFPeerConfig) -> dict:
    """Warm up on this batch's shape, then time `repeats` runs and keep the median throughput."""
    device = next(hf_model.parameters()).device
    input_ids, attention_mask = left_pad(prompts, config.pad_token_id, device)
    warmup_s, _ = timed_generate(hf_model, input_ids, attention_mask, config)
    runs = [
        timed_generate(hf_model, input_ids, attention_mask, config) for _ in range(config.repeats)
    ]
    tok_per_s = [tokens / wall for wall, tokens in runs]
    return {
        "concurrency": len(prompts),
        "skipped": False,
        "padded_prompt_len": input_ids.shape[1],
        "warmup_s": warmup_s,
        "wall_s": [wall for wall, _ in runs],
        "output_tokens": runs[0][1],
        "output_tokens_per_s_runs": tok_per_s,
        "output_tokens_per_s": statistics.median(tok_per_s),
    }


def _skipped(concurrency: int, reason: str) -> dict:
    return {"concurrency": concurrency, "skipped": True, "reason": reason}


def run_hf_sweep(hf_model, batches: dict[int, list[list[int]]], config: HFPeerConfig) -> list[dict]:
    """Every level in `batches` (concurrency -> prompt ids), smallest first.

    Out of memory is a result, not a crash: the level and every larger one are recorded as
    skipped with the reason, and the cache is released so the rest of the run is unaffected.
    """
    levels: list[dict] = []
    oom_at: int | None = None
    for c in sorted(batches):
        if c > config.max_concurrency:
            levels.append(_skipped(c, f"above --hf-max-concurrency {config.max_concurrency}"))
        elif oom_at is not None:
            levels.append(_skipped(c, f"concurrency {oom_at} already ran out of memory"))
        else:
            try:
                levels.append(run_hf_level(hf_model, batches[c], config))
            except torch.OutOfMemoryError as e:
                levels.append(_skipped(c, f"out of memory: {str(e).splitlines()[0]}"))
                oom_at = c
            if oom_at == c:  # outside the except: its traceback no longer pins the tensors
                release_memory()
        _log_level(levels[-1])
    return levels


def _log_level(level: dict) -> None:
    # progress on stderr: a sweep runs for minutes and logging is quiet by default
    c = level["concurrency"]
    if level["skipped"]:
        print(f"hf     C={c}: skipped ({level['reason']})", file=sys.stderr, flush=True)
    else:
        tok_s = level["output_tokens_per_s"]
        print(f"hf     C={c}: {tok_s:.1f} output tok/s", file=sys.stderr, flush=True)


def release_memory() -> None:
    """Return freed blocks to the device so the next model or batch can use them."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
