"""A trimmed cell (G, V): a step of G windows staged K + 1 wide, cut on the device to a ragged
verify batch of V target tokens after drafting (docs/SPECULATION.md 5.3, 8.3).

The host stages every window at full width, exactly as for the fixed-K graph (so continuation
anchors, pad rows and short windows need nothing new), and picks only the cell: its budget of
D = V - G drafts, from survivals at least one step old. Inside the step the block is drafted
over the cell's reach only (policy/cells.py cell_reach: no row verifies a slot past it, so the
LM, Markov and confidence heads skip those slots), its drafts scattered into the full-width
inputs (the anchor in the slots past the reach), then:

  1. the D candidates of highest fresh survival (selector.select_verify_lengths, over
     SpecDecoder.calibrated_survival) under each row's cap (the host's verify_len: shortened
     windows, empty windows and pad rows cap lower, pad rows at 0; and the reach), giving each
     row its verify length;
  2. compact_windows: the full-width inputs are rewritten in place as the ragged layout of
     those windows, V tokens in all, with their cu_num_tokens and seq_lens.

Then the target runs over V tokens instead of G (K + 1), and verification reads the windows by
the new cu_num_tokens. No host sync and no data-dependent shape: V is the cell's.

Worked example, K = 3 (width 4), G = 3 rows of which row 2 is a pad row, V = 7 (D = 4):

  full-width tokens:  [a0 x x x | a1 y y y | p . . .]     anchors at positions 9, 4, 0
  verify cap:         [3, 3, 0]
  fresh survivals:    a0: [.9 .8 .1]   a1: [.7 .6 .5]   pad: (capped)
  chosen (D = 4):     (0,1) .9  (0,2) .8  (1,1) .7  (1,2) .6   -> verify_len [2, 2, 0]
  windows:            [3, 3, 1]       cu_num_tokens [0, 3, 6, 7]
  source token:       [0 1 2 | 4 5 6 | 8]                 row * width + offset in window
  positions:          [9 10 11 | 4 5 6 | 0]
  seq_lens:           [13, 8, 4] -> [12, 7, 1]            each minus (width - window)

When the rows' caps hold fewer than D candidates (windows shortened near max_tokens, pad rows,
a G padded past its live rows), every candidate is chosen and the tokens past the last window
belong to no row: their KV goes to the scratch page and no row reads their logits. Such a step
still verifies what the full block would, in V tokens instead of G (K + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.spec.layout import window_tokens
from dspark.step_plan import PAD_SLOT, PAD_TOKEN_ID


@dataclass(frozen=True)
class FullWidthWindows:
    """The target's inputs of a step of G windows staged `width` tokens wide: views of the
    persistent buffers (input ids, positions and slots [G width]; cu_num_tokens [G + 1];
    seq_lens [G]), rewritten in place by compact_windows."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_num_tokens: torch.Tensor
    seq_lens: torch.Tensor
    width: int


@dataclass(frozen=True)
class TrimmedCell:
    """What a step needs to run as the trimmed cell (G, V)."""

    num_tokens: int  # V
    windows: FullWidthWindows
    reach: int  # no row verifies more drafts: the drafter's heads run over these slots only


def compact_windows(
    windows: FullWidthWindows,
    verify_len: torch.Tensor,  # [G]
    num_tokens: int,  # V
) -> torch.Tensor:  # [G + 1] int64 cu_num_tokens of the ragged layout
    """Rewrite the full-width inputs as the ragged layout of 1 + verify_len tokens per row
    (module docstring's example). Every source token sits at or after its destination, and the
    gathers complete before the writes."""
    w = window_tokens(verify_len, num_tokens)
    src = w.row * windows.width + w.offset  # [V] index in the full-width layout
    ids = torch.where(w.is_live, windows.input_ids[src], PAD_TOKEN_ID)
    positions = torch.where(w.is_live, windows.positions[src], 0)
    slots = torch.where(w.is_live, windows.slot_mapping[src], PAD_SLOT)
    windows.input_ids[:num_tokens] = ids
    windows.positions[:num_tokens] = positions
    windows.slot_mapping[:num_tokens] = slots
    windows.cu_num_tokens.copy_(w.cu_num_tokens.to(windows.cu_num_tokens.dtype))
    shorter = windows.width - 1 - verify_len  # [G] tokens each window lost
    windows.seq_lens.sub_(shorter.to(windows.seq_lens.dtype))
    return w.cu_num_tokens
