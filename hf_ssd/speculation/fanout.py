"""Fan-out: how many bonus tokens to pre-draft for each acceptance length k.

Under a per-token acceptance rate alpha, a round with g draft tokens accepts exactly k of them with probability
alpha^k (1 - alpha) for k < g and alpha^g for k = g (a geometric law). The budget is split in proportion to
those probabilities (`outcomes.length_probs`), so likely acceptance lengths get more branches.
"""

from __future__ import annotations

import math

from .outcomes import length_probs


def geometric_fanout(budget: int, alpha: float, gamma: int) -> list[int]:
    """Split `budget` over k = 0..gamma in proportion to the acceptance-length probabilities.

    Largest-remainder rounding keeps the sum equal to the budget, and, since the weights decrease for k < gamma,
    the counts never increase along k < gamma (ties in the floor go to the larger weight, i.e. the smaller k).
    """
    weights = length_probs([alpha] * gamma)
    total = sum(weights)
    if budget == 0 or total <= 0:
        return [0] * (gamma + 1)
    shares = [budget * w / total for w in weights]
    counts = [math.floor(s) for s in shares]
    left = budget - sum(counts)
    by_remainder = sorted(range(gamma + 1), key=lambda k: (-(shares[k] - counts[k]), -weights[k], k))
    for k in by_remainder[:left]:
        counts[k] += 1
    return counts


def fanout_split(fanout, budget: int, alpha: float, gamma: int) -> list[int]:
    """Bonuses to pre-draft per k = 0..gamma: an explicit `SSDConfig.fanout` list (its first gamma + 1 entries,
    zeros past its end), else the geometric split of `budget` at `alpha`."""
    if isinstance(fanout, list):
        return fanout[: gamma + 1] + [0] * max(0, gamma + 1 - len(fanout))
    return geometric_fanout(budget, alpha, gamma)
