"""Each running request's lagged survival estimate: what the drafting policy prices drafting by
(policy.py; docs/SPECULATION.md, the policy).

Survival a[r, j] is the calibrated probability that drafts 1..j of row r all survive:
cumprod_j sigmoid(logit[r, j] / T_j), with T the STS temperatures (`survival`, which the
device's verify-length selection shares).

After every speculative step the policy observes each window's calibrated survivals (at least
one step old when they are used: the drafts they describe are already verified, so no choice
can depend on the tokens it admits). Only each request's sum over j is kept (and, with trimmed
cells to price, its vector). A request whose survivals are stale counts as fully confident:
a = 1, a sum of K, so a probe refreshes them.

A request that never drafted counts as the recent requests' mean survival sum (exponentially
weighted over observed blocks, half-life calibration_half_life blocks, recalibrated like the
others), once min_population_blocks blocks were observed; before that, and once the
population's newest block is older than the stale horizon, it counts K. Counting every
admission as K (a = 1, the letter of the method) makes a loaded batch draft for a few steps
after each arrival at several times the plain cost; with the population's evidence the choice
stays where the recent requests put it. The population's evidence must go stale too: nothing
refreshes it while nothing drafts, and a frozen mean below break-even would price every new
request off for good (a served engine at concurrency 1 then drafts in none of its steps). What
the step verifies is unchanged: a drafting step verifies every window in full.

A request's estimate is not its last block alone. Its blocks' sums are smoothed (exponentially,
half-life block_half_life blocks: the newest block weighs one half), and the estimate is pulled
toward the population mean as it ages (half-life regression_half_life steps). One weak block
(a sentence boundary, a number) therefore neither turns drafting off by itself nor, once it
has, keeps it off until the row goes stale (at G = 1 staleness takes ~120 steps). Where plain
decoding wins on the population's own mean (under load), the pull changes nothing. Before the
population has min_population_blocks blocks, an aged estimate is pulled toward K, what a
request with no evidence counts then, so drafting resumes after the dwell and the population's
evidence builds up: a served engine at concurrency 1, whose requests come one at a time, would
otherwise keep each request's first weak block for its whole life and never form a population.
The pull is toward the population's mean, not the request's own: a request's own mean keeps one
that dipped below the line once off for good.

  smoothed sum 0.6, population mean 1.9, correction 1, rho 1, age 8 steps, half-life 8:
  estimate 1.9 + (0.6 - 1.9) / 2 = 1.25

Two corrections keep lagged estimates honest:
- Persistence, measured. How much a request's past blocks say about its next one is measured, not
  assumed: for full blocks verified from rows that had an estimate (at most
  persistence_pairs_per_step rows a step, in rotation), the pair (the row's estimate when the
  block was decided, the drafts the block kept) enters an exponentially weighted least-squares
  fit (half-life calibration_half_life blocks). Its slope rho, clipped to [0, 1], is how far an
  estimate may stand from the population mean: own = mean + rho (own - mean), before the pull
  with age. The fit is used once min_persistence_blocks pairs (weighted) are in and their
  estimates spread (until then rho = 1). Trusted in full, a row's weak estimates turn drafting
  off at concurrency 1 where the blocks that follow weak ones still keep enough drafts to pay.
  The estimate paired with a block is the one the decision that launched the block read.
  Where drafting steps launch ahead (decision_lag 2, engine/spec_setup.py) the step after N
  is decided before N's survivals are read, so block N + 1 was chosen on evidence through
  block N - 1, and the fit pairs it with the row's smoothed sum from then, not with the sum
  through block N, which no decision about it saw:

      decisions  ...  decide N+1 | launch N+1 | read N | decide N+2 | launch N+2 | read N+1
      pair for block N+1, decision_lag 1: (sum through N,     kept(N+1))
                          decision_lag 2: (sum through N - 1, kept(N+1))

  Evidence two blocks old says less, and the fit measures how much less
  (bench/policy.py replay --ahead replays it).
- Online recalibration. STS is fitted offline on other prompts; the engine knows, for every full
  block it verified, how many drafts the calibrated survivals predicted and how many were
  accepted. The sums are scaled by realised / predicted over recent full blocks (exponentially
  weighted, half-life calibration_half_life blocks, with a prior of prior_blocks blocks at ratio
  1), clipped to K.
Everything both use was verified before the current drafts exist.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import eq

import numpy as np
import torch

from dspark.policy.survival_vectors import FLAT, POPULATION, SurvivalVectors
from dspark.policy.tuning import TUNING, PolicyTuning

# what a request's lagged survivals rest on (SurvivalEstimates.estimate_totals)
FRESH, STALE, UNSEEN = 0, 1, 2


def survival(confidence_logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """[R, K] raw logits, STS temperatures [K] (or [R, K], per row) -> [R, K] non-increasing
    survivals."""
    return torch.sigmoid(confidence_logits / temperatures).cumprod(dim=-1)


def host_survivals(
    confidence_logits: torch.Tensor,  # [R, >= K] raw (host)
    greedy: list[bool],  # per row
    temperatures: dict[bool, np.ndarray],  # greedy? -> [K] STS temperatures (float64)
) -> np.ndarray:
    """survival() on the host for a step's windows, greedy rows by the greedy fit: [R, K]
    float64, or [R, reach] for a trimmed cell's narrower block (numpy: a handful of small ops,
    computed once a step for the metrics and the drafting policy)."""
    k = min(len(temperatures[True]), confidence_logits.shape[1])
    logits = confidence_logits.numpy()[:, :k].astype(np.float64)
    if all(greedy) or not any(greedy):  # (the usual batch: one row of temperatures)
        t = temperatures[bool(greedy and greedy[0])][:k]
    else:
        t = np.where(np.asarray(greedy)[:, None], temperatures[True][:k], temperatures[False][:k])
    return np.cumprod(1.0 / (1.0 + np.exp(-logits / t)), axis=1)


class SurvivalEstimates:
    """The drafting policy's evidence: observe() after each speculative step, estimate_totals()
    and estimate_vectors() before the next; `step` is the clock of staleness and age (the
    policy's decisions advance it)."""

    def __init__(
        self,
        temperatures: dict[bool, torch.Tensor],  # greedy? -> [K] STS temperatures (host)
        draft_len: int,  # K verified per full block
        decision_lag: int = 1,  # blocks between a decision's newest evidence and its block
        keep_vectors: bool = False,  # keep each request's survivals per position (trimmed cells)
        tuning: PolicyTuning = TUNING,
    ) -> None:
        if decision_lag not in (1, 2):
            raise ValueError(f"decision_lag must be 1 or 2, got {decision_lag}")
        self.tuning = tuning
        self._population_sum = self._population_blocks = 0.0  # weighted observed sums, blocks
        self._population_step = 0  # the step of the population's newest block
        self.draft_len = draft_len
        self.temperatures = {
            g: t.double().cpu()[:draft_len].numpy() for g, t in temperatures.items()
        }  # fmt: skip
        self._decay = 0.5 ** (1.0 / tuning.calibration_half_life)
        # weight of a request's newest block in its smoothed sum (1: the last block alone)
        half_life = tuning.block_half_life
        self._block_weight = 1.0 - 0.5 ** (1.0 / half_life) if half_life else 1.0
        self._regression_decay = 0.5 ** (1.0 / tuning.regression_half_life)  # a step's
        # the persistence fit (module docstring): weighted pairs and their sums x, y, xx, xy
        self._pairs = [0.0] * 5
        self.decision_lag = decision_lag
        self._fit_start = 0  # the row the next step's pairs start from (modulo the batch)
        # exponentially weighted predicted and realised accepted drafts over full blocks, each
        # starting from prior_blocks blocks of one accepted draft predicted and realised
        self._predicted = self._realised = tuning.prior_blocks
        self.step = 0  # the clock: survivals observed at a step, estimates aged by it
        # request id -> (sum of its smoothed K survivals, the step it was last observed at,
        # with decision_lag 2 its smoothed sum before its newest block: what the decision
        # about its next block read, None before a second block)
        self._survival_sums: dict[str, tuple[float, int, float | None]] = {}
        # with keep_vectors, each request's smoothed survivals per position [K] too (kept only
        # then), as rows of one array
        self.keep_vectors = keep_vectors
        self.vectors = SurvivalVectors(draft_len, self._block_weight)
        # the running requests as the scheduler reports them joining and leaving (running());
        # while no block is observed their sum is kept by groups, not passed over (RunningSums)
        self._running: dict[str, None] = {}
        self._observations = 0  # observe() calls: the evidence changes only there
        self._sums: RunningSums | None = None
        self._passed_at = -1  # the observe() count at running_sum's last pass over the rows

    def observe(
        self,
        request_ids: list[str],
        confidence_logits: torch.Tensor,  # [R, K] raw (host)
        greedy: list[bool],
        num_accepted: list[int] | None = None,  # per window, with verify_len: recalibration
        verify_len: list[int] | None = None,
    ) -> None:
        """After a speculative step's sync: each window's raw confidences and what it kept."""
        a = host_survivals(confidence_logits.float(), greedy, self.temperatures)
        self.observe_survivals(request_ids, a, num_accepted, verify_len)

    def observe_survivals(
        self,
        request_ids: list[str],
        a: np.ndarray,  # [R, K] calibrated survivals (float64)
        num_accepted: list[int] | None = None,
        verify_len: list[int] | None = None,
    ) -> None:
        """observe() from the survivals the engine computed once for the step
        (SpecStepOutput.survivals)."""
        self._observations += 1
        sums = np.add.reduce(a, axis=-1).tolist()  # (a.sum(-1) less its Python-level wrapper)
        if num_accepted is not None and verify_len is not None:
            self._fit_persistence(request_ids, num_accepted, verify_len)  # (estimates before)
        w, step, rows = self._block_weight, self.step, self._survival_sums
        lagged = self.decision_lag == 2
        for rid, total in zip(request_ids, sums, strict=True):  # (hundreds of rows a step)
            row = rows.get(rid)
            if row is None:
                rows[rid] = (total, step, None)
                continue
            before = row[0]
            rows[rid] = (before + w * (total - before), step, before if lagged else row[2])
        observed = sum(sums)
        decay = self._decay ** len(sums)
        self._population_sum = self._population_sum * decay + observed
        if sums:
            self._population_step = self.step
        if self.keep_vectors:
            self.vectors.observe(request_ids, a, decay, step)
        self._population_blocks = self._population_blocks * decay + len(sums)
        if num_accepted is None or verify_len is None:
            return
        uncensored = verify_len.count(self.draft_len)
        if uncensored == len(verify_len):  # every block uncensored (the usual step)
            predicted, realised = observed, sum(num_accepted)
        else:  # (the uncensored blocks' sums, in order: no per-row Python)
            full = list(map(eq, verify_len, repeat(self.draft_len)))
            predicted, realised = sum(compress(sums, full)), sum(compress(num_accepted, full))
        decay = self._decay**uncensored
        self._predicted = self._predicted * decay + predicted
        self._realised = self._realised * decay + realised

    def _fit_persistence(
        self, request_ids: list[str], num_accepted: list[int], verify_len: list[int]
    ) -> None:
        """observe()'s pairs into the persistence fit: (the row's recalibrated estimate the
        decision that launched its block read, the drafts the block kept; module docstring),
        for uncensored blocks of rows that had an estimate then. At most
        persistence_pairs_per_step rows a step, from a start that rotates with each call: a
        large batch gives far more pairs than the fit needs, and observe() runs after every
        drafting step (at 256 rows, pairs from every row doubled its cost)."""
        r = len(request_ids)
        if not r:
            return
        scale, k = self.correction, self.draft_len
        rows, read = self._survival_sums, 2 if self.decision_lag == 2 else 0  # (the sum then)
        start, most = self._fit_start, self.tuning.persistence_pairs_per_step
        self._fit_start += most
        n = sx = sy = sxx = sxy = 0.0
        for i in range(r):
            j = (start + i) % r
            if verify_len[j] != k:
                continue
            row = rows.get(request_ids[j])
            before = None if row is None else row[read]
            if before is None:
                continue
            x, y = min(k, scale * before), num_accepted[j]
            n, sx, sy, sxx, sxy = n + 1, sx + x, sy + y, sxx + x * x, sxy + x * y
            if n == most:
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
        if n < self.tuning.min_persistence_blocks:
            return 1.0
        var = sxx / n - (sx / n) ** 2
        if var < 1e-3:  # (every estimate alike: no slope to read)
            return 1.0
        return min(1.0, max(0.0, (sxy / n - sx * sy / n**2) / var))

    @property
    def correction(self) -> float:
        """Realised / predicted accepted drafts over recent full blocks (1 with no evidence)."""
        return self._realised / self._predicted

    def running(self, request_id: str, joined: bool) -> None:
        """The scheduler's report: a request joined the running set (admitted, or re-admitted
        after preemption) or left it (preempted, finished, aborted)."""
        if (request_id in self._running) == joined:
            return  # (no change: a report twice over moves nothing)
        if joined:
            self._running[request_id] = None
        else:
            del self._running[request_id]
        if self._sums is not None:
            self._sums.moved(request_id, joined)

    def forget(self, request_id: str) -> None:
        if self._sums is not None and request_id in self._running:
            self._sums.moved(request_id, False)  # (it counts as never observed from now)
            self._survival_sums.pop(request_id, None)
            self._sums.moved(request_id, True)
        self._survival_sums.pop(request_id, None)
        self.vectors.forget(request_id)

    @property
    def _earlier_sums(self) -> dict[str, float]:
        """With decision_lag 2: request id -> its smoothed sum before its newest block (a view
        of _survival_sums, for inspection)."""
        return {rid: row[2] for rid, row in self._survival_sums.items() if row[2] is not None}

    def estimate_totals(
        self, request_ids: list[str], fresh_since: int
    ) -> tuple[list[float], list[int]]:
        """Each request's estimated survival sum, and its kind: FRESH, STALE (last observed
        before step fresh_since) or UNSEEN.

        A fresh row's estimate is its smoothed sum, its distance from the population mean
        scaled by the measured persistence rho and halved every regression_half_life steps of
        age (module docstring), once the population has min_population_blocks blocks of
        evidence (before that, toward K, what an unseen row then counts); stale rows count K,
        unseen ones the population's mean while its newest block is fresh (an unseen row
        priced by a stale population counts K and is reported STALE).

        (Called before every step: plain floats, no numpy; running_sum's pass over the rows
        computes the estimates alone, _totals.)
        """
        unseen = STALE if self._population_step < fresh_since else UNSEEN
        kinds = [unseen if seen is None else STALE if seen[1] < fresh_since else FRESH
                 for seen in map(self._survival_sums.get, request_ids)]  # fmt: skip
        return self._totals(request_ids, fresh_since), kinds

    def _totals(self, request_ids: list[str], fresh_since: int) -> list[float]:
        """estimate_totals' estimates, without their kinds."""
        scale, k, mean = self.correction, self.draft_len, self.population_mean()
        target = float(k) if mean is None else mean  # (no population yet: what unseen counts)
        # (an unseen row counts unobserved_sum(), the target, or K while the population is stale)
        unseen = float(k) if self._population_step < fresh_since else target
        decay, rho = self._regression_decay, self.persistence
        step, stale = self.step, float(k)
        totals = []
        estimate = totals.append
        for seen in map(self._survival_sums.get, request_ids):
            if seen is None:
                estimate(unseen)
            elif seen[1] < fresh_since:
                estimate(stale)
            else:
                own = scale * seen[0]
                estimate(target + ((k if own > k else own) - target) * rho
                         * decay ** (step - seen[1]))  # fmt: skip
        return totals

    def running_sum(self, request_ids: list[str], fresh_since: int) -> float:
        """sum(estimate_totals(request_ids, fresh_since)[0]). While no block is observed
        (drafting off) the sum comes from RunningSums, built at the second call after an
        observe() and then moved only by the requests the scheduler reports joining and
        leaving: no pass over the rows. When the reported running set is not the size of
        request_ids (a report went missing), the pass over the rows."""
        sums = self._sums
        if len(self._running) == len(request_ids):
            if sums is not None and sums.observations == self._observations:
                return sums.total(fresh_since)
            if self._passed_at == self._observations:  # a second call with no observe between:
                self._sums = RunningSums(self)  # drafting is off, build the groups once
                return self._sums.total(fresh_since)
        # (after an observe the pass costs less than building the groups, and drafting steps
        # observe before every call: the groups pay only once drafting stops)
        self._sums, self._passed_at = None, self._observations
        return sum(self._totals(request_ids, fresh_since))

    def estimate_vectors(
        self, request_ids: list[str], fresh_since: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[R, K] the requests' lagged survivals per position, with their totals and kinds
        ([R] each: estimate_totals', as arrays). Each row's vector (its own, the population's
        for a request that never drafted, FLAT when stale or without evidence) is rescaled to
        the row's total and clipped to 1. Computed over the rows' slots at once
        (SurvivalVectors): a fresh row's smoothed sum is its vector's sum.

          K 2, fresh row [0.9, 0.3] (sum 1.2) with total 1.5 -> [1.0 (1.125 clipped), 0.375]
        """
        k, vectors, step = self.draft_len, self.vectors, self.step
        mean = self.population_mean()
        target = float(k) if mean is None else mean  # (no population yet: what unseen counts)
        slots = vectors.slots(request_ids)
        observed = slots >= 0
        seen = vectors.seen[slots]  # (slot -1: the last row's, masked below)
        fresh = observed & (seen >= fresh_since)
        unseen = ~observed & (self._population_step >= fresh_since)  # (else it counts K, STALE)
        kinds = np.where(fresh, FRESH, np.where(unseen, UNSEEN, STALE))
        own = np.minimum(k, self.correction * vectors.rows[slots].sum(axis=1))
        pull = self.persistence * self._regression_decay ** np.where(fresh, step - seen, 0)
        totals = np.where(fresh, target + (own - target) * pull, np.where(unseen, target, k))
        population = POPULATION if mean is not None else FLAT
        shapes = vectors.rows[np.where(fresh, slots, np.where(unseen, population, FLAT))]
        mass = shapes.sum(axis=1, keepdims=True)
        scale = totals[:, None] / np.where(mass > 0, mass, 1.0)
        rows = np.where(mass > 0, shapes * scale, totals[:, None] / k)
        return np.minimum(1.0, rows), totals, kinds

    def population_mean(self) -> float | None:
        """The recent requests' recalibrated mean survival sum per block (exponentially
        weighted over observed blocks), or None before min_population_blocks blocks."""
        if self._population_blocks < self.tuning.min_population_blocks:
            return None
        return min(self.draft_len, self.correction * self._population_sum / self._population_blocks)

    def unobserved_sum(self) -> float:
        """What a request that never drafted counts: the recent requests' recalibrated mean
        survival sum, or K before there is enough evidence."""
        mean = self.population_mean()
        return float(self.draft_len) if mean is None else mean


class RunningSums:
    """The running requests' estimate_totals between two observe() calls, by groups.

    Between observations a fresh row's estimate target + c (decay ^ (step - seen)) changes only
    with the clock, where c = (min(scale own, K) - target) rho is fixed: the rows last observed
    at the same step s sum to rows_s target + (their c summed) decay ^ (step - s), or rows_s K
    once s < fresh_since (stale); requests never observed count the population's mean each (K
    while the population is stale), as estimate_totals prices them. A request that joins or
    leaves moves one group's count and sum.

      observed at steps {a: 10, b: 10, c: 12}, never: {d}; step 14, fresh_since 11
      -> group 10 stale: 2 K; group 12: target + c_c decay^2; d: the population's mean
    """

    def __init__(self, estimates: SurvivalEstimates) -> None:
        self.estimates, self.observations = estimates, estimates._observations
        mean = estimates.population_mean()
        self.target = float(estimates.draft_len) if mean is None else mean
        self.unseen = estimates.unobserved_sum()
        self.scale, self.rho = estimates.correction, estimates.persistence
        self.groups: dict[int, list] = {}  # seen step -> [rows, their c summed]
        self.num_unseen = 0
        for rid in estimates._running:
            self.moved(rid, True)

    def total(self, fresh_since: int) -> float:
        est, k = self.estimates, float(self.estimates.draft_len)
        unseen = self.unseen if est._population_step >= fresh_since else k
        total = self.num_unseen * unseen
        decay, step = est._regression_decay, est.step
        for seen_step, (rows, c_sum) in self.groups.items():
            if seen_step < fresh_since:
                total += rows * k
            else:
                total += rows * self.target + c_sum * decay ** (step - seen_step)
        return total

    def moved(self, rid: str, joined: bool) -> None:
        seen = self.estimates._survival_sums.get(rid)
        if seen is None:
            self.num_unseen += 1 if joined else -1
            return
        k = self.estimates.draft_len
        own = self.scale * seen[0]
        c = ((k if own > k else own) - self.target) * self.rho
        group = self.groups.setdefault(seen[1], [0, 0.0])
        group[0] += 1 if joined else -1
        group[1] += c if joined else -c
        if not group[0]:
            del self.groups[seen[1]]
