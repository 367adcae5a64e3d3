"""Speculation set-up: the drafter for these weights, the speculative decoder over it, and the
drafting policy with its cost table (the engine builds them once, engine.py).

Without speculation (no speculative_config) the drafter is None, the KV plan has no drafter
layers and one position per row, and there is neither decoder nor policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dspark.config import EngineConfig
from dspark.drafters import SHIPPED, shipped_drafter
from dspark.engine.kv_cache import allocate_kv_caches
from dspark.models.dspark_drafter import DSparkDrafter, drafter_dims
from dspark.models.llama import LlamaForCausalLM
from dspark.models.loader import ModelSource, checkpoint_hash, drafter_directory
from dspark.models.model_config import ModelConfig
from dspark.policy.cost_table import COST_TABLES_DIR, load_cost_table, user_tables_dir
from dspark.policy.policy import DraftingPolicy
from dspark.runner.spec_runner import SpecRunner
from dspark.spec.calibration import CALIBRATION_FILE, load_calibration
from dspark.spec.spec_decoder import SpecDecoder
from dspark.spec.synthetic import SyntheticAcceptance

logger = logging.getLogger(__name__)


def resolve_drafter(config: EngineConfig, source: ModelSource) -> tuple[Path | None, str | None]:
    """The configured drafter's directory and the target's weights hash (both None without
    speculation): speculative_config's "model", else the drafter shipped for these weights."""
    spec = config.spec()
    if spec is None:
        return None, None
    target_hash = checkpoint_hash(source)
    path = drafter_directory(spec.model) if spec.model else shipped_drafter(target_hash)
    if path is None:
        raise ValueError(
            f'speculative_config has no "model" and no drafter ships for {source.path} '
            f"(weights hash {target_hash}; shipped: {sorted(SHIPPED)}): pass the directory "
            'of a DSpark drafter trained for it as "model" (dspark train makes one)'
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a DSpark drafter (no config.json)")
    return path, target_hash


def drafter_layers(drafter_dir: Path | None) -> int:
    """Layers of the drafter (its KV shares the target's pages), 0 without one."""
    return 0 if drafter_dir is None else drafter_dims(drafter_dir)[0]


def verified_positions(drafter_dir: Path | None) -> int:
    """Positions a row's step samples or verifies at most: the drafter's block + 1, else 1."""
    return 1 if drafter_dir is None else drafter_dims(drafter_dir)[1] + 1


def build_spec(
    config: EngineConfig,
    model: LlamaForCausalLM,
    model_config: ModelConfig,
    num_pages: int,  # the KV plan's: the drafter's context cache shares the target's pages
    dtype: torch.dtype,
    device: torch.device,
    path: Path | None,
    target_hash: str | None,
    backend: str,
    synthetic: SyntheticAcceptance | None = None,  # a benchmark's (spec/synthetic.py)
) -> SpecDecoder | None:
    """The speculative decoder over the drafter at `path` (None without one), K checked
    against its draft_len and its confidence calibration loaded."""
    if path is None:
        return None
    spec_config = config.spec()
    drafter = DSparkDrafter.load(path, model, target_hash, backend)
    draft_len = drafter.config.draft_len
    k = spec_config.num_speculative_tokens or draft_len
    if k > draft_len:
        raise ValueError(
            f"num_speculative_tokens {k} exceeds the drafter's draft_len {draft_len} "
            f"({path}); allowed 1..{draft_len}"
        )
    wide = [w for w in spec_config.trimmed_widths if w > k]
    if wide:
        raise ValueError(f"trimmed_widths {wide} exceed num_speculative_tokens {k}: a trimmed "
                         f"cell verifies 2..{k} tokens per row on average")  # fmt: skip
    temperatures = greedy_temperatures = None
    if drafter.config.use_confidence:
        temperatures = load_calibration(path, draft_len)
        greedy_temperatures = load_calibration(path, draft_len, greedy=True)
        if temperatures is None:
            logger.warning("speculation: %s has no %s: its confidences are used "
                           "uncalibrated (T = 1)", path, CALIBRATION_FILE)  # fmt: skip
        elif greedy_temperatures is None:
            logger.info("speculation: %s has no greedy calibration: greedy requests use "
                        "the sampled fit", CALIBRATION_FILE)  # fmt: skip
    kv = allocate_kv_caches(
        model_config, num_pages, config.page_size, dtype, device,
        num_layers=drafter.config.num_layers,
    )  # fmt: skip
    spec = SpecDecoder(drafter, kv, config.page_size, device, num_verify=k,
                       max_rows=config.max_num_seqs,
                       confidence_temperatures=temperatures,
                       greedy_confidence_temperatures=greedy_temperatures,
                       synthetic=synthetic)  # fmt: skip
    if synthetic is not None:
        logger.warning("speculation: SYNTHETIC acceptance %s (expected tau %.2f at K = %d): "
                       "drafts are kept by the profile, not the target; the output is not the "
                       "model's (a benchmark mode)", synthetic.name or list(synthetic.rates),
                       synthetic.expected_tau(k), k)  # fmt: skip
    logger.info("speculation: DSpark drafter %s%s, K = %d verified of %d drafted%s", path,
                "" if spec_config.model else " (shipped for this target)", k, draft_len,
                ", STS-calibrated confidence" if temperatures else "")  # fmt: skip
    return spec


def build_policy(
    config: EngineConfig,
    spec: SpecDecoder | None,
    spec_runner: SpecRunner | None,
    drafter_dir: Path | None,
    fingerprint: Callable[[], dict],  # the live engine's (LLMEngine.cost_fingerprint)
    # the start-up profile: the table's path, or None and why none was measured
    measure: Callable[[], tuple[Path | None, str]] = lambda: (None, "not asked"),
) -> tuple[DraftingPolicy | None, str]:
    """The drafting policy when speculation has a cost table and a confidence head, and how
    the engine decides drafting (for get_metrics() and the bench's arms). With no table for
    this engine, `measure` (engine/startup_profile.py) may measure one. A table that does
    not authenticate fails closed to drafting every step (fixed K), with the reason logged
    and counted."""
    spec_config = config.spec()
    if spec is None or not spec_config.scheduling:
        return None, "fixed K: scheduling off"
    path = spec_config.cost_table or matching_cost_table(drafter_dir, fingerprint)
    if path is None:
        path, why_not = measure()
    if path is None:
        warn_no_cost_table(drafter_dir, fingerprint(), why_not)
        return None, "fixed K: no cost table for this engine's fingerprint"
    if not spec.drafter.config.use_confidence:
        reason = "the drafter has no confidence head"
        table = None
    else:
        table, reason = load_cost_table(path, fingerprint())
    ahead = probe_steps(config, spec_runner)  # 2 where drafting steps launch ahead, else 1
    policy = DraftingPolicy(
        table, spec.survival_temperatures, spec.num_verify,
        probe_steps=ahead,
        decision_lag=ahead,  # (the same cause: a decision reads survivals one block older)
        trimmed_widths=spec_runner.trimmed_widths,
    )  # fmt: skip
    if table is None or policy.table is None:
        reason = reason or "it has no G with both a plain and a full-block cell"
        logger.warning("speculation: cost table %s not used (%s): every step drafts the full "
                       "block (fixed K)", path, reason)  # fmt: skip
        policy.counters[f"cost_table_refused: {reason}"] += 1
        return policy, f"fixed K: cost table {path} refused ({reason})"
    logger.info("speculation: drafting decided per step from cost table %s (G %s)",
                path, policy.sizes)  # fmt: skip
    spec_runner.confidence_sinks.append(_timed_observe(policy))
    return policy, f"drafting policy, cost table {path}"


def _timed_observe(policy: DraftingPolicy) -> Callable[..., None]:
    """policy.observe_survivals, its host time counted in policy.host_time["observe_s"] (the
    bench reports scheduling overhead per step)."""

    def observe(*args, **kwargs) -> None:
        start = time.perf_counter()
        policy.observe_survivals(*args, **kwargs)
        policy.host_time["observe_s"] += time.perf_counter() - start

    return observe


def drafts_async(config: EngineConfig, spec_runner: SpecRunner | None) -> bool:
    """Do drafting steps run asynchronously (engine.py)? With async_scheduling, when windows
    are laid out K + 1 wide (uniform windows: on with speculative graphs), the one layout a step
    launched ahead writes its continuations into."""
    return config.async_scheduling and spec_runner is not None and spec_runner.uniform_windows


def probe_steps(config: EngineConfig, spec_runner: SpecRunner) -> int:
    """The drafting steps a probe of stale survivals runs at least (DraftingPolicy): 2 when
    drafting steps launch ahead of the one in flight (drafts_async), whose survivals the
    second decision cannot yet read; else 1."""
    return 2 if config.async_scheduling and drafts_async(config, spec_runner) else 1


def matching_cost_table(drafter_dir: Path, fingerprint: Callable[[], dict]) -> Path | None:
    """A table measured on an engine like this one (its fingerprint equal to the live one):
    first those shipped in the drafter's cost_tables/, then the user's own (`dspark profile`
    and the start-up profile write there: cost_table.user_tables_dir). None: there is none."""
    live = fingerprint()
    for path in _table_files(drafter_dir):
        if load_cost_table(path, live)[0] is not None:
            return path
    return None


def _table_files(drafter_dir: Path) -> list[Path]:
    directories = (drafter_dir / COST_TABLES_DIR, user_tables_dir())
    return [path for d in directories for path in sorted(d.glob("*.json"))]


def warn_no_cost_table(drafter_dir: Path, live: dict, why_not_measured: str) -> None:
    """Say that every step drafts (fixed K) and how to measure a table: a GPU other than the
    ones the drafter ships tables for would otherwise draft at every load, which at high load
    costs throughput (on an H100 at 256 requests, fixed K = 7 ran 0.62-0.72x plain decoding:
    docs/PERFORMANCE.md)."""
    directories = (drafter_dir / COST_TABLES_DIR, user_tables_dir())
    tables = _table_files(drafter_dir)
    logger.warning("speculation: no cost table for this engine (%d in %s and %s, none with "
                   "its fingerprint, GPU %s; none measured at start-up: %s): every step drafts "
                   "the full block (fixed K), which at high load is slower than plain decoding; "
                   "`dspark profile` (with this model and speculative_config) measures one in "
                   "about a minute and saves it where the engine finds it", len(tables),
                   *directories, live.get("gpu"), why_not_measured)  # fmt: skip
