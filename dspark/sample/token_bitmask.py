"""Allowed-token bitmasks applied to logits on the device (structured output).

A bitmask row holds one bit per token, 32 to an int32 word: token t is allowed iff bit t % 32 of
word t // 32 is set (llguidance's layout; the host fills them: dspark/structured/masks.py). A
logits row i is masked by bitmask row index[i], or left as it is where index[i] is -1: tokens
not allowed become -inf, before any other shaping (sample/logits_shaping.py), temperature,
min_p, top-k or top-p, so that those only ever choose among allowed tokens. (-inf survives every
shaping step: a bias or penalty moves a finite logit, and -inf times a positive factor is -inf.)

  V = 5, bitmask [[0b00101], [0b11000]], index [1, -1, 0]:
    row 0: tokens 3, 4 allowed          [-inf, -inf, -inf, l03, l04]
    row 1: unmasked                     [l10, l11, l12, l13, l14]
    row 2: tokens 0, 2 allowed          [l20, -inf, l22, -inf, -inf]

A window's masks are one per (row, window position): bitmask [M, P, W] flattened to [M P, W],
and window token t of grammar slot s at offset j reads row s P + j (`window_index`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class WindowMasks:
    """The masks of one speculative step's window positions, on the device."""

    bitmask: torch.Tensor  # [M, P, W] int32: grammar slot s, window position j (P = K + 1)
    slot: torch.Tensor  # [R] int64: each window row's grammar slot, -1 for a row without one


class WindowGrammar(Protocol):
    """A speculative step's grammar rows, as SpecDecoder sees them: after drafting it hands
    over the drafts (the runner's implementation, which fills the masks they imply before
    verification: runner/grammar_masks.py)."""

    def copy_drafts(self, drafts: torch.Tensor) -> None:  # [R, K] on the device
        """Queue the drafts' copy to the host (before the target forward is queued)."""
        ...


def disallowed_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [N, V] bool
    """Unpack bitmask rows [N, W] int32 into one bool a token, True where it is not allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=words.device)
    clear = ((words[:, :, None] >> bits) & 1) == 0  # [N, W, 32] (>> is arithmetic: & 1 the bit)
    return clear.reshape(words.shape[0], -1)[:, :vocab_size]


def apply_token_bitmask(
    logits: torch.Tensor,  # [N, V]
    bitmask: torch.Tensor,  # [M, W] int32
    index: torch.Tensor,  # [N] int64: the bitmask row of each logits row, -1: none
) -> torch.Tensor:  # [N, V] a new tensor (logits stay as they are: logprobs read them raw)
    """Disallowed tokens -inf (module docstring)."""
    off = disallowed_tokens(bitmask[index.clamp(min=0)], logits.shape[-1])  # [N, V]
    return logits.masked_fill(off & (index >= 0)[:, None], float("-inf"))


def window_index(
    masks: WindowMasks,
    owner: torch.Tensor,  # [T] the window row of each window token
    offset: torch.Tensor,  # [T] its position in the window (0: the anchor)
) -> torch.Tensor:  # [T] its row of masks.bitmask flattened to [M P, W], -1: none
    """Window token t reads row slot[owner[t]] P + offset[t]:

    slot [-1, 0], P = 3, owner [0, 0, 1, 1, 1], offset [0, 1, 0, 1, 2] -> [-1, -1, 0, 1, 2]
    """
    width = masks.bitmask.shape[1]
    slot = masks.slot[owner]
    return torch.where(slot >= 0, slot * width + offset.clamp(max=width - 1), -1)
