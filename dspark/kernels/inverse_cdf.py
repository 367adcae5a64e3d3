"""The inverse-CDF draw, in PyTorch: the reference of every sampling kernel's pick
(kernels/markov_sample_triton.py) and the draw of the PyTorch sampling paths
(sample/sampler.py, spec/drafting.py, spec/verifier.py).
"""

from __future__ import annotations

import torch


def inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A draw from each row of p [R, V] with one uniform u [R, 1] per row: the first index whose
    cumulative mass exceeds u * total. Tokens of zero probability are never drawn (a run of
    equal cumulative values is passed over by searchsorted's right side).

      p = [0.2, 0.0, 0.5, 0.3], cdf = [0.2, 0.2, 0.7, 1.0]
      u = 0.1 -> 0    u = 0.2 -> 2    u = 0.65 -> 2    u = 0.95 -> 3

    The sum runs in float64. In float32 a token of probability below half an ulp of the sum
    before it (3e-8 once the sum passes 0.5) would get an interval of 0 or of a whole ulp, and
    over a 49,152-token vocabulary that could move up to ~1e-3 of the mass.
    """
    cdf = p.double().cumsum(dim=-1)  # [R, V]
    target = u.double() * cdf[:, -1:]  # [R, 1]
    index = torch.searchsorted(cdf, target, right=True)[:, 0]
    return index.clamp(max=p.shape[-1] - 1)
