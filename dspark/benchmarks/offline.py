"""`dspark bench`: offline throughput and latency over a concurrency sweep, with the HF peer.

For each concurrency C, C requests are submitted at once (the first C prompts of the mixed list,
cycling if C is larger) and run greedily (or at `--temperature T`, request i seeded with i) to
exactly `output_len` tokens (ignore_eos), so every level does a known amount of decoding. The
wall time of the whole generate call gives output tokens/s; each request's metrics give TTFT
(first token - submit) and TPOT (the mean gap between its later tokens). The transformers peer
runs the same prompts in the same invocation, on the same device, so the dspark/HF ratio carries
no cross-run noise.

`--waves W` runs W C requests with at most C in flight (a closed loop). With one length for
all, plain decoding stays in lockstep: each wave ends at one step and the next is admitted at
once, which a server never sees. `--output-len-spread S` gives the requests seeded lengths in
output_len * [1 - S, 1 + S], the same for every arm, so they end at different steps and
admissions meet running requests.

Arms compare engine configurations the same way. On a shared host consecutive runs drift (up to
2x on the GPU machine), so two separate invocations cannot be compared; `--arms` measures several
speculative_configs in one invocation, interleaved:

    dspark bench --arms '{"plain": null, "k7": {"method": "dspark"},
                          "k3": {"method": "dspark", "num_speculative_tokens": 3},
                          "scheduled": {"method": "dspark", "cost_table": "t.json"},
                          "k7-ahead": {"method": "dspark", "engine": {"async_spec_steps": true}}}'

An arm's "engine" object sets its own engine options (ARM_ENGINE_OPTIONS: the scheduling and
graph switches, max_num_batched_tokens, mixed_prefill_tokens); every other engine option is
shared. `{"engine": {"mixed_prefill_tokens": 256}}` is plain decoding with mixed decode graphs.

Every arm's LLM is built first and warmed up; then for each level, for each repeat, every arm
runs the level in turn (arm order as given), so drift hits all arms alike. All arms' engines are
resident at once, each with its own KV cache sized as without arms (enough pages for the largest
level, or --kv-cache-memory-gb each). The JSON gains "arms" (name -> speculative_config, warm-up,
levels, each level with the "start_s" of its runs) and "arm_ratios" (per level, each arm's tok/s
over the first arm's and over the best other arm's); "dspark" stays the first arm's sweep, so the
HF ratios compare against it. Without --arms there is one arm, --speculative-config's.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from dspark.benchmarks.gpu_state import held_down, read_gpu_state
from dspark.benchmarks.hf_peer import (
    CACHE_IMPLEMENTATIONS,
    HFPeerConfig,
    load_hf_model,
    release_memory,
    run_hf_sweep,
    synchronize,
)
from dspark.benchmarks.prompts import (
    PROMPT_SPLITS,
    SOURCES,
    default_prompts_dir,
    load_prompts,
    output_lengths,
    parse_sources,
)
from dspark.benchmarks.report import (
    arm_ratios,
    environment,
    format_arms_table,
    format_table,
    ratios,
    write_results,
)
from dspark.config import DTYPE_CHOICES, EngineConfig
from dspark.models.loader import resolve_model
from dspark.models.tokenizer import Tokenizer, load_tokenizer
from dspark.spec.config import SpecConfig

DEFAULT_CONCURRENCY = "1,4,16,64,256,512"
WARMUP_REQUESTS = 4
WARMUP_TOKENS = 16
# Truncation keeps a prompt's last tokens: the end of the user turn and the assistant header
# the chat template writes there must survive, or the model would continue the user's text.
TRUNCATION_TAIL = 16


@dataclass(frozen=True)
class BenchConfig:
    model: str = "default"
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_memory_gb: float | None = None  # None: pages for the largest level, no preemption
    max_num_batched_tokens: int | None = None  # None: the engine default, at least max C
    max_model_len: int | None = None
    speculative_config: dict | None = field(default=None, hash=False)
    # name -> speculative_config or None (plain decoding), measured interleaved; None: one arm
    arms: dict[str, dict | None] | None = field(default=None, hash=False)
    concurrency: tuple[int, ...] = (1, 4, 16, 64, 256, 512)
    output_len: int = 256
    max_prompt_len: int = 512
    repeats: int = 1
    # requests per level in units of C: 1, one wave of C submitted at once; W > 1, W * C
    # requests with at most C in flight, the next submitted as one ends (a closed loop)
    waves: int = 1
    # request i's length is output_len * (1 - S + 2 S u_i), u_i uniform in [0, 1) from the
    # seed, the same for every arm and repeat; 0: every request output_len tokens. With
    # waves > 1, requests then end at different steps and admissions meet running requests,
    # as in a server (in lockstep, each wave is admitted all at once)
    output_len_spread: float = 0.0
    # 0: greedy; T > 0 samples from the full distribution at T (no top-k/top-p), request i
    # with seed i, as the acceptance-sensitive arms need (speculation keeps the distribution)
    temperature: float = 0.0
    prompts_dir: Path | None = None
    sources: tuple[str, ...] = SOURCES
    seed: int = 0
    prompt_split: str = "eval"  # "eval": the drafter training's held-out prompts only
    use_dspark: bool = True
    use_hf: bool = False
    hf_max_concurrency: int = 64
    hf_cache: str = "static"
    out: Path = Path("bench_results.json")
    plot: Path | None = None  # None: no plot

    def __post_init__(self) -> None:
        for name in ("output_len", "max_prompt_len", "repeats", "hf_max_concurrency", "waves"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if not (self.use_dspark or self.use_hf):
            raise ValueError("nothing to run: both dspark and the HF peer are off")
        if self.hf_cache not in CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"hf_cache must be one of {CACHE_IMPLEMENTATIONS}, got {self.hf_cache}"
            )
        check_arms(self.arms, self.speculative_config)
        if not 0.0 <= self.output_len_spread < 1.0:
            raise ValueError(f"output_len_spread must be in [0, 1), got {self.output_len_spread}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature and self.use_hf:
            raise ValueError(
                f"--temperature {self.temperature}: the HF peer runs greedy (the brief's peer "
                "figures are greedy): run the peer without it"
            )
        if self.output_len_spread and self.use_hf:
            raise ValueError(
                "--output-len-spread gives requests different lengths, the HF peer static "
                "batches of one length: run the peer without it"
            )
        if self.waves > 1 and self.use_hf:
            raise ValueError(
                f"--waves {self.waves} runs a closed loop, the HF peer static batches of C: run "
                "the peer with --waves 1"
            )
        if self.arms is not None and not self.use_dspark:
            raise ValueError("--arms are dspark engines: they cannot run with --hf-only")

    @property
    def max_output_len(self) -> int:
        """The longest a request's output can be (output_lengths)."""
        return math.ceil(self.output_len * (1 + self.output_len_spread))

    def arm_configs(self) -> dict[str, dict | None]:
        """Name -> speculative_config; without --arms one arm, "dspark", --speculative-config's."""
        return dict(self.arms) if self.arms is not None else {"dspark": self.speculative_config}


def check_arms(arms: object, speculative_config: dict | None) -> None:
    """--arms: a non-empty object of arm name -> speculative_config object or null."""
    if arms is None:
        return
    if not isinstance(arms, dict) or not arms:
        raise ValueError(
            "--arms must be a non-empty JSON object of arm name -> speculative_config object or "
            f"null, got {arms!r}"
        )
    if speculative_config is not None:
        raise ValueError(
            "give --arms or --speculative-config, not both: put the speculative_config "
            f"{speculative_config!r} in an arm"
        )
    for name, arm in arms.items():
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"--arms names must be non-empty strings, got {name!r}")
        if arm is not None and not isinstance(arm, dict):
            raise ValueError(
                f"--arms {name!r} must be null (plain decoding) or a speculative_config object, "
                f"got {arm!r}"
            )
        spec, engine = split_arm(arm)
        bad = sorted(set(engine) - ARM_ENGINE_OPTIONS)
        if bad:
            raise ValueError(
                f"--arms {name!r}: engine options {bad} cannot vary per arm; allowed: "
                f"{sorted(ARM_ENGINE_OPTIONS)}"
            )
        try:  # a bad key fails here, before any arm's model is loaded
            SpecConfig.from_dict(spec)
        except ValueError as e:
            raise ValueError(f"--arms {name!r}: {e}") from None


# engine options an arm may set for itself ("engine" inside its object); the rest are shared
ARM_ENGINE_OPTIONS = frozenset(
    {
        "async_scheduling",
        "async_spec_steps",
        "use_cuda_graphs",
        "max_num_batched_tokens",
        "mixed_prefill_tokens",
    }
)


def split_arm(arm: dict | None) -> tuple[dict | None, dict]:
    """An arm's (speculative_config or None, engine options): {"engine": {...}} is its own
    engine options (ARM_ENGINE_OPTIONS: the scheduling and graph switches, the step's token
    budget), the other keys its speculative_config (none: plain decoding).

      {"method": "dspark", "engine": {"async_spec_steps": true}}
          -> ({"method": "dspark"}, {...})
      {"engine": {"async_scheduling": false}} -> (None, {...})
    """
    if arm is None:
        return None, {}
    spec = {k: v for k, v in arm.items() if k != "engine"}
    engine = arm.get("engine") or {}
    if not isinstance(engine, dict):
        raise ValueError(f'an arm\'s "engine" must be an object, got {engine!r}')
    return (spec or None), engine


def parse_arms(text: str | None) -> dict | None:
    """--arms' JSON; a name given twice is an error (json.loads would keep only the last)."""
    if text is None:
        return None

    def unique(pairs: list[tuple[str, object]]) -> dict:
        keys = [key for key, _ in pairs]
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        if repeated:
            raise ValueError(f"--arms gives {repeated} twice in one object")
        return dict(pairs)

    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as e:
        raise ValueError(f"--arms must be a JSON object, got {text!r} ({e})") from None


def parse_concurrency(text: str) -> tuple[int, ...]:
    """'16,1,4' -> (1, 4, 16): levels run smallest first."""
    try:
        levels = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {text!r}") from None
    if not levels or levels[0] < 1:
        raise ValueError(f"--concurrency levels must be >= 1, got {text!r}")
    return tuple(levels)


# ---- prompts ----------------------------------------------------------------------------------


def truncate(ids: list[int], max_len: int) -> list[int]:
    """Keep the head and the last TRUNCATION_TAIL tokens (see TRUNCATION_TAIL)."""
    if len(ids) <= max_len:
        return ids
    tail = min(TRUNCATION_TAIL, max_len // 2)
    return ids[: max_len - tail] + ids[len(ids) - tail :]


def render(tokenizer: Tokenizer, conversations: list[list[dict]], max_len: int) -> list[list[int]]:
    return [truncate(tokenizer.apply_chat_template(c), max_len) for c in conversations]


def cycle(items: list, count: int) -> list:
    """items[0:count], wrapping around when count exceeds len(items)."""
    return [items[i % len(items)] for i in range(count)]


def resolve_prompts_dir(config: BenchConfig) -> Path | None:
    prompts_dir = config.prompts_dir or default_prompts_dir()
    if prompts_dir is None and set(config.sources) - {"humaneval"}:
        raise ValueError(
            "no prompts directory: ../shared/data is missing beside the repo; pass --prompts-dir"
        )
    return prompts_dir


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


def run_dspark_once(
    llm,
    prompts: list[list[int]],
    output_len: int | list[int],
    max_in_flight: int | None = None,
    temperature: float = 0.0,
) -> dict:
    """All prompts, greedy (or at temperature, prompt i seeded with i) to output_len tokens
    (one length, or one per prompt): wall time and per-request latencies. Without max_in_flight
    (or with it >= the prompts) one generate call submits them at once; else a closed loop
    keeps max_in_flight requests running, submitting the next as one ends."""
    from dspark.sampling_params import SamplingParams

    lengths = [output_len] * len(prompts) if isinstance(output_len, int) else output_len
    params = [
        SamplingParams(
            temperature=temperature, seed=i if temperature else None, max_tokens=n, ignore_eos=True
        )  # fmt: skip
        for i, n in enumerate(lengths)
    ]
    synchronize(llm.engine.device)
    start = time.perf_counter()
    if max_in_flight is None or max_in_flight >= len(prompts):
        submit = [time.monotonic()] * len(prompts)  # the clock RequestOutput.metrics uses
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params,
                               use_tqdm=False)  # fmt: skip
    else:
        outputs, submit = _closed_loop(llm, prompts, params, max_in_flight)
    synchronize(llm.engine.device)
    wall = time.perf_counter() - start
    num_tokens = [len(o.outputs[0].token_ids) for o in outputs]
    ttft = [o.metrics["first_token_time"] - t for o, t in zip(outputs, submit, strict=True)]
    tpot = [
        (o.metrics["finished_time"] - o.metrics["first_token_time"]) / (n - 1)
        for o, n in zip(outputs, num_tokens, strict=True)
        if n > 1
    ]
    preemptions = sum(int(o.metrics.get("num_preemptions", 0)) for o in outputs)
    return dict(
        start=start,
        wall=wall,
        tokens=sum(num_tokens),
        ttft=ttft,
        tpot=tpot,
        preemptions=preemptions,
    )


def _closed_loop(llm, prompts: list[list[int]], params: list, max_in_flight: int):
    """Keep max_in_flight requests in the engine: each that ends is replaced by the next prompt
    in the same step loop. Returns the outputs in prompt order and each one's submit time."""
    engine = llm.engine
    params = [replace(p, output_kind="final_only") for p in params]
    tag = f"bench-{time.monotonic_ns()}"
    outputs: dict[int, object] = {}
    submit: dict[int, float] = {}
    next_prompt = 0
    while len(outputs) < len(prompts):
        while next_prompt < len(prompts) and next_prompt - len(outputs) < max_in_flight:
            submit[next_prompt] = time.monotonic()
            engine.add_request(f"{tag}-{next_prompt}", prompts[next_prompt], params[next_prompt])
            next_prompt += 1
        for out in engine.step():
            if out.finished and out.request_id.startswith(tag):
                outputs[int(out.request_id.rsplit("-", 1)[1])] = out
    while engine.has_unfinished_requests() and not engine.scheduler.has_unfinished:
        engine.step()  # a step launched ahead for requests that just ended: collect it
    order = range(len(prompts))
    return [outputs[i] for i in order], [submit[i] for i in order]


def percentiles_ms(samples: list[float]) -> dict[str, float | None]:
    if not samples:  # output_len 1 has no TPOT
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(np.asarray(samples) * 1e3, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}


def summarize_level(prompts: list[list[int]], runs: list[dict], concurrency: int) -> dict:
    """Median throughput over repeats; latency percentiles over every request of every repeat."""
    tok_per_s = [r["tokens"] / r["wall"] for r in runs]
    return {
        "concurrency": concurrency,
        "num_requests": len(prompts),
        "mean_prompt_len": statistics.fmean(len(p) for p in prompts),
        "output_tokens": runs[0]["tokens"],
        "wall_s": [r["wall"] for r in runs],
        "output_tokens_per_s_runs": tok_per_s,
        "output_tokens_per_s": statistics.median(tok_per_s),
        "requests_per_s": statistics.median(len(prompts) / r["wall"] for r in runs),
        "ttft_ms": percentiles_ms([t for r in runs for t in r["ttft"]]),
        "tpot_ms": percentiles_ms([t for r in runs for t in r["tpot"]]),
        "num_preemptions": sum(r["preemptions"] for r in runs),
        # per repeat, the GPU's clocks before and after it (None where nvidia-smi cannot say)
        "gpu_state_runs": [r.get("gpu_state") for r in runs],
    }


def _spec_delta(before: dict, after: dict) -> dict:
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    d = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    d["mean_acceptance_length"] = (
        1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None
    )
    windows = after.get("num_survival_windows", 0) - before.get("num_survival_windows", 0)
    if windows:  # calibration at this level: mean predicted vs realised survival per position
        for key in ("predicted_survival_per_pos", "realised_survival_per_pos"):
            b = before.get(key) or [0] * len(after[key])
            d[key.replace("_per_pos", "_mean")] = [
                (x - y) / windows for x, y in zip(after[key], b, strict=True)
            ]
        d["num_survival_windows"] = windows
    d["scheduling"] = after.get("scheduling")  # policy or fixed K, and why
    # the policy's state at the end of the level: its survival corrections and each cell's
    # realised / table step-time ratio ("G=64 V=512 greedy": 1.4)
    for key in ("survival_correction", "survival_persistence", "realised_cost_ratios"):
        if key in after:
            d[key] = after[key]
    for key in ("steps", "fallbacks"):  # this level's steps by path, eager ones by reason
        b, a = before.get(key, {}), after.get(key, {})
        d[key] = {k: a[k] - b.get(k, 0) for k in a if a[k] - b.get(k, 0)}
    if "async_spec_steps" in after:  # drafting steps launched ahead, and why others were not
        b, a = before.get("async_spec_steps", {}), after["async_spec_steps"]
        not_before = b.get("not_ahead", {})
        not_ahead = {k: n - not_before.get(k, 0) for k, n in a["not_ahead"].items()}
        d["async_spec_steps"] = {
            "launched_ahead": a["launched_ahead"] - b.get("launched_ahead", 0),
            "not_ahead": {k: n for k, n in not_ahead.items() if n},
        }
    if "drafting_policy" in after:  # steps with and without drafting at this level
        b, a = before.get("drafting_policy", {}), after["drafting_policy"]
        d["drafting_policy"] = {k: a[k] - b.get(k, 0) for k in a if a[k] - b.get(k, 0)}
    return d


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


def run_level(
    llms: dict, prompts: list[list[int]], config: BenchConfig, sweep_start: float,
    concurrency: int | None = None,  # requests in flight at most (None: all the prompts)
) -> dict[str, dict]:  # fmt: skip
    """One level on every arm: each repeat runs every arm once, in arm order, so drift on a shared
    host hits all arms alike. With --arms each level records when its runs began ("start_s",
    seconds since the first level began): the interleaving, and any drift, in the data."""
    before = {name: llm.get_metrics() for name, llm in llms.items()}
    runs = {name: [] for name in llms}
    lengths = output_lengths(len(prompts), config.output_len, config.output_len_spread,
                             config.seed)  # fmt: skip
    for _ in range(config.repeats):
        for name, llm in llms.items():
            device = llm.engine.device
            before_run = read_gpu_state(device)  # clocks and heat, outside the timed window
            run = run_dspark_once(llm, prompts, lengths, concurrency, config.temperature)
            run["gpu_state"] = {"before": before_run, "after": read_gpu_state(device)}
            held = held_down(before_run, run["gpu_state"]["after"])
            if held:  # a repeat that ran on held-down clocks reads slow: say so beside it
                print(
                    f"{name} C={concurrency or len(prompts)} repeat {len(runs[name])}: the "
                    f"GPU's clocks were held down ({', '.join(held)})",
                    file=sys.stderr,
                )
            runs[name].append(run)
    levels = {}
    c = concurrency or len(prompts)
    for name, llm in llms.items():
        level = summarize_level(prompts, runs[name], c)
        if config.arms is not None:
            level["start_s"] = [r["start"] - sweep_start for r in runs[name]]
        if before[name]:  # speculation: this level's drafts and acceptance
            level["speculation"] = _spec_delta(before[name], llm.get_metrics())
        tok_s = level["output_tokens_per_s"]
        print(f"{name} C={c}: {tok_s:.1f} output tok/s", file=sys.stderr, flush=True)
        levels[name] = level
    return levels


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
    llms = build_llms(config, results) if config.use_dspark else {}
    tokenizer = (
        next(iter(llms.values())).get_tokenizer()
        if llms
        else load_tokenizer(resolve_model(config.model))
    )
    most = max(config.concurrency) * config.waves
    full = [tokenizer.apply_chat_template(c) for c in cycle(conversations, most)]
    prompt_ids = [truncate(ids, config.max_prompt_len) for ids in full]
    results["prompts"]["num_truncated"] = sum(len(ids) > config.max_prompt_len for ids in full)
    batches = {c: prompt_ids[: c * config.waves] for c in config.concurrency}
    if llms:
        # the warm-up takes the list's last prompts, so it never pre-runs a measured one
        warmup = render(tokenizer, conversations[-WARMUP_REQUESTS:], config.max_prompt_len)
        record_arms(results, config, run_arms_sweep(llms, config, batches, warmup))
        del llms  # the peer gets the whole device
        release_memory()
    if config.use_hf:
        results["hf"] = run_hf(config, tokenizer, batches, dtype, device)
    results["ratios"] = ratios(config.concurrency, results["dspark"], results["hf"])
    write_results(results, config.out, config.plot)
    print(format_table(results))
    if len(results.get("arms") or {}) > 1:
        print(format_arms_table(results))
    return results


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
        "concurrency": list(config.concurrency),
        "sources": list(config.sources),
        "seed": config.seed,
        "prompt_split": config.prompt_split,
        "engine": None,
        "dspark": None,
        "hf": None,
    }


def build_llms(config: BenchConfig, results: dict) -> dict:
    """One LLM per arm, same engine kwargs but its own speculative_config; results["engine"]
    records the kwargs they share (with --arms each arm's speculative_config is in its entry)."""
    from dspark.llm import LLM

    kwargs = engine_kwargs(config)
    llms = {}
    for name, arm in config.arm_configs().items():
        spec, engine = split_arm(arm)
        llms[name] = LLM(**kwargs | engine | {"speculative_config": spec})
    max_model_len = min(llm.engine.max_model_len for llm in llms.values())
    check_lengths(config, max_model_len)
    shared = {k: v for k, v in kwargs.items() if k not in ("model", "dtype", "device")}
    if config.arms is not None:
        del shared["speculative_config"]
    results["engine"] = shared | {"max_model_len": max_model_len}
    return llms


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


# ---- the command ------------------------------------------------------------------------------


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `dspark bench` on the CLI's subparsers."""
    p = subparsers.add_parser("bench", help="offline throughput/latency sweep, optionally vs HF")
    p.add_argument("--model", default="default", help="'default', a .gguf file or a HF directory")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='JSON, e.g. \'{"method": "dspark", "model": "path/to/drafter"}\'',
    )
    p.add_argument(
        "--arms",
        default=None,
        help="JSON object: arm name -> a --speculative-config object, or null for plain "
        "decoding; the arms run interleaved (each level, each repeat, every arm in turn) in one "
        "invocation, so their ratios carry no drift, e.g. "
        '\'{"plain": null, "k3": {"method": "dspark", "num_speculative_tokens": 3}}\'. '
        "All arms' engines are resident at once; not with --speculative-config",
    )
    p.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="default: enough pages for the largest level at full length",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help="comma-separated levels")
    p.add_argument("--output-len", type=int, default=256, help="tokens per request (ignore_eos)")
    p.add_argument("--max-prompt-len", type=int, default=512, help="longer prompts are cut")
    p.add_argument("--repeats", type=int, default=1, help="runs per level; median reported")
    p.add_argument(
        "--waves",
        type=int,
        default=1,
        help="requests per level in units of C: 1 submits C at once; W > 1 runs W * C with at "
        "most C in flight (a closed loop, the tail of one wave no longer sets the wall time)",
    )
    p.add_argument(
        "--output-len-spread",
        type=float,
        default=0.0,
        help="S in [0, 1): request lengths uniform in output_len * [1 - S, 1 + S], seeded, the "
        "same for every arm (with --waves, requests then end at different steps, as in a server)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy (the default); T > 0 samples at T, request i seeded with i",
    )
    p.add_argument(
        "--prompts-dir", type=Path, default=None, help="default: ../shared/data beside the repo"
    )
    p.add_argument("--sources", default=",".join(SOURCES), help="comma-separated prompt sources")
    p.add_argument("--seed", type=int, default=0, help="prompt shuffle seed")
    p.add_argument(
        "--prompt-split",
        default="eval",
        choices=PROMPT_SPLITS,
        help="eval: only prompts held out of drafter training (default); all: every prompt",
    )
    p.add_argument("--hf-peer", action="store_true", help="also run transformers generate")
    p.add_argument("--hf-only", action="store_true", help="run only the transformers peer")
    p.add_argument("--hf-max-concurrency", type=int, default=64)
    p.add_argument("--hf-cache", default="static", choices=CACHE_IMPLEMENTATIONS)
    p.add_argument("--out", type=Path, default=Path("bench_results.json"))
    p.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--plot-from",
        type=Path,
        default=None,
        help="only redraw the plot from an earlier results JSON",
    )
    p.set_defaults(func=cmd_bench)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    plot = None if args.no_plot else (args.plot or args.out.with_suffix(".png"))
    return BenchConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        speculative_config=args.speculative_config,
        arms=parse_arms(args.arms),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        concurrency=parse_concurrency(args.concurrency),
        output_len=args.output_len,
        max_prompt_len=args.max_prompt_len,
        repeats=args.repeats,
        waves=args.waves,
        output_len_spread=args.output_len_spread,
        temperature=args.temperature,
        prompts_dir=args.prompts_dir,
        sources=parse_sources(args.sources),
        seed=args.seed,
        prompt_split=args.prompt_split,
        use_dspark=not args.hf_only,
        use_hf=args.hf_peer or args.hf_only,
        hf_max_concurrency=args.hf_max_concurrency,
        hf_cache=args.hf_cache,
        out=args.out,
        plot=plot,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    if args.plot_from is not None:
        from dspark.benchmarks.plot import plot_results

        png = args.plot or args.plot_from.with_suffix(".png")
        plot_results(args.plot_from, png)
        print(f"wrote {png}", file=sys.stderr)
        return 0
    arguments = {k: v for k, v in vars(args).items() if k != "func"}
    run_offline_bench(config_from_args(args), shlex.join(sys.argv), arguments)
    return 0
