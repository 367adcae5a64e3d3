"""What the engine tests of the policy share."""

from __future__ import annotations

import math
from dataclasses import replace

from dspark import LLM
from dspark.policy.realised_costs import RealisedCosts
from dspark.policy.tuning import TUNING


def by_table(llm: LLM, **tuning) -> LLM:
    """The engine's policy priced by the test's table alone (no realised step cost ever counts:
    the CPU's step times, which vary with the machine's load, would otherwise move the choices
    the test asserts), with other choice constants (dwell_steps, min_gain) where given."""
    policy = llm.engine.policy
    policy.tuning = replace(TUNING, min_price_steps=math.inf, **tuning)
    policy.realised_costs = RealisedCosts(policy.tuning)
    return llm
