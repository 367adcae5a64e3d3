"""The allowed-token bitmasks of a step, filled on the host from the rows' matchers.

A bitmask row has one bit per token, 32 to an int32 word (llguidance's layout: token t is bit
t % 32 of word t // 32; dspark/sample/token_bitmask.py applies it on the device):

  V = 40, allowed {1, 33}:  words [0b10 (= 2), 0b10 (= 2)]   (W = ceil(V / 32) = 2)

A plain row needs the mask after its outputs: `anchor_bitmasks`. A window [anchor, x_1 .. x_l]
needs one per window position j = 0..l, the mask after the outputs and drafts x_1 .. x_j (window
token j's logits give the distribution of the token after x_j): `window_bitmasks`. llguidance
consumes the drafts on the matcher, fills each mask and rolls the drafts back, so the request's
state is untouched. A draft the grammar does not allow stops it there: the masks after it are
left all-allowed, and are never used, since verification rejects that draft (its target
probability is 0) and no later position of the window can emit:

  regex [0-9]+, anchor state after "4", drafts ["2", "x", "7"] (l = 3):
    position 0: digits (and EOS)   judges "2"            -> "2" may be accepted
    position 1: digits (and EOS)   judges "x"            -> "x" rejected: p'("x") = 0
    position 2: all (unused)       judges "7"            (after a rejection: never read)
    position 3: all (unused)       the bonus after "7"   (never reached)

The host's cost per mask is measured (`bench/structured_output.py`, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import time
from collections import Counter

import llguidance
import numpy as np

from dspark.structured.matcher import GrammarMatcher

ALL_ALLOWED = -1  # an int32 word of 32 set bits


def words_for(vocab_size: int) -> int:
    """int32 words of one token bitmask: words_for(49152) == 1536, words_for(40) == 2."""
    return -(-vocab_size // 32)


class BitmaskFiller:
    """Fills a step's bitmasks through llguidance's executor (its threads, the GIL dropped),
    created on first use: a runner that never meets a grammar starts none."""

    def __init__(self, vocab_size: int) -> None:
        self.words = words_for(vocab_size)
        self._executor: llguidance.LLExecutor | None = None
        # masks filled, host seconds spent filling them (per-step cost: docs/PERFORMANCE.md)
        self.stats: Counter[str] = Counter()
        self.fill_s = 0.0

    @property
    def executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor

    def anchor_bitmasks(self, matchers: list[GrammarMatcher]) -> np.ndarray:  # [M, W] int32
        """The mask of each row's next token, after its outputs."""
        out = np.full((len(matchers), self.words), ALL_ALLOWED, dtype=np.int32)
        start = time.perf_counter()
        self.executor.unsafe_compute_mask_ptr(
            [(m.ll, i) for i, m in enumerate(matchers)], out.ctypes.data, self.words * 4,
            len(matchers),
        )  # fmt: skip
        self.fill_s += time.perf_counter() - start
        self.stats["masks"] += len(matchers)
        return out

    def window_bitmasks(
        self,
        matchers: list[GrammarMatcher],
        drafts: list[list[int]],  # each row's drafts x_1 .. x_l (l its verify length, <= K)
        width: int,  # K + 1 positions per row in the result
    ) -> np.ndarray:  # [M, K + 1, W] int32: row i's position j after its drafts x_1 .. x_j
        """The mask at each window position (module docstring); positions past a row's
        drafts, and after a draft the grammar rejects, are all-allowed (never read)."""
        m = len(matchers)
        out = np.full((m, width, self.words), ALL_ALLOWED, dtype=np.int32)
        start = time.perf_counter()
        # (llguidance takes no empty draft list: a window of verify length 0, a request's last
        # token, needs only its anchor's mask)
        windows = [(g.ll, i * width, d) for i, (g, d) in
                   enumerate(zip(matchers, drafts, strict=True)) if d]  # fmt: skip
        if windows:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(
                windows, out.ctypes.data, self.words * 4, m * width
            )  # fmt: skip
        if len(windows) < m:
            anchors = [(g.ll, i * width) for i, (g, d) in
                       enumerate(zip(matchers, drafts, strict=True)) if not d]  # fmt: skip
            self.executor.unsafe_compute_mask_ptr(anchors, out.ctypes.data, self.words * 4,
                                                  m * width)  # fmt: skip
        self.fill_s += time.perf_counter() - start
        self.stats["masks"] += sum(1 + len(d) for d in drafts)
        return out
