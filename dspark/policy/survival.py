"""Each running request's lagged survival estimate: what the drafting policy prices drafting by
(policy/policy.py; DSPARK.md 6.3 item 2, 6.4).

After every speculative step the policy observes each window's calibrated survivals a[r, j]
(at least one step old when they are used: the drafts they describe are already verified, so
no choice can depend on the tokens it admits; DSPARK.md 6.3). Only each request's sum over j
is kept (and, with trimmed cells to price, its vector). A request with no survivals yet (just
admitted, never drafted), or whose survivals are stale, counts as fully confident: a = 1, a
sum of K.

With unobserved="population" (the default) a request that never drafted counts instead as
the recent requests' mean survival sum (exponentially weighted over observed blocks, half-life
calibration_half_life blocks, recalibrated like the others), once min_population_blocks
blocks were observed; stale rows still count K, so probing is unchanged. The population's
evidence goes stale too: once its newest block is older than the stale horizon, an unseen row
counts K, as a stale one does. Nothing else refreshes it while nothing drafts: a served engine
at concurrency 1 whose population mean sat below break-even priced each new request by that
frozen mean, so no request drafted again (on the CPU one stretch without drafting ran 466
steps over five requests; an H200 server drafted in none of its 3,300 steps after its warm-up,
where the offline engine drafted in 38%: docs/PERFORMANCE.md, twenty-ninth look). Now such a
request probes once the mean is stale, as a stale row would. With "confident" every admission
counts K, and under load, where requests arrive every few steps, the batch then drafts for a
few steps after each arrival at several times the plain cost. In a closed loop of
256 requests ending at different steps on the H200 (docs/PERFORMANCE.md, tenth look) that ran
at 0.89x plain decoding against 1.03x with "population"; from 1 to 64 requests the two made the
same choices. DSPARK.md 6.4 counts a just-admitted request as fully confident. Here that still
holds for what the step verifies (a drafting step verifies every window in full) and for the
choice while there is no evidence; only the price of drafting at all uses the population's
evidence in place of a = 1.

A request's estimate is not its last block alone. Its blocks' sums are smoothed (exponentially,
half-life block_half_life blocks: the newest block weighs one half by default), and the estimate
is pulled toward the population mean as it ages (half-life regression_half_life steps). One
weak block (a sentence boundary, a number) therefore neither turns drafting off by itself nor,
once it has, keeps it off until the row goes stale: at G = 1 staleness takes ~120 steps, and on
the H200 (2026-12-03) the policy drafted 33 of 166 steps at concurrency 1 for 1.29x plain
decoding where fixed K gave 1.65x. Where plain decoding wins on the population's own mean
(under load), the pull changes nothing. Before the population has min_population_blocks
blocks, an aged estimate is pulled toward K, what a request with no evidence counts then, so
drafting resumes after the dwell and the population's evidence builds up. Without that pull a
served engine at concurrency 1, whose requests come one at a time with no population yet,
kept each request's first weak block for its whole life (no drafting after its first step,
until stale), so its population never formed: on an H100 it drafted in none of a run's
~1,100 steps, where the offline engine, whose warm-up drafts a few rows at once, drafted in
83% (docs/PERFORMANCE.md, twenty-eighth look).

With regression_target="request" an aged estimate is pulled toward the request's own mean
instead: the mean of every block it kept so far, shrunk toward the population mean by
REQUEST_PRIOR_BLOCKS pseudo-blocks. The population's blocks are the ones that drafted, so they
over-represent requests that draft well. At concurrency 1 on the H200 (docs/PERFORMANCE.md,
twenty-fourth look) a request whose blocks kept 0.5-0.8 drafts was pulled from 0.67 to 1.28
(population 1.9) within the 8-step dwell, drafted again, read 0.78 and 0.52, and went off: 28
two-step stretches a run, with the persistence fit at rho 0.95. Its own mean keeps such a
request off, and still brings back one whose weak block was a dip in a good history. Off
("population") by default until the GPU compares them.

Two corrections keep lagged estimates honest:
- Persistence, measured. How much a request's past blocks say about its next one is measured, not
  assumed: for full blocks verified from rows that had an estimate (at most 16 rows a step, in
  rotation), the pair (the row's estimate when the block was decided, the drafts the block kept)
  enters an exponentially weighted least-squares fit (half-life calibration_half_life blocks). Its
  slope rho, clipped to [0, 1], is how far an estimate may stand from the population mean: own =
  mean + rho (own - mean), before the pull with age. The fit is used once min_persistence_blocks
  pairs (weighted) are in and their estimates spread (until then rho = 1). On the H200
  (2026-12-04) the unfitted policy turned drafting off at concurrency 1 on 28 weak estimates and
  dwelt 196 steps, at 0.93x fixed K, where the blocks that followed weak ones still kept enough
  drafts to pay.
  The estimate paired with a block is the one the decision that launched the block read.
  Where drafting steps launch ahead (decision_lag 2, engine/spec_setup.py) the step after N
  is decided before N's survivals are read, so block N + 1 was chosen on evidence through
  block N - 1, and the fit pairs it with the row's smoothed sum from then, not with the sum
  through block N, which no decision about it saw:

      decisions  ...  decide N+1 | launch N+1 | read N | decide N+2 | launch N+2 | read N+1
      pair for block N+1, decision_lag 1: (sum through N,     kept(N+1))
                          decision_lag 2: (sum through N - 1, kept(N+1))

  Evidence two blocks old says less: replayed on the CPU at concurrency 1 with steps launched
  ahead (bench/policy_replay.py --ahead), the one-block pairs fitted rho 0.94 and the pairs
  of what the decisions read 0.70, with 22% fewer switches (docs/PERFORMANCE.md,
  thirty-second look, where an H100's policy at concurrency 1 turned drafting off after 16%
  of its steps and its drafting steps kept no more than fixed K's).
  Everything the fit uses was verified before the current drafts exist (6.3).
- Online recalibration. STS is fitted offline on other prompts; the engine knows, for every full
  block it verified, how many drafts the calibrated survivals predicted and how many were
  accepted. The sums are scaled by realised / predicted over recent full blocks (exponentially
  weighted, half-life calibration_half_life blocks, with a prior of prior_blocks blocks at ratio
  1), clipped to K. Everything it uses was verified before the current drafts exist (6.3).
"""

from __future__ import annotations

import numpy as np
import torch

from dspark.policy.cells import survival
from dspark.spec.config import REGRESSION_TARGETS  # what an aged estimate is pulled toward

# what a request's lagged survivals rest on (SurvivalEstimates.estimate_totals)
FRESH, STALE, UNSEEN = 0, 1, 2
PERSISTENCE_PAIRS_PER_STEP = 16  # rows a drafting step adds to the persistence fit
REQUEST_PRIOR_BLOCKS = 4.0  # population-mean pseudo-blocks in a request's own mean


class SurvivalEstimates:
    """The drafting policy's evidence: observe() after each speculative step, estimate_totals()
    and estimate_vectors() before the next; `_step` is the clock of staleness and age (the
    policy's decisions)."""

    def __init__(
        self,
        temperatures: dict[bool, torch.Tensor],  # greedy? -> [K] STS temperatures (host)
        draft_len: int,  # K verified per full block
        calibration_half_life: float = 256.0,  # full blocks, of the realised/predicted ratio
        prior_blocks: float = 4.0,  # ratio-1 pseudo-blocks: a few blocks cannot swing it
        unobserved: str = "population",  # or "confident" (module docstring)
        min_population_blocks: float = 16.0,
        block_half_life: float = 1.0,  # blocks, of a request's smoothed survival sum
        regression_half_life: float = 8.0,  # steps, of a request's pull to the population mean
        regression_target: str = "population",  # or "request" (module docstring)
        fit_persistence: bool = True,  # False: rho = 1 (a row's own survivals count in full)
        min_persistence_blocks: float = 32.0,  # fitted pairs before rho is used (module doc)
        decision_lag: int = 1,  # blocks between a decision's newest evidence and its block
        keep_vectors: bool = False,  # keep each request's survivals per position (trimmed cells)
    ) -> None:
        if unobserved not in ("confident", "population"):
            raise ValueError(f'unobserved must be "confident" or "population", got {unobserved!r}')
        if regression_target not in REGRESSION_TARGETS:
            raise ValueError(f"regression_target must be one of {list(REGRESSION_TARGETS)}, "
                             f"got {regression_target!r}")  # fmt: skip
        if decision_lag not in (1, 2):
            raise ValueError(f"decision_lag must be 1 or 2, got {decision_lag}")
        if block_half_life < 0 or regression_half_life <= 0:
            raise ValueError(f"block_half_life must be >= 0 and regression_half_life > 0, got "
                             f"{block_half_life} and {regression_half_life}")  # fmt: skip
        self.unobserved = unobserved
        self.min_population_blocks = min_population_blocks
        self._population_sum = self._population_blocks = 0.0  # weighted observed sums, blocks
        self._population_vector = np.zeros(draft_len)  # weighted observed survivals [K]
        self._population_step = 0  # the step of the population's newest block
        self.draft_len = draft_len
        self.temperatures = {g: t.float().cpu()[:draft_len] for g, t in temperatures.items()}
        self._decay = 0.5 ** (1.0 / calibration_half_life)
        # weight of a request's newest block in its smoothed sum (1: the last block alone)
        self._block_weight = 1.0 - 0.5 ** (1.0 / block_half_life) if block_half_life else 1.0
        self._regression_half_life = regression_half_life
        self.regression_target = regression_target
        # with regression_target "request": request id -> [sum of its blocks' sums, blocks]
        self._request_blocks: dict[str, list[float]] = {}
        # the persistence fit (module docstring): weighted pairs and their sums x, y, xx, xy
        self.fit_persistence = fit_persistence
        self.min_persistence_blocks = min_persistence_blocks
        self._pairs = [0.0] * 5
        self.decision_lag = decision_lag
        # with decision_lag 2: request id -> its smoothed sum before its newest block (what
        # the decision about its next block read)
        self._earlier_sums: dict[str, float] = {}
        self._fit_start = 0  # the row the next step's pairs start from (modulo the batch)
        # exponentially weighted predicted and realised accepted drafts over full blocks, each
        # starting from prior_blocks blocks of one accepted draft predicted and realised
        self._predicted = self._realised = prior_blocks
        self._step = 0  # the clock: survivals observed at a step, estimates aged by it
        # request id -> (sum of its smoothed K survivals, the step it was last observed at)
        self._survival_sums: dict[str, tuple[float, int]] = {}
        # with keep_vectors, each request's smoothed survivals per position [K] too (kept only
        # then: a dozen numpy calls per row cost the step loop ~1 us each)
        self.keep_vectors = keep_vectors
        self._survival_vectors: dict[str, np.ndarray] = {}

    def observe(
        self,
        request_ids: list[str],
        confidence_logits: torch.Tensor,  # [R, K] raw (host)
        greedy: list[bool],
        num_accepted: list[int] | None = None,  # per window, with verify_len: recalibration
        verify_len: list[int] | None = None,
    ) -> None:
        """After a speculative step's sync: each window's raw confidences and what it kept."""
        a = survival(confidence_logits[:, : self.draft_len].float(), self._row_temperatures(greedy))
        sums = a.sum(-1).tolist()
        if num_accepted is not None and verify_len is not None:
            self._fit_persistence(request_ids, num_accepted, verify_len)  # (estimates before)
        w = self._block_weight
        earlier = self._earlier_sums if self.decision_lag == 2 else None
        for rid, total in zip(request_ids, sums, strict=True):
            seen = self._survival_sums.get(rid)
            smoothed = total if seen is None else seen[0] + w * (total - seen[0])
            self._survival_sums[rid] = (smoothed, self._step)
            if earlier is not None and seen is not None:
                earlier[rid] = seen[0]
        if self.regression_target == "request":
            for rid, total in zip(request_ids, sums, strict=True):
                blocks = self._request_blocks.setdefault(rid, [0.0, 0.0])
                blocks[0] += total
                blocks[1] += 1.0
        decay = self._decay ** len(sums)
        self._population_sum = self._population_sum * decay + sum(sums)
        if sums:
            self._population_step = self._step
        if self.keep_vectors:
            self._observe_vectors(request_ids, a.double().numpy(), decay)
        self._population_blocks = self._population_blocks * decay + len(sums)
        if num_accepted is None or verify_len is None:
            return
        if verify_len.count(self.draft_len) == len(verify_len):  # every block uncensored (the
            predicted, realised = sums, num_accepted  # usual step: no index lists to build)
        else:
            full = [j for j, v in enumerate(verify_len) if v == self.draft_len]  # uncensored
            predicted, realised = [sums[j] for j in full], [num_accepted[j] for j in full]
        decay = self._decay ** len(predicted)
        self._predicted = self._predicted * decay + sum(predicted)
        self._realised = self._realised * decay + sum(realised)

    def _row_temperatures(self, greedy: list[bool]) -> torch.Tensor:
        """[1, K] when every row is greedy, or every row samples (the usual batch: one
        broadcast row), else [R, K]. (Against stacking R rows, observe() took 12-34% less time
        at 64 rows and 22-48% less at 256 on the development CPU: docs/PERFORMANCE.md,
        twenty-first look.)"""
        if all(greedy) or not any(greedy):
            return self.temperatures[bool(greedy and greedy[0])][None]
        mask = torch.from_numpy(np.array(greedy, dtype=bool))[:, None]  # (torch.tensor: 9x slower)
        return torch.where(mask, self.temperatures[True], self.temperatures[False])

    def _fit_persistence(
        self, request_ids: list[str], num_accepted: list[int], verify_len: list[int]
    ) -> None:
        """observe()'s pairs into the persistence fit: (the row's recalibrated estimate the
        decision that launched its block read, the drafts the block kept; module docstring),
        for uncensored blocks of rows that had an estimate then. At most
        PERSISTENCE_PAIRS_PER_STEP rows a step, from a start that rotates with each call: a
        large batch gives far more pairs than the fit needs, and observe() runs after every
        drafting step (at 256 rows, pairs from every row doubled its cost)."""
        r = len(request_ids)
        if not self.fit_persistence or not r:
            return
        scale, k = self.correction, self.draft_len
        lagged, earlier, smoothed = self.decision_lag == 2, self._earlier_sums, self._survival_sums
        start = self._fit_start
        self._fit_start += PERSISTENCE_PAIRS_PER_STEP
        n = sx = sy = sxx = sxy = 0.0
        for i in range(r):
            j = (start + i) % r
            if verify_len[j] != k:
                continue
            if lagged:
                before = earlier.get(request_ids[j])
            else:
                seen = smoothed.get(request_ids[j])
                before = None if seen is None else seen[0]
            if before is None:
                continue
            x, y = min(k, scale * before), num_accepted[j]
            n, sx, sy, sxx, sxy = n + 1, sx + x, sy + y, sxx + x * x, sxy + x * y
            if n == PERSISTENCE_PAIRS_PER_STEP:
                break
        if n:
            decay = self._decay**n
            step = (n, sx, sy, sxx, sxy)
            self._pairs = [a * decay + b for a, b in zip(self._pairs, step, strict=True)]

    @property
    def persistence(self) -> float:
        """rho: the slope of a block's kept drafts on its row's estimate before it, clipped to
        [0, 1]; 1 until the fit has min_persistence_blocks pairs whose estimates spread."""
        n, sx, sy, sxx, sxy = self._pairs
        if not self.fit_persistence or n < self.min_persistence_blocks:
            return 1.0
        var = sxx / n - (sx / n) ** 2
        if var < 1e-3:  # (every estimate alike: no slope to read)
            return 1.0
        return min(1.0, max(0.0, (sxy / n - sx * sy / n**2) / var))

    def _observe_vectors(self, request_ids: list[str], a: np.ndarray, decay: float) -> None:
        """observe()'s per-position twin of the smoothed sums (trimmed cells only)."""
        w = self._block_weight
        for rid, vector in zip(request_ids, a, strict=True):
            seen = self._survival_vectors.get(rid)
            self._survival_vectors[rid] = vector if seen is None else seen + w * (vector - seen)
        self._population_vector = self._population_vector * decay + a.sum(0)

    @property
    def correction(self) -> float:
        """Realised / predicted accepted drafts over recent full blocks (1 with no evidence)."""
        return self._realised / self._predicted

    def forget(self, request_id: str) -> None:
        self._survival_sums.pop(request_id, None)
        self._earlier_sums.pop(request_id, None)
        self._request_blocks.pop(request_id, None)
        self._survival_vectors.pop(request_id, None)

    def estimate_totals(
        self, request_ids: list[str], fresh_since: int
    ) -> tuple[list[float], list[int]]:
        """Each request's estimated survival sum, and its kind: FRESH, STALE (last observed
        before step fresh_since) or UNSEEN.

        A fresh row's estimate is its smoothed sum, its distance from the population mean
        (or with regression_target "request", from its own shrunk mean) scaled by the
        measured persistence rho and halved every regression_half_life steps of age (module
        docstring), once the population has min_population_blocks blocks of evidence (before
        that, toward K, what an unseen row then counts); stale and unseen rows count K, or
        unseen ones the population's mean while its newest block is fresh (an unseen row
        priced by a stale population counts K and is reported STALE).

          smoothed sum 0.6 (blocks 0.6, 0.7, 0.5), population mean 1.9, correction 1, rho 1,
          age 8 steps, half-life 8:
          population: 1.9 + (0.6 - 1.9) / 2 = 1.25
          request:    target (1.8 + 4 x 1.9) / (3 + 4) = 1.34; 1.34 + (0.6 - 1.34) / 2 = 0.97

        (Called before every step: plain floats, no numpy.)
        """
        scale, k = self.correction, self.draft_len
        unseen, unseen_kind = self.unobserved_sum(), UNSEEN
        if self._population_step < fresh_since and self.unobserved == "population":
            unseen, unseen_kind = float(k), STALE  # (the population's evidence is stale)
        mean = self.population_mean()
        decay = 0.5 ** (1.0 / self._regression_half_life)
        rho = self.persistence
        blocks = self._request_blocks if self.regression_target == "request" else None
        prior = REQUEST_PRIOR_BLOCKS
        totals, kinds = [], []
        for rid in request_ids:
            seen = self._survival_sums.get(rid)
            if seen is None:
                totals.append(unseen)
                kinds.append(unseen_kind)
            elif seen[1] < fresh_since:
                totals.append(float(k))
                kinds.append(STALE)
            else:
                own = min(k, scale * seen[0])
                target = float(k)  # (no population yet: K, what an unseen row then counts)
                if mean is not None:
                    target = mean
                    if blocks is not None and (history := blocks.get(rid)) is not None:
                        target = min(k, (scale * history[0] + prior * mean) / (history[1] + prior))
                own = target + (own - target) * rho * decay ** (self._step - seen[1])
                totals.append(own)
                kinds.append(FRESH)
        return totals, kinds

    def estimate_vectors(
        self, request_ids: list[str], totals: list[float], kinds: list[int]
    ) -> np.ndarray:
        """[R, K] the requests' lagged survivals per position: each row's vector (its own, or
        the population's for a request that never drafted; ones when stale or without
        evidence) rescaled to the row's total of estimate_totals, clipped to 1."""
        k = self.draft_len
        flat = np.ones(k) / k  # (the shape of a row with no vector: its total spread evenly)
        population = flat
        if self.unobserved == "population" and self.population_mean() is not None:
            population = self._population_vector
        vectors = np.stack([
            self._survival_vectors.get(rid, flat) if kind == FRESH
            else population if kind == UNSEEN else flat
            for rid, kind in zip(request_ids, kinds, strict=True)
        ]).reshape(len(request_ids), k)  # fmt: skip
        mass = vectors.sum(axis=1, keepdims=True)
        scale = np.asarray(totals)[:, None] / np.where(mass > 0, mass, 1.0)
        rows = np.where(mass > 0, vectors * scale, np.asarray(totals)[:, None] / k)
        return np.minimum(1.0, rows)

    def population_mean(self) -> float | None:
        """The recent requests' recalibrated mean survival sum per block (exponentially
        weighted over observed blocks), or None before min_population_blocks blocks."""
        if self._population_blocks < self.min_population_blocks:
            return None
        return min(self.draft_len, self.correction * self._population_sum / self._population_blocks)

    def unobserved_sum(self) -> float:
        """What a request that never drafted counts: K, or with unobserved="population" and
        enough evidence, the recent requests' recalibrated mean survival sum."""
        mean = self.population_mean()
        if self.unobserved == "confident" or mean is None:
            return float(self.draft_len)
        return mean
