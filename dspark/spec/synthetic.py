"""Synthetic acceptance, a benchmark mode (`dspark bench` / `dspark profile` only): the target
and the drafter run their real forwards on the real ragged layouts, in the captured graphs, but
which drafts survive follows a given profile instead of the target's judgement, so scheduling
can be measured at target sizes whose trained weights are not at hand (random weights of
Qwen3-8B's shapes accept nothing), with the acceptance of a drafter that exists.

A profile is conditional rates c_1 .. c_K: draft k is kept with probability c_k given drafts
1 .. k-1 were kept. The chance of keeping at least k drafts is the survival s_k = c_1 ... c_k,
and a full window of K drafts emits tau = 1 + s_1 + ... + s_K tokens on average:

  c = [0.8, 0.5]        s = [0.8, 0.4]        tau = 2.2

On the device, after the real verification (whose work is kept, so its cost is measured):
  accepted   draft k of row r is kept iff u(seed_r ^ profile seed, position of draft k,
             STREAM_SYNTHETIC) < c_k, left to right, stopping at the first miss and at
             verify_len: a counter-based draw, so a window's fate depends only on its request's
             seed and its positions (reproducible, independent of batch mates).
  final      the target's argmax at the first unkept position (or after the last draft): the
             token a greedy target would emit there. The text is not the model's (random
             weights, overridden acceptance): the mode is refused wherever a user gets text.
  confidence the confidence head's logits are replaced by T_k logit(c_k) (T_k: the row's STS
             temperature), so the calibrated survival the policy and the trimmed cells read is
             exactly s: the policy sees the confidences of a drafter calibrated to the profile.

Off (the default) the decoder holds None and none of this is in the step or its graphs.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass

import torch

from dspark.sample.random import STREAM_SYNTHETIC, uniform
from dspark.spec.verifier import VerifyOutput

# named profiles, conditional rates per position (block 7)
PROFILES = {
    # Qwen3-8B's released DSpark drafter in the paper: tau about 6.2 on GSM8K, 3.7 on
    # MT-Bench, block 7 (the rates' shape, declining along the block, is assumed; their tau is
    # the paper's: 6.20 and 3.72)
    "qwen3-8b-gsm8k": (0.96, 0.94, 0.92, 0.90, 0.89, 0.88, 0.87),
    "qwen3-8b-mtbench": (0.83, 0.77, 0.74, 0.70, 0.67, 0.64, 0.61),
    # the shipped SmolLM2 drafter, measured on gsm8k at T = 0 (docs/DRAFTER.md): tau 3.55
    "smollm2": (0.77, 0.78, 0.74, 0.72, 0.65, 0.64, 0.59),
}
# synthetic acceptance keeps drafts by a profile, not by the target: text
# made that way is not the model's, so no API that returns text takes it
SYNTHETIC_REFUSED = (
    "synthetic_acceptance is a benchmark mode (`dspark bench` / `dspark profile "
    "--synthetic-acceptance`): its drafts are kept by a profile, not the target, so its text "
    "is not the model's; LLM, dspark generate and dspark serve refuse it"
)
# the largest K a result's summary gives the expected tau for (the released drafters' block)
MAX_SUMMARY_K = 8
# rates are clipped this far inside (0, 1) where they become confidence logits (finite)
LOGIT_EPS = 1e-6


@dataclass(frozen=True)
class SyntheticAcceptance:
    rates: tuple[float, ...]  # c_1 .. c_n; positions past n take c_n
    seed: int = 0  # mixed into every request's seed: another seed, other draws
    name: str | None = None  # the named profile, None for a list of rates

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> SyntheticAcceptance:
        """A named profile (PROFILES) or comma-separated rates in [0, 1], e.g. "0.9,0.8"."""
        if text in PROFILES:
            return cls(PROFILES[text], seed, text)
        try:
            rates = tuple(float(x) for x in text.split(","))
        except ValueError:
            rates = ()
        if not rates or not all(0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"synthetic acceptance {text!r}: give one of {sorted(PROFILES)} or "
                             "comma-separated conditional rates in [0, 1]")  # fmt: skip
        return cls(rates, seed)

    def rates_for(self, k: int) -> list[float]:
        """c_1 .. c_k (the last rate repeated past the profile's end)."""
        return [self.rates[min(i, len(self.rates) - 1)] for i in range(k)]

    def survival(self, k: int) -> list[float]:
        """s_1 .. s_k: the chance of keeping at least j drafts, j = 1 .. k."""
        return list(itertools.accumulate(self.rates_for(k), operator.mul))

    def expected_tau(self, k: int) -> float:
        """Tokens a full window of k drafts emits on average: 1 + s_1 + ... + s_k."""
        return 1.0 + sum(self.survival(k))

    def record(self, k: int) -> dict:
        """What an engine's metrics under this mode say about it, at its K."""
        return {"profile": self.name or "rates", "rates": self.rates_for(k), "seed": self.seed,
                "expected_tau": round(self.expected_tau(k), 4)}  # fmt: skip

    def summary(self) -> dict:
        """What a result file says about the mode before K is known (each arm has its own):
        the rates as given and the expected tau at each K up to MAX_SUMMARY_K."""
        taus = {str(k): round(self.expected_tau(k), 4) for k in range(1, MAX_SUMMARY_K + 1)}
        return {
            "profile": self.name or "rates",
            "rates": list(self.rates),
            "seed": self.seed,
            "expected_tau_by_k": taus,
        }

    def device_rates(self, k: int, device: torch.device) -> torch.Tensor:
        """c_1 .. c_k on the device, made once (a captured step cannot copy from the host)."""
        return torch.tensor(self.rates_for(k), dtype=torch.float32, device=device)

    def unit_logits(self, k: int, device: torch.device) -> torch.Tensor:
        """logit(c_1) .. logit(c_k) on the device (rates clipped by LOGIT_EPS): a row's
        confidence logits are these times its STS temperatures (synthetic_confidence_logits)."""
        rates = [min(max(c, LOGIT_EPS), 1.0 - LOGIT_EPS) for c in self.rates_for(k)]
        return torch.tensor([math.log(c / (1.0 - c)) for c in rates], dtype=torch.float32,
                            device=device)  # fmt: skip


def synthetic_verify(
    rates: torch.Tensor,  # [K] c_1 .. c_K (SyntheticAcceptance.device_rates)
    seed: int,  # the profile's seed
    window_logits: torch.Tensor,  # [Tw, V] the target's logits at every window token
    draft_tokens: torch.Tensor,  # [R, K]
    verify_len: torch.Tensor,  # [R] 0 .. K
    cu_num_tokens: torch.Tensor,  # [R + 1] window starts in window_logits
    seeds: torch.Tensor,  # [R] int64, the requests' seeds
    anchor_positions: torch.Tensor,  # [R]
) -> VerifyOutput:
    """The window's kept drafts drawn from the profile, the final token the target's argmax
    after them (module docstring); shape-static, so it runs inside a captured step."""
    R, K = draft_tokens.shape
    dev = draft_tokens.device
    slots = torch.arange(K, device=dev)  # [K]
    positions = anchor_positions[:, None] + 1 + slots[None, :]  # [R, K] each draft's position
    mixed = (seeds ^ seed).repeat_interleave(K)  # [R K]
    coins = uniform(mixed, positions.reshape(-1), STREAM_SYNTHETIC).view(R, K)
    keep = (coins < rates[None, :]) & (slots[None, :] < verify_len[:, None])  # [R, K]
    num_accepted = (~keep).cumsum(dim=1).eq(0).sum(dim=1)  # [R] the kept prefix
    final_row = (cu_num_tokens[:-1] + num_accepted).clamp(max=window_logits.shape[0] - 1)
    final = window_logits[final_row].argmax(dim=-1)  # [R]
    tokens = torch.where(slots[None, :] < num_accepted[:, None], draft_tokens, 0)
    tokens = torch.cat([tokens, torch.zeros_like(tokens[:, :1])], dim=1)  # [R, K + 1]
    tokens.scatter_(1, num_accepted[:, None], final[:, None])
    return VerifyOutput(tokens, num_accepted)


def synthetic_confidence_logits(
    unit_logits: torch.Tensor,  # [D] logit(c_k) (SyntheticAcceptance.unit_logits)
    temperatures: torch.Tensor,  # [R, D] each row's STS temperatures (greedy rows: greedy fit)
) -> torch.Tensor:  # [R, D] raw logits whose calibrated survival is the profile's
    """T_k logit(c_k): sigmoid(logit / T_k) = c_k, so survival = cumprod(c) = s."""
    return temperatures * unit_logits[None, :]
