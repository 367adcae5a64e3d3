"""The sweep: prompts, one engine per arm, warm-up, every level, the HF peer, the results JSON.

Every arm's LLM is built first and warmed up; then for each level, for each repeat, every arm
runs the level in turn (arm order as given), so drift hits all arms alike. All arms' engines are
resident at once, each with its own KV cache sized as without arms (enough pages for the largest
level, or --kv-cache-memory-gb each). The JSON gains "arms" (name -> speculative_config, warm-up,
levels, each level with the "start_s" of its runs) and "arm_ratios" (per level, each arm's tok/s
over the first arm's and over the best other arm's); "dspark" stays the first arm's sweep, so the
HF ratios compare against it. Without --arms there is one arm, --speculative-config's.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict

import torch

from dspark.benchmarks.hf_peer import HFPeerConfig, load_hf_model, release_memory, run_hf_sweep
from dspark.benchmarks.offline_config import BenchConfig, split_arm
from dspark.benchmarks.offline_level import run_dspark_once, run_level
from dspark.benchmarks.offline_prompts import cycle, render, resolve_prompts_dir, truncate
from dspark.benchmarks.plot import plot_results
from dspark.benchmarks.prompts import load_prompts
from dspark.benchmarks.report import (
    arm_ratios,
    environment,
    format_arms_table,
    format_overhead_table,
    format_paired_table,
    format_table,
    ratios,
    write_results,
)
from dspark.config import EngineConfig
from dspark.engine.engine import LLMEngine
from dspark.models.loader import resolve_model
from dspark.models.tokenizer import Tokenizer, load_tokenizer

WARMUP_REQUESTS = 4
WARMUP_TOKENS = 16


# ---- dspark -----------------------------------------------------------------------------------


def engine_kwargs(config: BenchConfig) -> dict:
    """One engine for the whole sweep: room for the largest level's requests at once.

    Without --kv-cache-memory-gb the KV cache holds every request of the largest level at full
    length, so no level measures preemption instead of batching. The seats are at least the
    default engine's, so the graph ladder, and with it the fingerprint a shipped cost table
    must match, is the default engine's whatever the levels (a sweep to 64 once built a ladder
    to 64, its engines refused the shipped table and the policy arms ran as fixed K).
    """
    max_c = max(config.concurrency)
    kwargs = dict(
        model=config.model,
        dtype=config.dtype,
        device=config.device,
        max_num_seqs=max(max_c, EngineConfig.max_num_seqs),
        max_model_len=config.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens
        or max(EngineConfig.max_num_batched_tokens, max_c),
        speculative_config=config.speculative_config,
        tensor_parallel_size=config.tensor_parallel_size,
    )
    if config.kv_cache_memory_gb is not None:
        kwargs["kv_cache_memory_gb"] = config.kv_cache_memory_gb
    else:
        page_size = EngineConfig.page_size
        pages = max_c * math.ceil((config.max_prompt_len + config.max_output_len) / page_size)
        # a --max-model-len above the bench's lengths must still fit one request
        pages = max(pages, math.ceil((config.max_model_len or 0) / page_size))
        kwargs["num_kv_pages"] = 1 + pages  # + the scratch page
    return kwargs


def check_lengths(config: BenchConfig, max_model_len: int) -> None:
    longest = config.max_output_len
    if config.max_prompt_len + longest > max_model_len:
        raise ValueError(
            f"--max-prompt-len {config.max_prompt_len} plus the longest output {longest} "
            f"(--output-len {config.output_len}, --output-len-spread "
            f"{config.output_len_spread}) exceeds max_model_len {max_model_len}; lower "
            f"--max-prompt-len to at most {max_model_len - longest}"
        )


def warm_up(llm, prompts: list[list[int]], output_len: int, temperature: float = 0.0) -> dict:
    warm = run_dspark_once(llm, prompts, min(output_len, WARMUP_TOKENS), temperature=temperature)
    return {"num_requests": len(prompts), "output_tokens": warm["tokens"], "wall_s": warm["wall"]}


def run_arms_sweep(
    llms: dict, config: BenchConfig, batches: dict, warmup: list[list[int]]
) -> dict[str, dict]:
    """Each arm's sweep ({"warmup", "levels"}), every arm warmed up before any level runs."""
    warmups = {
        name: warm_up(llm, warmup, config.output_len, config.temperature)
        for name, llm in llms.items()
    }
    for name, llm in llms.items():  # an arm meant to schedule may have fallen back to fixed K
        status = llm.get_metrics().get("scheduling")
        if status:
            print(f"{name}: {status}", file=sys.stderr, flush=True)
    levels = {name: [] for name in llms}
    sweep_start = time.perf_counter()
    for c in config.concurrency:
        for name, level in run_level(llms, batches[c], config, sweep_start, c).items():
            levels[name].append(level)
    return {name: {"warmup": warmups[name], "levels": levels[name]} for name in llms}


# ---- the run ----------------------------------------------------------------------------------


def run_offline_bench(
    config: BenchConfig, command: str = "", arguments: dict | None = None
) -> dict:
    """Run the sweep on dspark's arms and/or the HF peer; write the JSON (and plot), print tables.

    Every arm's engine is resident at once (see the module docstring); the peer runs after they
    are freed, on the whole device.
    """
    prompts_dir = resolve_prompts_dir(config)
    conversations = load_prompts(prompts_dir, config.sources, config.seed, config.prompt_split)
    engine_config = EngineConfig(model=config.model, dtype=config.dtype, device=config.device)
    device = engine_config.torch_device()
    dtype = engine_config.torch_dtype(device)
    results = metadata(config, device, dtype, command, arguments)
    results["prompts"] = {
        "dir": str(prompts_dir) if prompts_dir else None,
        "num_loaded": len(conversations),
    }
    with resident_arms_hint(config):
        llms = build_llms(config, results) if config.use_dspark else {}
    tokenizer = (
        next(iter(llms.values())).get_tokenizer()
        if llms
        else load_tokenizer(resolve_model(config.model))
    )
    most = max(config.num_requests(c) for c in config.concurrency)
    full = [tokenizer.apply_chat_template(c) for c in cycle(conversations, most)]
    prompt_ids = [truncate(ids, config.max_prompt_len) for ids in full]
    results["prompts"]["num_truncated"] = sum(len(ids) > config.max_prompt_len for ids in full)
    batches = {c: prompt_ids[: config.num_requests(c)] for c in config.concurrency}
    if llms:
        # the warm-up takes the list's last prompts, so it never pre-runs a measured one
        warmup = render(tokenizer, conversations[-WARMUP_REQUESTS:], config.max_prompt_len)
        with resident_arms_hint(config):
            record_arms(results, config, run_arms_sweep(llms, config, batches, warmup))
        del llms  # the peer gets the whole device
        release_memory()
    if config.use_hf:
        results["hf"] = run_hf(config, tokenizer, batches, dtype, device)
    results["ratios"] = ratios(config.concurrency, results["dspark"], results["hf"])
    write_results(results, config.out, config.plot, draw=plot_results)
    print(format_table(results))
    if len(results.get("arms") or {}) > 1:
        print(format_arms_table(results))
        print(format_paired_table(results))
    if (overhead := format_overhead_table(results)) is not None:
        print(overhead)
    return results


@contextlib.contextmanager
def resident_arms_hint(config: BenchConfig) -> Iterator[None]:
    """Out of device memory with several arms: say that every arm's engine is resident at once
    (Qwen3-8B's weights alone are 16 GB an arm) and what to do instead."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:
        arms = config.arm_configs()
        if len(arms) < 2 or "out of memory" not in str(e):
            raise
        raise MemoryError(
            f"out of device memory with {len(arms)} arms ({', '.join(arms)}): every arm's engine "
            "(weights, KV cache, graphs) is resident at once; run the arms in separate "
            "`dspark bench` calls, or give each a smaller --kv-cache-memory-gb"
        ) from e


def record_arms(results: dict, config: BenchConfig, sweeps: dict[str, dict]) -> None:
    """The first arm's sweep is "dspark" (the HF ratios and the first table read it); with --arms
    every arm's sweep and the ratios between them are recorded as well."""
    results["dspark"] = next(iter(sweeps.values()))
    if config.arms is not None:
        results["arms"] = {
            name: {"speculative_config": config.arms[name], **sweep}
            for name, sweep in sweeps.items()
        }
        results["arm_ratios"] = arm_ratios(config.concurrency, results["arms"])


def metadata(
    config: BenchConfig, device: torch.device, dtype: torch.dtype, command: str, arguments
) -> dict:
    return {
        "command": command,
        "arguments": arguments or {},
        **environment(device),
        "model": config.model,
        "model_path": str(resolve_model(config.model).path.resolve()),
        "dtype": str(dtype).removeprefix("torch."),
        "output_len": config.output_len,
        "output_len_spread": config.output_len_spread,
        "temperature": config.temperature,
        "max_prompt_len": config.max_prompt_len,
        "repeats": config.repeats,
        "waves": config.waves,
        "min_requests": config.min_requests,
        "concurrency": list(config.concurrency),
        "sources": list(config.sources),
        "seed": config.seed,
        "prompt_split": config.prompt_split,
        # drafts kept by a profile, not the target (spec/synthetic.py); None: real acceptance
        "synthetic": _synthetic_record(config),
        "engine": None,
        "dspark": None,
        "hf": None,
    }


def _synthetic_record(config: BenchConfig) -> dict | None:
    """The mode's summary (each arm's levels record it at the arm's K, in "speculation")."""
    synthetic = config.synthetic()
    return None if synthetic is None else synthetic.summary()


def build_llms(config: BenchConfig, results: dict) -> dict:
    """One LLM per arm, same engine kwargs but its own speculative_config; results["engine"]
    records the kwargs they share (with --arms each arm's speculative_config is in its entry)."""
    kwargs = engine_kwargs(config)
    llms = {}
    for name, arm in config.arm_configs().items():
        spec, engine = split_arm(arm)
        llms[name] = _arm_llm(kwargs | engine | {"speculative_config": spec}, config)
    max_model_len = min(llm.engine.max_model_len for llm in llms.values())
    check_lengths(config, max_model_len)
    shared = {k: v for k, v in kwargs.items() if k not in ("model", "dtype", "device")}
    if config.arms is not None:
        del shared["speculative_config"]
    results["engine"] = shared | {"max_model_len": max_model_len}
    return llms


def _arm_llm(kwargs: dict, config: BenchConfig):
    """An arm's LLM; under --synthetic-acceptance over an engine built with it (LLM refuses
    the mode: its text is not the model's)."""
    from dspark.llm import LLM

    synthetic = config.synthetic()
    if synthetic is None:
        return LLM(**kwargs)
    return LLM.from_engine(LLMEngine(EngineConfig(**kwargs), synthetic=synthetic))


def run_hf(config: BenchConfig, tokenizer: Tokenizer, batches: dict, dtype, device) -> dict:
    hf_model = load_hf_model(config.model, dtype, device)
    eos = tokenizer.eos_token_id  # the pad id: any in-vocabulary id works, pads are masked
    peer = HFPeerConfig(
        output_len=config.output_len,
        repeats=config.repeats,
        max_concurrency=config.hf_max_concurrency,
        cache_implementation=config.hf_cache,
        pad_token_id=eos if eos is not None else 0,
    )
    levels = run_hf_sweep(hf_model, batches, peer)
    del hf_model
    release_memory()
    return {**asdict(peer), "levels": levels}
