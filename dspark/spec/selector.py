"""The device half of a step's cell: which drafted positions fill the budget the host chose
(dspark/policy/cells.py), ranked by the step's fresh survivals, without a host sync.
"""

from __future__ import annotations

import torch


def select_verify_lengths(
    a: torch.Tensor,  # [R, K] fresh survivals, non-increasing along each row
    num_drafts: int,  # D, the cell's budget
    cap: torch.Tensor | None = None,  # [R] at most this many per row (None: K)
) -> torch.Tensor:  # [R] verify lengths
    """On the device, no host sync: the D candidates (r, j) of highest fresh survival, ties by
    position then row, as verify lengths [R] (a prefix of each row, since a is non-increasing).
    Candidates past a row's cap (a window shortened near max_tokens, an empty window, a pad
    row: all known on the host before drafting) are never chosen.

      a = [[0.9, 0.5], [0.9, 0.2]], D = 3 -> candidates (0,1) (1,1) (0,2) -> lengths [2, 1]
      the same with cap [1, 2]           -> candidates (0,1) (1,1) (1,2) -> lengths [1, 2]

    Why this is lossless (docs/SPECULATION.md, the scheduler): a[r, k+1] depends on draft
    x[r, k], but it is at most a[r, k] and ranks after it on a tie (position ascending), so
    whether (r, k) is among the D best is decided by candidates that do not depend on x[r, k];
    D itself was fixed before these drafts existed.
    """
    num_rows, k = a.shape
    if cap is not None:  # (below every survival: ranked last, and never chosen)
        a = torch.where(torch.arange(k, device=a.device)[None, :] < cap[:, None], a, -1.0)
    # flatten position-major, so a stable sort on survival alone leaves ties by (j, r)
    flat = a.t().reshape(-1)  # index i = j * R + r
    order = torch.sort(flat, descending=True, stable=True).indices
    # (index_fill_ with a Python scalar: no host tensor to copy inside a captured graph)
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen.index_fill_(0, order[: min(num_drafts, flat.numel())], True)
    chosen &= flat >= 0
    return chosen.view(k, num_rows).sum(dim=0)
