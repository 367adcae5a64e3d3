"""Training a DSpark drafter for a target: regenerate -> train -> calibrate -> evaluate.

See docs/TRAINING.md and `dspark train --help`.
"""
