"""A calibrated acceptance estimate for the outcome model: where will the target reject?

The geometric fan-out gives every drafted position the same acceptance probability. The draft's own confidence
says more: a token it drafted with probability 0.98 is accepted far more often than one drafted at 0.4. So
P(accept at position j) is estimated as a function of q_j, the draft's probability of the token it drafted
there, by a small histogram over q calibrated online from the verifications seen so far (each bin a Beta
posterior around the acceptance prior, the same for every q: until verifications say otherwise, the predictor
ranks like the geometric law. A prior of P(accept | q) = q would be wrong for drafts whose distributions are
flat but agree with the target). P(k) follows (`hedged_length_probs`), and outcomes.py ranks the outcomes
(k, bonus) by it: `rank_outcomes`, the budget to the likeliest overall, not per k.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

from .outcomes import TopProbs, length_probs


@dataclass
class AcceptanceCalibration:
    """P(accepted | q) on `bins` equal-width bins of q in [0, 1], each a Beta(a, b) posterior.

    The prior puts `prior_weight` pseudo-observations at `prior` in every bin; observations decay by `decay`
    per verified round so that the estimate follows the text (code vs prose).
    """

    bins: int = 10
    prior: float = 0.7
    prior_weight: float = 2.0
    decay: float = 0.995
    accepted: list[float] = field(default_factory=list)
    tried: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted:
            self.accepted = [self.prior * self.prior_weight] * self.bins
            self.tried = [self.prior_weight] * self.bins
        self._lock = threading.Lock()  # observed by the caller's thread, read by the speculator's

    def _bin(self, q: float) -> int:
        return min(self.bins - 1, max(0, int(q * self.bins)))

    def p_accept(self, q: float) -> float:
        i = self._bin(q)
        with self._lock:
            return self.accepted[i] / self.tried[i]

    def observe(self, qs: list[float], accepted: int) -> None:
        """A verified round: the first `accepted` drafted tokens were accepted, the next one (if any) rejected,
        the rest never judged."""
        with self._lock:
            self.accepted = [a * self.decay for a in self.accepted]
            self.tried = [t * self.decay for t in self.tried]
            for j, q in enumerate(qs[: accepted + 1]):
                i = self._bin(q)
                self.tried[i] += 1.0
                self.accepted[i] += 1.0 if j < accepted else 0.0

    def curve(self) -> list[float]:
        with self._lock:
            return [a / t for a, t in zip(self.accepted, self.tried)]


def drafted_probs(candidates: list[int], tops: list[TopProbs]) -> list[float]:
    """q_j: the draft's probability of each drafted token (0 when it fell outside the recorded top list)."""
    if not candidates:
        return []
    # One host transfer for all positions (the static path keeps its top lists on the device).
    values = torch.stack([tops[j][0] for j in range(len(candidates))]).cpu()
    ids = torch.stack([tops[j][1] for j in range(len(candidates))]).cpu()
    match = ids == torch.tensor(candidates).unsqueeze(1)
    return (values * match).sum(dim=1).tolist()


def hedged_length_probs(calibration: AcceptanceCalibration, qs: list[float],
                        length_prior: list[float] | None = None) -> list[float]:
    """P(k accepted), k = 0..g, from the calibration at the drafted probabilities `qs`, averaged with
    `length_prior` (P(k) from the measured per-position acceptance, the same for every round) when given: a
    hedge against a P(k) sharper than the truth, since the calibration reads each round's confidences as if
    positions were independent, and one bin's estimate moves slowly."""
    pk = length_probs([calibration.p_accept(q) for q in qs])
    return pk if length_prior is None else [0.5 * (a + b) for a, b in zip(pk, length_prior, strict=True)]


# Calibrations carried across calls, per draft model (a new call on the same pair starts informed).
_carried: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_carried_lock = threading.Lock()


def calibration_for(draft_model, do_sample: bool, prior: float = 0.7) -> AcceptanceCalibration:
    """The calibration of this draft for greedy or sampled decoding (kept apart: acceptance differs); `prior`
    only applies to a draft seen for the first time."""
    with _carried_lock:
        per_model = _carried.setdefault(draft_model, {})
        if bool(do_sample) not in per_model:
            per_model[bool(do_sample)] = AcceptanceCalibration(prior=prior)
        return per_model[bool(do_sample)]
