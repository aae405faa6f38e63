"""The outcome model: how likely each result (k accepted, bonus token) of the verification in flight is.

One law serves every fan-out (geometric and calibrated, one prompt and batches):

    P(k, bonus) = P(k) * P(bonus | k)

- P(k), k = 0..g, from per-position acceptance probabilities taken as independent (`length_probs`): the same
  rate at every position (the geometric fan-out), the draft's confidence at each (the calibrated one,
  predictor.py), or the measured rate per position (the scheduler, costs.py);
- P(bonus | k): the draft's distribution at the position after the k accepted tokens, without the candidate the
  target rejected there (k < g), renormalised over the draft's recorded top tokens (`bonus_probs`). Sampling
  draws the bonus from the residual max(p - q, 0), which the draft cannot see; its own distribution stands in.

The fan-outs differ only in how a budget of branches is spent: per k by fixed counts (`predict_outcomes`), or
overall by probability (`rank_outcomes`). Exactness never depends on any of this: it only chooses what to
pre-draft.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

TopProbs = tuple[torch.Tensor, torch.Tensor]  # the draft's top probabilities and their token ids, likeliest first


@dataclass(frozen=True)
class Outcome:
    """One verification result: `accepted` draft tokens kept, then the target's `bonus` token."""

    accepted: int
    bonus: int
    prob: float = 0.0  # the speculator's estimate: truncation, the cache's hit mass and its capacity rule


def length_probs(p_accept: Sequence[float]) -> list[float]:
    """P(exactly k of g drafted tokens accepted), k = 0..g, where position j + 1 is accepted with `p_accept[j]`
    once the ones before it were: p_1 ... p_k (1 - p_{k+1}) for k < g, p_1 ... p_g for k = g."""
    probs, run = [], 1.0
    for p in p_accept:
        p = min(max(p, 0.0), 1.0)
        probs.append(run * (1.0 - p))
        run *= p
    probs.append(run)
    return probs


def bonus_probs(top: TopProbs, rejected: int | None = None, limit: int | None = None) -> list[tuple[float, int]]:
    """P(bonus | k) over the draft's top tokens at the bonus's position, likeliest first: without `rejected`
    (the candidate the target rejected there; None after the last candidate), renormalised over what is left;
    the first `limit` of them. Lists, not tensor ops: a job calls this for every k of every row (30-40 times at
    B = 8) before its first step, on a thread whose Python holds the interpreter lock the verifying caller needs."""
    probs, ids = top[0].tolist(), top[1].tolist()
    if rejected in ids:
        at = ids.index(rejected)
        del probs[at], ids[at]
    mass = sum(probs) or 1.0
    n = len(ids) if limit is None else min(limit, len(ids))
    return [(probs[i] / mass, ids[i]) for i in range(n)]


def bonus_rank(top: TopProbs, rejected: int | None, bonus: int) -> int | None:
    """Where the target's `bonus` ranked among the draft's top tokens there (`rejected` skipped), or None: not
    among them. The scheduler's hit rates of every budget follow from these ranks (`CostModel.add_rank`)."""
    ids = [t for t in top[1].tolist() if t != rejected]
    return ids.index(bonus) if bonus in ids else None


def placeholder_top(top: TopProbs) -> TopProbs:
    """A top list with `top`'s probabilities and ids no token has: it sizes the k = g share of a job's budget
    before the draft's distribution after the last candidate is known (its tokens fill that share once read)."""
    values, ids = top
    return values, -1 - torch.arange(len(ids))


def _scored(candidates: list[int], tops: list[TopProbs], pk: list[float], k: int, limit: int):
    """(P(k, bonus), k, bonus) of the `limit` likeliest bonuses after k accepted."""
    rejected = candidates[k] if k < len(candidates) else None
    return [(pk[k] * p, k, t) for p, t in bonus_probs(tops[k], rejected, limit)]


def predict_outcomes(candidates: list[int], tops: list[TopProbs], fanout: list[int], alpha: float,
                     max_outcomes: int) -> list[Outcome]:
    """The geometric fan-out's outcomes of verifying `candidates`: per k, the `fanout[k]` likeliest bonuses, with
    P(k) at the same acceptance rate `alpha` at every position; the `max_outcomes` likeliest of them, likeliest
    first. `tops[j]` is the draft's at the position predicting candidate j + 1 (`tops[g]`: after the last)."""
    g = len(candidates)
    pk = length_probs([alpha] * g)
    scored = []
    for k in range(g + 1):
        want = fanout[k] if k < len(fanout) else 0
        if want > 0 and pk[k] > 0.0:
            scored += _scored(candidates, tops, pk, k, want)
    scored.sort(key=lambda x: -x[0])
    return [Outcome(k, int(t), p) for p, k, t in scored[:max_outcomes]]


def rank_outcomes(candidates: list[int], tops: list[TopProbs], pk: list[float], budget: int) -> list[Outcome]:
    """The calibrated fan-out's outcomes: the `budget` likeliest (k, bonus) overall under `pk` (P(k), k = 0..g),
    likeliest first, with one hedge against a P(k) sharper than the truth: when the budget covers every k, each
    k first gets its likeliest bonus, and the rest goes by probability overall. A miss costs a whole fallback
    draft; on the tiny pair of the simulated-device harness this floor (with the length prior mixed into pk,
    `predictor.hedged_length_probs`) took the hit rate of budget 8 from 0.76 to 0.91 and of 16 from 0.89 to 0.97
    (docs/scheduling.md, "Outcome ranking")."""
    if budget <= 0:
        return []
    firsts, scored = [], []
    for k in range(len(candidates) + 1):
        if pk[k] > 0.0:
            # The draft's top list is sorted: only its first `budget` entries can make the overall top `budget`.
            ranked = _scored(candidates, tops, pk, k, budget)
            firsts += ranked[:1]
            scored += ranked[1:]
    if len(firsts) > budget:  # too small a budget for one outcome per k: by probability alone
        scored, firsts = scored + firsts, []
    chosen = firsts + heapq.nlargest(budget - len(firsts), scored, key=lambda x: x[0])
    chosen.sort(key=lambda x: -x[0])
    return [Outcome(k, int(t), p) for p, k, t in chosen]
