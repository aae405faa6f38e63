"""Pipeline depth > 1: which outcomes of the round *after* the one in flight to pre-draft, and under which branch.

A branch pre-drafted for an outcome of the round being verified becomes the next round's candidates if it hits.
Its own top lists then predict that next verification, exactly as the trunk's predict the current one, so the
outcomes of the round after can be ranked before it starts, by the probability of the whole chain: the
parent's, times the child's given the parent.

- `grown_children`: while the parents are still being drafted. After a parent drafted token j, the outcome
  "first j tokens accepted, token j rejected, then bonus b" needs nothing more, so its row can join the batch
  at once and draft in the same forwards as its parent.
- `deeper_children`: once parents are complete (all gamma tokens, and the distribution after them), every
  outcome under them, "all accepted" included.

`allowed(start, k, bonus)` says whether an outcome is worth drafting at all (not EOS, not past the length limit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .fanout import geometric_fanout
from .outcomes import Outcome, bonus_probs, length_probs, predict_outcomes, rank_outcomes
from .predictor import AcceptanceCalibration, drafted_probs, hedged_length_probs

Allowed = Callable[[int, int, int], bool]


@dataclass
class Parent:
    """A drafted branch that deeper levels may pre-draft under: its chain of outcomes and probability."""

    state: object  # the drafter's BranchState
    tokens: list[int]
    prob: float
    head: tuple[int, int]  # the outcome of the round in flight it assumes
    rest: tuple[tuple[int, int, float], ...]  # the deeper outcomes (k, bonus, probability given the ones before)

    @property
    def chain(self) -> tuple:
        return (self.head,) + tuple((k, b) for k, b, _ in self.rest)


def grown_children(states, results, rows: list[Outcome], taken: int, gamma: int,
                   p_accept: Callable[[float], float], width: int, allowed: Allowed) -> list[tuple[float, int, Outcome]]:
    """(chain probability, parent row, child outcome) for the rows that just drafted a token, likeliest first,
    at most `width - taken`. `rows[r]` is the outcome row r assumes (its probability is the parent's)."""
    if taken >= width:
        return []
    scored = []
    for r, (state, result) in enumerate(zip(states, results)):
        tokens = result.tokens
        j = len(tokens) - 1
        if j < 0 or j >= gamma or state.fed != j + 1 or not allowed(state.start, j, tokens[j]):
            continue  # nothing new, a resumed row (its early positions passed), or the generation ends there
        tops = state.tops(j)
        qs = drafted_probs(tokens, tops)
        p_k = length_probs([p_accept(q) for q in qs[: j + 1]])[j]  # the first j kept, token j rejected
        for p, t in bonus_probs(tops[j], tokens[j], width):
            if allowed(state.start, j, t):
                scored.append((rows[r].prob * p_k * p, r, Outcome(j, t, p_k * p)))
    scored.sort(key=lambda c: -c[0])
    return scored[: width - taken]


def deeper_children(level: list[Parent], calibration: AcceptanceCalibration | None, alpha: float, width: int,
                    allowed: Allowed, held: Callable[[tuple], bool]) -> list[tuple[float, Parent, Outcome]]:
    """The `width` likeliest outcomes of the round after, over every complete branch of `level` (a parent's
    tokens taken as that round's candidates), skipping chains `held` already has."""
    scored = []
    for parent in level:
        g = len(parent.tokens)
        if parent.state.fed < g + 1 or not all(allowed(parent.state.start, 0, t) for t in parent.tokens):
            continue  # cut short by the outcome's arrival, or ends the generation
        tops = parent.state.tops(g)
        if calibration is not None:
            pk = hedged_length_probs(calibration, drafted_probs(parent.tokens, tops))
            outcomes = rank_outcomes(parent.tokens, tops, pk, width)
        else:
            outcomes = predict_outcomes(parent.tokens, tops, geometric_fanout(width, alpha, g), alpha, width)
        scored += [(parent.prob * o.prob, parent, o) for o in outcomes
                   if allowed(parent.state.start, o.accepted, o.bonus)
                   and not held(parent.chain + ((o.accepted, o.bonus),))]  # e.g. grown beside its parent
    scored.sort(key=lambda c: -c[0])
    return scored[:width]
