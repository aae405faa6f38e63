"""Speculation for a batch: while the target verifies a round, pre-draft the next round of every row for its
likeliest outcomes (k accepted, bonus), so that a row whose outcome was predicted (a hit) has its candidates at
once.

The job runs on the speculator's thread (speculator.py) and works on copies of the rows (`RaggedCache.gather`),
one per predicted outcome, so the draft's own rows stay as the round left them: a miss costs nothing to undo.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..fanout import geometric_fanout
from ..outcomes import Outcome, predict_outcomes
from .draft import BatchDrafter
from .ragged import RaggedCache


@dataclass
class Branch:
    """Next-round candidates of one row, pre-drafted under one outcome of this round."""

    row: int  # index among the live rows
    outcome: Outcome
    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)  # sampling: the distribution of each token
    tops: list = field(default_factory=list)  # the draft's top tokens at each of its positions


@dataclass
class Tree:
    """What a job left: the branches, the rows' copies holding them, and its own timings."""

    cache: RaggedCache | None = None
    branches: list[Branch] = field(default_factory=list)
    steps: list[tuple[int, float]] = field(default_factory=list)  # (branches, seconds) per batched step
    record_s: float | None = None

    def lookup(self, row: int, k: int, bonus: int) -> int | None:
        """Index of the branch of (row, k, bonus) holding at least one token, or None (a miss)."""
        for i, b in enumerate(self.branches):
            if b.row == row and b.outcome.accepted == k and b.outcome.bonus == bonus and b.tokens:
                return i
        return None


def speculate(drafter: BatchDrafter, rows, candidates: list[list[int]], gamma: int, budget: int, alpha: float,
              allowed: Callable[[object, Outcome], bool], tree: Tree, should_stop: Callable[[], bool]) -> None:
    """Fill `tree` with up to `budget` branches per row of `gamma` tokens each, step by step until `should_stop`."""
    t0 = time.perf_counter()
    drafter.catch_up(rows, candidates)  # the draft's distribution after each row's last token
    tree.record_s = time.perf_counter() - t0
    sources, branches = [], []
    for r, (row, c) in enumerate(zip(rows, candidates)):
        if len(row.tops) < len(c) + 1 or row.tops[len(c)] is None:
            continue
        fanout = geometric_fanout(budget, alpha, len(c))
        for o in predict_outcomes(c, row.tops[: len(c) + 1], fanout, alpha, budget):
            if allowed(row, o):
                sources.append((drafter.kv, r))
                branches.append(Branch(r, o))
    if not branches or should_stop():
        return
    kv = drafter.kv.gather(sources)
    kv.settle(torch.tensor([b.outcome.accepted for b in branches]))  # each copy keeps what its outcome accepts
    tree.cache, tree.branches = kv, branches
    # Every copy feeds its bonus, then drafts: one batched forward per step over all branches.
    token = torch.tensor([[b.outcome.bonus] for b in branches])
    pos = torch.tensor([[len(rows[b.row].real) + b.outcome.accepted] for b in branches])
    ones = torch.ones(len(branches), 1, dtype=torch.long)
    for j in range(gamma):
        if should_stop():
            break
        t = time.perf_counter()
        probs = drafter.probs(kv.forward(token, ones, pos + j, keep_last=1, tag=j)[:, -1])
        chosen, tops = drafter.choose(probs), drafter.tops(probs)
        for i, b in enumerate(branches):
            b.tokens.append(int(chosen[i]))
            b.tops.append(tops[i])
            if drafter.do_sample:
                b.q.append(probs[i])
        token = chosen[:, None]
        tree.steps.append((len(branches), time.perf_counter() - t))
