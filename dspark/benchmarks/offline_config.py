"""`dspark bench`'s options: BenchConfig (validated once), its arms, and the parsing of --arms and
--concurrency.

An arm's "engine" object sets its own engine options (ARM_ENGINE_OPTIONS: the scheduling and
graph switches, max_num_batched_tokens, mixed_prefill_tokens); every other
engine option is shared. `{"engine": {"mixed_prefill_tokens": 256}}` is plain decoding with
mixed decode graphs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from dspark.benchmarks.hf_peer import CACHE_IMPLEMENTATIONS
from dspark.benchmarks.prompts import SOURCES
from dspark.spec.config import SpecConfig
from dspark.spec.synthetic import SyntheticAcceptance


@dataclass(frozen=True)
class BenchConfig:
    model: str = "default"
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_memory_gb: float | None = None  # None: pages for the largest level, no preemption
    max_num_batched_tokens: int | None = None  # None: the engine default, at least max C
    max_model_len: int | None = None
    tensor_parallel_size: int = 1  # ranks the engine shards the model over
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
    # at least this many requests per level, still at most C in flight (a closed loop where it
    # is more than W * C): a low level then does enough work to time (at C = 1 with 4 waves,
    # 4 requests spread the issue-6 sweep's repeats by 0.84-1.09x)
    min_requests: int = 1
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
    # drafts kept by this profile, not the target (spec/synthetic.py: a named profile or
    # comma-separated conditional rates); every result says so. None: real acceptance
    synthetic_acceptance: str | None = None
    synthetic_seed: int = 0

    def __post_init__(self) -> None:
        for name in ("output_len", "max_prompt_len", "repeats", "hf_max_concurrency", "waves",
                     "min_requests"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.tensor_parallel_size > 1 and self.arms is not None and len(self.arms) > 1:
            raise ValueError(
                f"--arms keeps every arm's engine resident, and a process holds one "
                f"tensor-parallel group: run each arm alone with tensor_parallel_size "
                f"{self.tensor_parallel_size}"
            )
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
        if self.min_requests > min(self.concurrency) * self.waves and self.use_hf:
            raise ValueError(
                f"--min-requests {self.min_requests} runs a closed loop at the levels below it, "
                "the HF peer static batches of C: run the peer without it"
            )
        if self.synthetic_acceptance is not None:
            SyntheticAcceptance.parse(self.synthetic_acceptance)  # (a bad profile fails here)
            if self.use_hf:
                raise ValueError("--synthetic-acceptance applies to dspark's arms: run the HF "
                                 "peer without it")  # fmt: skip
        if self.arms is not None and not self.use_dspark:
            raise ValueError("--arms are dspark engines: they cannot run with --hf-only")

    def num_requests(self, concurrency: int) -> int:
        """A level's requests: W C (--waves), at least min_requests."""
        return max(concurrency * self.waves, self.min_requests)

    @property
    def max_output_len(self) -> int:
        """The longest a request's output can be (output_lengths)."""
        return math.ceil(self.output_len * (1 + self.output_len_spread))

    def synthetic(self) -> SyntheticAcceptance | None:
        """The synthetic acceptance the arms run under, None for real acceptance."""
        if self.synthetic_acceptance is None:
            return None
        return SyntheticAcceptance.parse(self.synthetic_acceptance, self.synthetic_seed)

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
        "use_cuda_graphs",
        "max_num_batched_tokens",
        "mixed_prefill_tokens",
        "enable_prefix_caching",
    }
)


def split_arm(arm: dict | None) -> tuple[dict | None, dict]:
    """An arm's (speculative_config or None, engine options): {"engine": {...}} is its own
    engine options (ARM_ENGINE_OPTIONS: the scheduling and graph switches, the step's token
    budget), the other keys its speculative_config (none: plain decoding).

      {"method": "dspark", "engine": {"async_scheduling": false}}
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
