"""The engine's speculative counters (LLMEngine.get_metrics()): acceptance with vLLM's
definitions, the drafting policy's state, fallbacks by reason, steps by path and the steps
launched ahead (async drafting steps). The server exports them (server/metrics.py), the bench
records their increments per level.
"""

from __future__ import annotations

from collections import Counter

from dspark.engine.scheduler import Scheduler
from dspark.policy.policy import DraftingPolicy
from dspark.spec.spec_decoder import SpecDecoder


def spec_metrics(
    spec: SpecDecoder | None,
    policy: DraftingPolicy | None,
    scheduler: Scheduler,
    stats: Counter,  # the runner's step counters
    scheduling_status: str,
) -> dict:
    """Speculative counters with vLLM's definitions (empty without speculation)."""
    if spec is None:
        return {}
    m = dict(spec.metrics)
    drafts = m.get("num_drafts", 0)
    m["mean_acceptance_length"] = 1 + m.get("num_accepted_tokens", 0) / drafts if drafts else 0
    m["num_accepted_tokens_per_pos"] = spec.accepted_per_position.tolist()
    m["verify_len_counts"] = spec.verify_len_counts.tolist()
    m["predicted_survival_per_pos"] = spec.predicted_survival.tolist()
    m["realised_survival_per_pos"] = spec.realised_survival.tolist()
    m["drafting"] = int(scheduler.drafting)
    m["scheduling"] = scheduling_status
    fallbacks = {k.removeprefix("eager_spec_steps_"): n for k, n in stats.items()
                 if k.startswith("eager_spec_steps_")}  # fmt: skip
    fallbacks.update({k: n for k, n in stats.items() if k.startswith("trimmed_fallback_")})
    if policy is not None:
        m["drafting_policy"] = dict(policy.counters)
        m["survival_correction"] = policy.estimates.correction  # realised / predicted drafts
        m["survival_persistence"] = policy.estimates.persistence  # 1: own estimates in full
        m["realised_cost_ratios"] = policy.realised_costs.as_dict()  # realised / table, a cell
        # the host's scheduling overhead: seconds in decide, observe, the trace; decisions
        m["scheduling_host_time"] = dict(policy.host_time)
        if policy.counters["decision_no_table"]:
            fallbacks["no_cost_table"] = policy.counters["decision_no_table"]
    m["fallbacks"] = fallbacks
    # steps by path: captured speculative (mixed among them), eager speculative, plain
    m["steps"] = {k: stats[k] for k in ("spec_graph_steps", "spec_graph_steps_mixed",
                  "spec_graph_steps_trimmed", "eager_spec_steps", "spec_steps_trimmed_eager",
                  "graph_steps", "eager_steps")}  # fmt: skip
    # plain steps beside them: the eager ones by reason, those that admitted prefills;
    # Triton compiles that steps met (kernels/compile_watch.py)
    prefixes = ("eager_steps_", "mixed_decode_steps", "triton_", "spec_graph_steps_mixed_p")
    m["steps"].update({k: n for k, n in stats.items() if k.startswith(prefixes)})
    m["async_spec_steps"] = {
        "launched_ahead": stats["spec_steps_launched_ahead"],
        "continuation_windows": stats["continuation_windows"],
        # shortened on the device near their requests' ends (runner/continuations.py)
        "continuation_windows_shortened": stats["continuation_windows_shortened"],
        "windows_deferred": scheduler.num_windows_deferred,
        # mixed steps in the pipeline (engine/ahead.py): launched ahead admitting into a mixed
        # step's tail, launched behind a mixed step, first windows put off a step
        "admitting": stats["spec_steps_launched_ahead_admitting"],
        "behind_mixed": stats["spec_steps_launched_behind_mixed"],
        "first_windows_deferred": scheduler.num_first_windows_deferred,
        # drafting steps launched behind a plain step, their anchors fed on the device
        "after_plain": stats["spec_steps_launched_ahead_after_plain"],
        "fed_anchor_windows": stats["fed_anchor_windows"],
        "not_ahead": {k.removeprefix("spec_steps_not_ahead_"): n for k, n in stats.items()
                      if k.startswith("spec_steps_not_ahead_")},
    }  # fmt: skip
    return m
