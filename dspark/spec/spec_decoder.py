"""The speculative half of a step, for the rows that carry a window [anchor, drafts].

Order inside one step (`step()`, the same device-only code eagerly and in a captured graph):
  1. draft():    drafter block forward over [anchor, MASK x (K-1)] for every window row, then the
                 Markov loop; the first verify_len drafts of each row are scattered into the
                 target's input ids on the device (no host sync).
  2. the target forward runs on all rows, returning logits at every window token and the tap
     layers' hidden states
  3. append_context(): the tap features of EVERY token of the step go into the drafter cache at
                 the target's slots. Rows past a window's accepted prefix are stale but harmless:
                 the next block writes exactly those slots before anything reads them.
  4. verify():   target distributions per window token (each token's owner row's sampling
                 parameters), then lossless rejection sampling.

Window rows of a step, worked example (verify_len [2, 1], K = 3, anchors at positions 9, 4):
  target tokens:   [a0 d0 d1 | a1 d0]   at positions [9 10 11 | 4 5]
  drafter block:   rows of K = 3 slots  at positions [9 10 11 | 4 5 6]
  draft scatter:   input_ids[t0 + 1 + k] = drafts[j, k] for k < verify_len[j]

A trimmed cell (G, V) (spec/ragged.py) adds one stage between 1 and 2: the fresh confidences
choose each row's verify length under the cell's budget, and the full-width inputs are
compacted in place to V tokens; 2-4 then run on that ragged layout.

Rows with structured output split the step on the host after 3: `launch()` returns the step
scored but not verified (`Scored`; eagerly, the drafts' copy queued before the target forward:
sample/token_bitmask.py's WindowGrammar), and `verify_scored()` runs 4 once the host has filled
each grammar row's mask at every window position from the drafts (runner/grammar_masks.py,
docs/SPECULATION.md 4.9); verification masks the target's logits by them. A captured step keeps
its Scored half, so that a step with grammar rows can replay the graph and verify again.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from dspark.models.dspark_drafter import DSparkDrafter
from dspark.policy.survival import survival
from dspark.sample.logits_shaping import LogitsShaping, apply_window_shaping
from dspark.sample.sampler import SamplingTensors, sampling_probs
from dspark.sample.token_bitmask import (
    WindowGrammar,
    WindowMasks,
    apply_token_bitmask,
    window_index,
)
from dspark.spec.drafting import DraftBlock, draft_block
from dspark.spec.ragged import TrimmedCell, compact_windows
from dspark.spec.selector import select_verify_lengths
from dspark.spec.spec_buffers import SamplingMode, SpecBuffers, WindowRow
from dspark.spec.synthetic import (
    SyntheticAcceptance,
    synthetic_confidence_logits,
    synthetic_verify,
)
from dspark.spec.verifier import VerifyInput, VerifyOutput, verify, verify_greedy


@dataclass(frozen=True)
class TargetStep:
    """The target forward of a speculative step and the persistent inputs it reads."""

    run: Callable[[], object]  # -> ModelOutput with the tap layers' hidden states
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    block_table: torch.Tensor  # [rows, W]; window row j uses row j


@dataclass(frozen=True)
class SpecStepOutput:
    logits: torch.Tensor  # [N, vocab] the target's logits at every logits index of the step
    window_logits: torch.Tensor  # [Tw, vocab] the rows of `logits` that are window tokens
    tokens: torch.Tensor  # [R, K + 1] accepted drafts, then the recovered/bonus token
    num_accepted: torch.Tensor  # [R]
    confidence_logits: torch.Tensor | None  # [R, K] raw (the observers')
    verify_len: torch.Tensor | None = None  # [R] chosen on the device (a trimmed cell only)
    # [R, K] calibrated (calibrated_survival), for the metrics and the drafting policy: computed
    # in the step (inside its graph), so the host only copies them
    survivals: torch.Tensor | None = None


@dataclass(frozen=True)
class Scored:
    """A speculative step launched up to verification (SpecDecoder.launch): drafted, scored by
    the target, the drafter's context fed."""

    num_rows: int
    st: SamplingTensors
    block: DraftBlock
    logits: torch.Tensor  # [N, vocab] the target's logits at every logits index of the step
    window_logits: torch.Tensor  # [Tw, vocab]
    verify_len: torch.Tensor | None  # [R] chosen after drafting (a trimmed cell), else None
    cu: torch.Tensor | None  # [R + 1] their windows' starts, with verify_len
    survivals: torch.Tensor | None  # [R, K] calibrated (None without a confidence head)
    shaping: LogitsShaping | None


class SpecDecoder:
    def __init__(
        self,
        drafter: DSparkDrafter,
        kv_caches: list[torch.Tensor],
        page_size: int,
        device,
        num_verify: int | None = None,  # K verified per window (<= draft_len; default all)
        max_rows: int = 256,  # windows per step at most (the runner's row capacity)
        confidence_temperatures: list[float] | None = None,  # STS T_1..T_K; None: T = 1
        greedy_confidence_temperatures: list[float] | None = None,  # for greedy rows
        # a benchmark's synthetic acceptance (spec/synthetic.py); None: the target judges
        synthetic: SyntheticAcceptance | None = None,
    ) -> None:
        self.drafter = drafter
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.device = device
        self.draft_len = drafter.config.draft_len
        self.num_verify = num_verify or self.draft_len
        self.taps = drafter.config.target_layers
        # calibrated confidence c[k] = sigmoid(logit[k] / T_k) (dspark/spec/calibration.py)
        self.calibrated = confidence_temperatures is not None
        temps = confidence_temperatures or [1.0] * self.draft_len
        self.confidence_temperatures = torch.tensor(temps, dtype=torch.float32, device=device)
        self.greedy_confidence_temperatures = torch.tensor(
            greedy_confidence_temperatures or temps, dtype=torch.float32, device=device
        )
        # the host's survivals (metrics, drafting policy) per row: greedy rows use the greedy
        # fit where the calibration has one (dspark/spec/calibration.py)
        self.survival_temperatures = {
            False: torch.tensor(temps[: self.num_verify], dtype=torch.float32),
            True: torch.tensor((greedy_confidence_temperatures or temps)[: self.num_verify],
                               dtype=torch.float32),
        }  # fmt: skip
        self.buffers = SpecBuffers(max_rows, self.draft_len, page_size, device)
        self.synthetic = synthetic
        if synthetic is not None:  # (made once: a captured step cannot copy from the host)
            self._synthetic_rates = synthetic.device_rates(self.num_verify, device)  # [K]
            self._synthetic_logits = synthetic.unit_logits(self.num_verify, device)  # [K]
        self.reset_metrics()
        # called once per verified step with (verify_len, num_accepted, raw confidence logits
        # [R, K] on the host), live windows in plan order: calibration records through this
        self.observers: list[Callable[[list[int], list[int], torch.Tensor | None], None]] = []

    def reset_metrics(self) -> None:
        """vLLM's counters from zero (at construction, and after a start-up profile)."""
        # (numpy: record() adds a step's counts in a few vector operations)
        self.metrics: Counter[str] = Counter()
        self.accepted_per_position = np.zeros(self.draft_len, dtype=np.int64)
        self.verify_len_counts = np.zeros(self.num_verify + 1, dtype=np.int64)  # by verify_len
        # calibration in production: over full-block windows, the calibrated survival each
        # position was predicted (summed) next to how often it was realised (drafts 1..k kept)
        self.predicted_survival = np.zeros(self.num_verify)
        self.realised_survival = np.zeros(self.num_verify, dtype=np.int64)
        self._positions = np.arange(self.num_verify)

    def stage(
        self,
        rows: list[WindowRow],
        num_rows: int,
        pad_token_offset: int = 0,
        window_width: int | None = None,  # tokens per window in the layout; None: verify_len + 1
        block_table: np.ndarray | None = None,  # [rows, W] host pages, row WindowRow.table_row
    ) -> None:
        """Write the windows (and pad rows of num_verify drafts up to num_rows) into the
        persistent buffers."""
        self.buffers.write(rows, num_rows, pad_token_offset, self.num_verify, window_width,
                           block_table)  # fmt: skip
        self.buffers.upload(num_rows)

    def step(
        self,
        num_rows: int,  # R windows (live + pad), staged by stage()
        mode: SamplingMode,
        target: TargetStep,
        window_index: torch.Tensor | slice | None,  # logit rows of the window tokens; None: all
        trimmed: TrimmedCell | None = None,  # run as this trimmed cell (all rows full width)
        shaping: LogitsShaping | None = None,  # per window row (eager steps only)
    ) -> SpecStepOutput:
        """Draft, run the target, feed the drafter's context, verify: device work only, so
        the same code runs eagerly and inside a captured graph (without `shaping`, whose host
        work is an eager step's)."""
        return self.verify_scored(self.launch(num_rows, mode, target, window_index, trimmed,
                                              shaping))  # fmt: skip

    def launch(
        self,
        num_rows: int,
        mode: SamplingMode,
        target: TargetStep,
        window_index: torch.Tensor | slice | None,
        trimmed: TrimmedCell | None = None,
        shaping: LogitsShaping | None = None,
        grammar: WindowGrammar | None = None,  # its drafts' copy is queued (eager steps only)
    ) -> Scored:
        """Steps 1-3: draft (and choose a trimmed cell's verify lengths), run the target, feed
        the drafter's context. With grammar rows the drafts' copy to the host is queued after
        drafting, before the target forward, so that a wait for it is a wait for the drafter."""
        st = self.buffers.sampling(num_rows, mode)
        if shaping is not None and shaping.min_p is not None:
            st = replace(st, min_p=shaping.min_p)
        block = self.draft(num_rows, st, target.input_ids, target.block_table[:num_rows],
                           shaping, None if trimmed is None else trimmed.reach)  # fmt: skip
        # (once: a trimmed cell's fill ranks them, the host's metrics and policy read them)
        survivals = None
        if block.confidence_logits is not None:
            survivals = self.calibrated_survival(st, block)
        verify_len = cu = None
        if trimmed is not None:
            verify_len, cu = self.trim(num_rows, survivals, trimmed)
        if grammar is not None:
            grammar.copy_drafts(block.tokens)
        out = target.run()
        self.append_context(out.features, target.positions, target.slot_mapping)
        window_logits = out.logits if window_index is None else out.logits[window_index]
        return Scored(num_rows, st, block, out.logits, window_logits, verify_len, cu, survivals,
                      shaping)  # fmt: skip

    def verify_scored(self, s: Scored, masks: WindowMasks | None = None) -> SpecStepOutput:
        """Step 4 of a launched step, its grammar rows' logits masked by `masks`. (Nothing may
        be staged between launch and this: verification reads the staged windows.)"""
        verified = self.verify(s.window_logits, s.num_rows, s.st, s.block, s.verify_len, s.cu,
                               s.shaping, masks)  # fmt: skip
        tokens = verified.tokens  # [R, reach + 1] from a trimmed cell's narrower block
        if tokens.shape[1] <= self.num_verify:
            tokens = F.pad(tokens, (0, self.num_verify + 1 - tokens.shape[1]))
        return SpecStepOutput(
            s.logits, s.window_logits, tokens, verified.num_accepted, s.block.confidence_logits,
            s.verify_len, s.survivals,
        )  # fmt: skip

    def calibrated_survival(
        self, st: SamplingTensors, block: DraftBlock
    ) -> torch.Tensor:  # [R, K] this block's survivals (greedy rows by the greedy fit)
        assert block.confidence_logits is not None, "choosing lengths needs the confidence head"
        k = block.confidence_logits.shape[1]  # K, or a trimmed cell's reach
        temps = torch.where(
            (st.temperature == 0)[:, None], self.greedy_confidence_temperatures[None, :k],
            self.confidence_temperatures[None, :k],
        )  # [R, K]  # fmt: skip
        return survival(block.confidence_logits[:, :k].float(), temps)

    def trim(
        self, num_rows: int, survivals: torch.Tensor | None, trimmed: TrimmedCell
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [R] verify lengths, [R + 1] their cu
        """The trimmed cell's stage (spec/ragged.py): the block's fresh survivals
        (calibrated_survival) fill the budget, and the full-width inputs become the ragged
        layout of trimmed.num_tokens tokens."""
        assert survivals is not None, "choosing lengths needs the confidence head"
        verify_len = select_verify_lengths(
            survivals, trimmed.num_tokens - num_rows,
            self.buffers.verify_cap[:num_rows].clamp(max=trimmed.reach),
        )  # fmt: skip
        return verify_len, compact_windows(trimmed.windows, verify_len, trimmed.num_tokens)

    # ---- 1. draft ---------------------------------------------------------------------------

    def draft(
        self,
        num_rows: int,
        st: SamplingTensors,
        input_ids: torch.Tensor,  # the target's input ids: drafts are scattered in
        block_table: torch.Tensor,  # [R, W] the window rows' pages
        shaping: LogitsShaping | None = None,
        reach: int | None = None,  # a trimmed cell's (ragged.py): no row verifies more
    ) -> DraftBlock:
        """The block of K = num_verify drafts a row (or a trimmed cell's reach, fewer): the
        backbone runs over the whole drafter block (draft_len slots, which attend to each
        other), the LM head, the Markov head and the confidence head over the first K slots
        only, the ones a window can verify (K = 3 of a block of 7: three slots' vocabulary
        logits, not seven)."""
        b, R, K = self.buffers, num_rows, min(self.num_verify, reach or self.num_verify)
        anchors = b.anchors[:R]
        hidden = self.drafter.block_hidden(
            anchors, b.block_positions[: R * self.draft_len], b.block_metadata(R, block_table),
            self.kv_caches,
        )  # fmt: skip
        if K < self.draft_len:  # (contiguous: F.linear on a view would broadcast the LM head's
            hidden = hidden[:, :K].contiguous()  # weight over the rows, a bmm reading it R times)
        block = draft_block(self.drafter, hidden, anchors, b.anchor_pos[:R], st, shaping)
        # slot k < verify_len goes to its window token; the others (the block's slots past K
        # too) rewrite the anchor itself
        slots = torch.arange(K, device=self.device)
        keep = slots[None, :] < b.verify_len[:R, None]  # [R, K]
        values = torch.where(keep, block.tokens, anchors[:, None])
        if K < self.draft_len:
            values = torch.cat([values, anchors[:, None].expand(R, self.draft_len - K)], dim=1)
        input_ids.index_copy_(0, b.draft_dst[:R].reshape(-1), values.reshape(-1))
        if self.synthetic is not None and block.confidence_logits is not None:
            temps = torch.where((st.temperature == 0)[:, None],
                                self.greedy_confidence_temperatures[None, :K],
                                self.confidence_temperatures[None, :K])  # [R, K]  # fmt: skip
            logits = synthetic_confidence_logits(self._synthetic_logits[:K], temps)
            block = dataclasses.replace(block, confidence_logits=logits)
        return block

    # ---- 3. context -------------------------------------------------------------------------

    def append_context(
        self,
        features: torch.Tensor,  # [T, m d] the target's taps (ModelOutput.features of self.taps)
        positions: torch.Tensor,  # [T]
        slot_mapping: torch.Tensor,  # [T]
    ) -> None:
        self.drafter.append_context(features, positions, slot_mapping, self.kv_caches)

    # ---- 4. verify --------------------------------------------------------------------------

    def verify(
        self,
        window_logits: torch.Tensor,  # [Tw, V] target logits at every window token
        num_rows: int,
        st: SamplingTensors,  # per window row
        block: DraftBlock,
        verify_len: torch.Tensor | None = None,  # [R] (None: the staged ones)
        cu: torch.Tensor | None = None,  # [R + 1] window starts in window_logits, with it
        shaping: LogitsShaping | None = None,  # per window row
        masks: WindowMasks | None = None,  # the grammar rows' masks per window position
    ) -> VerifyOutput:
        b, R, dev = self.buffers, num_rows, self.device
        if verify_len is None:
            verify_len = b.verify_len[:R]
            cu = torch.zeros(R + 1, dtype=torch.int64, device=dev)
            cu[1:] = b.window_len[:R].cumsum(0)
        verified = self._verify_by_target(window_logits, R, st, block, verify_len, cu, shaping,
                                          masks)  # fmt: skip
        if self.synthetic is None:
            return verified
        # (the target's verification above still ran: its cost is part of the step measured)
        rates = self._synthetic_rates[: block.tokens.shape[1]]  # (a trimmed cell's reach)
        return synthetic_verify(rates, self.synthetic.seed, window_logits,
                                block.tokens, verify_len, cu, st.seeds,
                                b.anchor_pos[:R])  # fmt: skip

    def _verify_by_target(
        self,
        window_logits: torch.Tensor,  # [Tw, V]
        R: int,
        st: SamplingTensors,
        block: DraftBlock,
        verify_len: torch.Tensor,  # [R]
        cu: torch.Tensor,  # [R + 1]
        shaping: LogitsShaping | None,  # per window row
        masks: WindowMasks | None = None,
    ) -> VerifyOutput:
        """Lossless verification (spec/verifier.py): greedy rows by argmax, others by
        rejection sampling. Grammar rows verify against the target masked by the grammar
        after the window's drafts before each position (docs/SPECULATION.md 4.9): a draft
        the grammar does not allow has target probability 0 and is rejected like any other."""
        b, dev = self.buffers, self.device
        if st.all_greedy and shaping is None and masks is None:
            return verify_greedy(window_logits, block.tokens, verify_len, cu)
        # owner row of each window token (shape-static: no host sync, capturable)
        token = torch.arange(window_logits.shape[0], device=dev)
        owner = torch.searchsorted(cu[1:], token, right=True).clamp(max=R - 1)
        if masks is not None:  # first: the shaping below only moves allowed tokens
            offset = (token - cu[owner]).clamp(min=0)  # [Tw] 0 the anchor, j draft j
            index = window_index(masks, owner, offset)
            window_logits = apply_token_bitmask(window_logits, masks.bitmask.flatten(0, 1), index)
        if shaping is not None:  # token j of a window: outputs and drafts 1..j (the drafter's)
            window_logits = apply_window_shaping(window_logits, shaping, block.tokens, cu)
        if st.all_greedy:
            return verify_greedy(window_logits, block.tokens, verify_len, cu)
        per_token = SamplingTensors(
            temperature=st.temperature[owner], top_k=st.top_k[owner], top_p=st.top_p[owner],
            seeds=st.seeds[owner], positions=st.positions[owner], all_greedy=st.all_greedy,
            any_top_k=st.any_top_k, any_top_p=st.any_top_p,
            min_p=None if st.min_p is None else st.min_p[owner],
        )  # fmt: skip
        return verify(
            VerifyInput(
                target_probs=sampling_probs(window_logits, per_token),
                draft_probs=block.probs,
                draft_tokens=block.tokens,
                verify_len=verify_len,
                cu_num_tokens=cu,
                anchor_positions=b.anchor_pos[:R],
                seeds=st.seeds,
                is_greedy=st.temperature == 0,
            )
        )

    def record(
        self,
        verify_len: list[int],
        num_accepted: list[int],
        confidence_logits: torch.Tensor | None = None,  # [R, K] raw, host copy (observers only)
        survivals: np.ndarray | None = None,  # [R, K] the same windows' (SpecStepOutput's)
    ) -> None:
        """vLLM's counters: drafts (windows), drafted tokens, accepted tokens, per position;
        then every observer sees the step's windows (after the step's host sync)."""
        for observe in self.observers:
            observe(verify_len, num_accepted, confidence_logits)
        verified, kept_by_window = np.asarray(verify_len), np.asarray(num_accepted)
        lengths = np.bincount(verified, minlength=len(self.verify_len_counts))  # [K + 1]
        accepted = np.bincount(kept_by_window, minlength=self.draft_len + 1)  # [K + 1]
        num_draft_tokens = int(verified.sum())
        m = self.metrics
        m["num_drafts"] += len(verify_len) - int(lengths[0])  # (not empty windows)
        m["num_draft_tokens"] += num_draft_tokens
        m["num_verified_tokens"] += len(verify_len) + num_draft_tokens
        m["num_accepted_tokens"] += int(kept_by_window.sum())
        # windows that kept position k: those that accepted more than k drafts
        #   num_accepted [2, 0, 3] (K = 3): accepted [1, 0, 1, 1] -> kept [2, 2, 1]
        self.accepted_per_position += accepted[::-1].cumsum()[::-1][1:]
        self.verify_len_counts += lengths
        if survivals is None:
            return
        # the calibration's reliability: predicted (summed survivals) against realised (drafts
        # kept) per position, over uncensored windows (verified in full)
        full = verified == self.num_verify
        if full.any():
            m["num_survival_windows"] += int(full.sum())
            self.predicted_survival += survivals[full].sum(0)
            kept = kept_by_window[full][:, None] > self._positions[None, :]  # drafts 1..k kept
            self.realised_survival += kept.sum(0)
