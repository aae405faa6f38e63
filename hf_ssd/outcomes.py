"""Outcome prediction: the likely results (k accepted, bonus token) of the verification in flight."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fanout import acceptance_length_probs


@dataclass(frozen=True)
class Outcome:
    """One verification result: `accepted` draft tokens kept, then the target's `bonus` token."""

    accepted: int
    bonus: int
    prob: float = 0.0  # the speculator's estimate, used for truncation and probability eviction


def predict_outcomes(
    candidates: list[int],
    next_probs: list[tuple[torch.Tensor, torch.Tensor]],
    fanout: list[int],
    alpha: float,
    max_outcomes: int,
) -> list[Outcome]:
    """Rank the outcomes of verifying `candidates` (g tokens).

    `next_probs[j]` is the draft's (top probabilities, token ids) at the position predicting candidate j + 1,
    and `next_probs[g]` the one after the last candidate. For k < g the bonus token is the target's
    replacement of a rejected candidate, so the drafted token itself is skipped there. Each outcome's
    probability is P(k) times the draft's renormalised probability of the bonus; the `max_outcomes` most
    likely are returned, most likely first.
    """
    g = len(candidates)
    length_probs = acceptance_length_probs(alpha, g)
    outcomes: list[Outcome] = []
    for k in range(g + 1):
        want = fanout[k] if k < len(fanout) else 0
        if want <= 0 or length_probs[k] <= 0.0:
            continue
        values, ids = next_probs[k]
        values, ids = values.tolist(), ids.tolist()
        excluded = candidates[k] if k < g else None
        mass = sum(v for v, t in zip(values, ids) if t != excluded) or 1.0
        taken = 0
        for v, t in zip(values, ids):
            if t == excluded:
                continue
            if taken == want:
                break
            outcomes.append(Outcome(k, int(t), length_probs[k] * v / mass))
            taken += 1
    outcomes.sort(key=lambda o: -o.prob)
    return outcomes[:max_outcomes]
