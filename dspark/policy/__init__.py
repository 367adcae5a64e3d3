"""The drafting policy: the host-side confidence scheduler (docs/SPECULATION.md, the policy).

Pure host code, below the engine and beside the device half of speculation (dspark/spec/): it
imports nothing of the engine, the runner or the models.

  cost_table.py      the measured whole-step seconds per cell (G, V), authenticated by fingerprint
  cells.py           the cell geometry that pricing, allocation and execution share; the choice
  survival.py        calibrated survivals and each running request's lagged estimate
  realised_costs.py  the table's prices scaled by the step times the engine realises
  policy.py          DraftingPolicy: decide() per step, composed of the three above
  tuning.py          the policy's constants (PolicyTuning), one place
  trace.py           DSPARK_POLICY_TRACE: one JSON line per decision
  planner.py         Algorithm 1 with early stop, the reference the tests hold the choice to
"""
