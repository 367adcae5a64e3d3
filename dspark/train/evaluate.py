"""The evaluate stage: acceptance with full-block verification (K = 7) on the held-out slices.

For each sampling temperature (0 and 1) and each prompt source, the held-out eval prompts are
answered through the engine's speculative path (`LLM(speculative_config=...)`, every window
verifying all K drafts) and read from the engine's counters (`LLM.get_metrics()`, vLLM's
definitions), as the difference before and after the source's run:
  tau          = 1 + accepted / drafts: tokens per verify step per request, bonus included
  acceptance_k = accepted at position k / accepted at position k - 1 (drafts for k = 1): the
                 conditional acceptance of draft k given drafts 1..k-1 were accepted
Windows shortened near max_tokens (fewer than K drafts) count as drafts, as in vLLM; with
max_tokens 256 they are about 1% of them.

With a confidence head, the same runs are recorded (rollouts.py) and the ECE per position of
the survivals is reported raw and with the drafter's calibration.json, on these unseen prompts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from dspark.llm import LLM
from dspark.train.calibrate import ece_per_position, load_calibration
from dspark.train.rollouts import (
    ConfidenceRecorder,
    record_confidences,
    require_full_blocks,
    rollout,
)

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass(frozen=True)
class EvalConfig:
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_tokens: int = 256
    prompts_per_source: int = 64  # at most; small sources have fewer held-out prompts
    seed: int = 0


def acceptance_from_metrics(before: dict, after: dict) -> dict:
    """tau and per-position conditional acceptance from two snapshots of get_metrics()."""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    per_pos_before = before.get("num_accepted_tokens_per_pos") or []
    per_pos = [
        a - (per_pos_before[k] if k < len(per_pos_before) else 0)
        for k, a in enumerate(after.get("num_accepted_tokens_per_pos", []))
    ]
    drafts = delta["num_drafts"]
    reached = [drafts, *per_pos[:-1]]  # windows whose drafts 1..k-1 were all accepted
    return {
        **delta,
        "tau": 1 + delta["num_accepted_tokens"] / drafts if drafts else float("nan"),
        "num_accepted_tokens_per_pos": per_pos,
        "acceptance_per_pos": [
            a / r if r else float("nan") for a, r in zip(per_pos, reached, strict=True)
        ],
    }


def evaluate_drafter(
    llm: LLM, texts: dict[str, list[str]], config: EvalConfig, drafter_dir: str | None = None,
    progress: bool = True,
) -> dict:  # fmt: skip
    """{"T=<t>": {source: acceptance, "macro_tau": mean over sources, "ece": ...}}."""
    spec = require_full_blocks(llm, "evaluate")
    has_conf = spec.drafter.confidence is not None
    results: dict[str, dict] = {}
    for temperature in config.temperatures:
        temps = _calibration_for(drafter_dir, spec.draft_len, temperature) if has_conf else None
        per_source: dict = {}
        recording = record_confidences(llm) if has_conf else contextlib.nullcontext()
        with recording as recorder:
            for source, rows in texts.items():
                rows = rows[: config.prompts_per_source]
                if not rows:
                    continue
                before = llm.get_metrics()
                outputs = rollout(llm, rows, temperature, config.max_tokens, config.seed, progress)
                acc = acceptance_from_metrics(before, llm.get_metrics())
                acc["num_prompts"] = len(rows)
                acc["num_output_tokens"] = sum(len(o.outputs[0].token_ids) for o in outputs)
                per_source[source] = acc
        taus = [a["tau"] for a in per_source.values()]
        per_source["macro_tau"] = sum(taus) / len(taus) if taus else float("nan")
        if recorder is not None:
            per_source["ece"] = _ece(recorder, temps)
        results[f"T={temperature:g}"] = per_source
    return results


def _calibration_for(drafter_dir: str | None, draft_len: int, temperature: float):
    """The temperatures the engine applies at this sampling temperature: the greedy fit for
    greedy requests when the file has one (their acceptance rule differs), else the sampled fit."""
    if not drafter_dir:
        return None
    greedy = load_calibration(drafter_dir, draft_len, greedy=True) if temperature == 0 else None
    return greedy or load_calibration(drafter_dir, draft_len)


def _ece(recorder: ConfidenceRecorder, temperatures: list[float] | None) -> dict:
    logits, labels = recorder.blocks()
    if logits.shape[0] == 0:
        return {"num_blocks": 0}
    out = {"num_blocks": int(logits.shape[0]),
           "raw": ece_per_position(logits, labels, [1.0] * logits.shape[1])}  # fmt: skip
    if temperatures is not None:
        out["calibrated"] = ece_per_position(logits, labels, temperatures)
    return out


def format_results(results: dict) -> str:
    """A table: one row per (temperature, source) with tau and acceptance per position."""
    lines = []
    for temp, per_source in results.items():
        lines.append(f"{temp}: macro tau {per_source['macro_tau']:.3f}")
        for source, acc in per_source.items():
            if source in ("macro_tau", "ece"):
                continue
            cond = " ".join(f"{a:.2f}" for a in acc["acceptance_per_pos"])
            lines.append(
                f"  {source:<10} tau {acc['tau']:.3f}  acceptance per position [{cond}]  "
                f"({acc['num_prompts']} prompts, {acc['num_drafts']} verify steps)"
            )
        if "ece" in per_source and "raw" in per_source["ece"]:
            ece = per_source["ece"]
            raw = " ".join(f"{100 * e:.1f}" for e in ece["raw"])
            lines.append(f"  ECE % raw        [{raw}]")
            if "calibrated" in ece:
                cal = " ".join(f"{100 * e:.1f}" for e in ece["calibrated"])
                lines.append(f"  ECE % calibrated [{cal}]")
    return "\n".join(lines)


def compare(results: dict, baseline: dict) -> str:
    """tau of this drafter against a baseline's (e.g. DSpark vs the DFlash ablation)."""
    lines = ["tau: this run vs baseline (relative change)"]
    for temp, per_source in results.items():
        if not temp.startswith("T="):
            continue
        base = baseline.get(temp, {})
        for source in [s for s in per_source if s not in ("ece",)]:
            a, b = per_source[source], base.get(source)
            a = a if isinstance(a, float) else a["tau"]
            if b is None:
                continue
            b = b if isinstance(b, float) else b["tau"]
            lines.append(f"  {temp} {source:<10} {a:.3f} vs {b:.3f} ({100 * (a / b - 1):+.1f}%)")
    return "\n".join(lines)
