"""Speculation for a batch: while the target verifies a round, pre-draft the next round of every row for its
likeliest outcomes (k accepted, bonus), so that a row whose outcome was predicted (a hit) has its candidates at
once.

The job runs on the speculator's thread (speculator.py) and works on copies of the rows (`RaggedCache.branch`),
one per predicted outcome, so the draft's own rows stay as the round left them: a miss costs nothing to undo.
Every step is one batched draft forward over all rows' branches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..drafting.batch import BatchDrafter
from ..drafting.matmul import setup_seconds
from ..loop.ragged import RaggedCache
from .fanout import fanout_split
from .outcomes import Outcome, placeholder_top, predict_outcomes, rank_outcomes
from .predictor import AcceptanceCalibration, drafted_probs, hedged_length_probs


@dataclass
class Branch:
    """Next-round candidates of one row, pre-drafted under one outcome of this round. The job records its steps in
    the `Tree`; a branch's tokens are read from there only when a row takes it (`Tree.take`)."""

    row: int  # index among the live rows
    outcome: Outcome
    rank: int | None = None  # a late branch (`speculate`): its bonus is the draft's rank-th top token there
    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)  # sampling: the distribution of each token
    tops: list = field(default_factory=list)  # the draft's top tokens at each of its positions


@dataclass
class Tree:
    """What a job left: the branches, the rows' copies holding them, each step's output over all copies, and its
    own timings."""

    cache: RaggedCache | None = None
    branches: list[Branch] = field(default_factory=list)
    steps: list[tuple[int, float]] = field(default_factory=list)  # (branches, seconds) per batched step
    setup_s: float | None = None  # seconds from the job's start to its first step (predicting, copying rows)
    # Its copies went into newly allocated buffers (`JobBuffers.grown`): a one-time cost (page faults: 10-40 ms at
    # 60-125 branches on the simulated device, against 2 ms into used ones) that can leave the job no step.
    grown: bool = False
    gamma: int = 0
    chosen: list[list[int]] = field(default_factory=list)  # per step: each copy's drafted token
    tops: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per step: [copies, K] top probs, ids
    probs: list[torch.Tensor] = field(default_factory=list)  # sampling, per step: [copies, V]
    index: dict | None = None  # (row, k, bonus) -> branch, built by `lookup`

    def drafted(self, i: int) -> int:
        """Tokens branch i holds (a late branch's first step chose its bonus, not a token)."""
        return max(0, min(self.gamma, len(self.chosen) - (self.branches[i].rank is not None)))

    def lookup(self, row: int, k: int, bonus: int) -> int | None:
        """Index of the branch of (row, k, bonus) holding at least one token, or None (a miss). Called once the
        job is over: the index is built at the first call (a scan per row took 0.05 ms a round at 128 branches)."""
        if self.index is None:
            self.index = {}
            for i, b in enumerate(self.branches):
                if self.drafted(i):
                    self.index.setdefault((b.row, b.outcome.accepted, b.outcome.bonus), i)
        return self.index.get((row, k, bonus))

    def take(self, i: int) -> Branch:
        """Branch i with its tokens, their distributions and the draft's tops at each, read from the steps."""
        b = self.branches[i]
        first = int(b.rank is not None)
        steps = range(first, first + self.drafted(i))
        b.tokens = [self.chosen[s][i] for s in steps]
        b.tops = [(self.tops[s][0][i], self.tops[s][1][i]) for s in steps]
        b.q = [self.probs[s][i] for s in steps] if self.probs else []
        return b


def speculate(drafter: BatchDrafter, rows, candidates: list[list[int]], gamma: int, budget: int, alpha: float,
              allowed: Callable[[object, Outcome], bool], tree: Tree, should_stop: Callable[[], bool],
              deadline: float | None = None, calibration: AcceptanceCalibration | None = None,
              priors: list[list[float]] | None = None, stage: Callable[[str], None] = lambda name: None,
              grace: Callable[[int], float] = lambda tokens: 0.0, fanout: list[int] | None = None,
              cached: list[int] = (), limit: int | None = None, started: float | None = None) -> None:
    """Fill `tree` with up to `budget` branches per row of up to `gamma` tokens each, step by step until
    `should_stop`, or until a step would end more than `grace(tokens its branches hold)` seconds after `deadline`
    (when the verification is expected to end: the caller would wait for that step; `late_grace_s` says when its
    tokens are worth the wait).

    An outcome whose bonus the draft can rank already (k below the row's drafted length: the draft's tops there)
    feeds its bonus in the first step. A row's last outcome needs the draft's distribution after its last
    candidate, which the draft has not read (for a row without candidates: after the tokens since it last
    drafted): its branches feed those tokens in the first step, take the ranked bonus from it, and feed that in
    the second, one token behind the others. A separate read before the first step would delay every branch
    by a draft forward (a quarter of the verify on an accelerator), and the job leaves the draft's own rows as
    the round left them: a miss costs nothing to undo.

    With a `calibration` (`fanout="calibrated"`) each row's budget goes to its likeliest outcomes overall
    (`rank_outcomes`), P(k) from the draft's confidence in each candidate, hedged with the row's measured law
    (`priors`, P(k) per row from the per-position acceptance); otherwise per k by the geometric split at
    `alpha`, or by the caller's `fanout` list (bonuses per k, `SSDConfig.fanout`). Either way the share of
    k = g outcomes whose bonus the draft has not ranked yet goes to late branches; `limit` keeps a row's
    likeliest that many (`SSDConfig.max_outcomes`). `cached[t]`: the bonuses a later job will hold for a
    rejection of a branch's token t (Saguaro sampling, `BatchDrafter.draw`). `stage`: called at each stage
    ("predict", then per step "draft" and "insert"; tests plant faults). `started`: when the job began (the clock
    of its `deadline`), from which `tree.setup_s` counts."""
    stage("predict")
    if drafter.kv.mask is None:  # the draft has read nothing yet (a one-token prompt skips its prefill): no rows to copy
        return
    start = time.perf_counter() if started is None else started
    picks, branches, feeds = [], [], []
    for r, (row, c) in enumerate(zip(rows, candidates)):
        pk = None
        if calibration is not None and len(row.tops) >= len(c):
            pk = hedged_length_probs(calibration, drafted_probs(c, row.tops[: len(c)]), priors[r])
        outcomes, late = _outcomes(row, c, budget, alpha, pk, fanout, limit)
        for o in outcomes:
            if allowed(row, o):
                picks.append(r)
                branches.append(Branch(r, o))
                feeds.append(([o.bonus], [len(row.real) + o.accepted]))
        unread = _unread(row, c)
        if late and unread[0] and allowed(row, Outcome(len(c), -1)):
            for rank in range(min(late, drafter.top_k)):
                picks.append(r)
                branches.append(Branch(r, Outcome(len(c), -1), rank=rank))
                feeds.append(unread)
    if not branches or should_stop():
        return
    order = drafter.kv.slot_order(picks, drafter.spare)  # each copy where the last job left one of its row
    picks, branches, feeds = [picks[i] for i in order], [branches[i] for i in order], [feeds[i] for i in order]
    # Step 0 feeds each copy's first block (right-aligned); later steps one token each, at its next position.
    # Built from lists: a tensor op per branch would hold the interpreter lock for milliseconds at 128 branches.
    width = max(len(ids) for ids, _ in feeds)
    late_at = [i for i, b in enumerate(branches) if b.rank is not None]
    steps = gamma + int(bool(late_at))  # a late branch needs one step more
    kv = drafter.kv.branch(picks, room=width + steps - 1, spare=drafter.spare)
    tree.grown = drafter.spare.grown
    kv.settle(torch.tensor([b.outcome.accepted for b in branches]))  # each copy keeps what its outcome accepts
    tree.cache, tree.branches, tree.gamma = kv, branches, gamma
    ids = torch.tensor([[drafter.pad] * (width - len(t)) + t for t, _ in feeds])
    valid = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t, _ in feeds])
    pos = torch.tensor([[0] * (width - len(t)) + at for t, at in feeds])
    late = torch.tensor([int(b.rank is not None) for b in branches])
    nxt = pos[:, -1:] + 1
    step_s = None
    tree.setup_s = time.perf_counter() - start
    # Per step only whole-tensor work: this thread's Python holds the interpreter lock the verifying caller needs.
    for j in range(steps):
        t, copied = time.perf_counter(), setup_seconds()
        if should_stop() or (deadline is not None and step_s is not None and t + step_s > deadline + grace(j)):
            break
        if j:  # a copy's step-j token is its candidate j (j - 1 for a late one); full copies feed nothing
            valid = ((j - late) < gamma).long()[:, None]
        tag = (j - late).clamp(min=0)[:, None] if j else 0
        stage("draft")
        probs = drafter.probs(kv.forward(ids, valid, pos, keep_last=1, tag=tag)[:, -1])
        held = ()
        if cached:  # Saguaro: per copy, the bonuses a later job holds for a rejection of the token it draws now
            held = [cached[t] if 0 <= t < len(cached) else 0 for t in (j - late).tolist()]
        chosen, drawn = drafter.draw(probs, held)
        top = drafter.top_table(probs)
        if j == 0 and late_at:  # the bonus of a late branch: its rank among the draft's tops
            chosen = chosen.clone()
            for i in late_at:
                b = branches[i]
                bonus = int(top[1][i, b.rank])  # `top` is on the CPU, `chosen` on the draft's device
                chosen[i] = bonus
                b.outcome = Outcome(b.outcome.accepted, bonus, b.outcome.prob)
                rows[b.row].tops[len(candidates[b.row]):] = [(top[0][i], top[1][i])]  # the round's bonus ranks here
        stage("insert")
        tree.chosen.append(chosen.tolist())
        tree.tops.append(top)
        if drafter.do_sample:
            tree.probs.append(drawn)
        step_s = time.perf_counter() - t - (setup_seconds() - copied)  # less a first one-row step's float16 copies
        tree.steps.append((len(branches), step_s))
        ids, pos, nxt = chosen[:, None], nxt, nxt + 1


def _outcomes(row, c: list[int], budget: int, alpha: float, pk: list[float] | None,
              fixed: list[int] | None = None, limit: int | None = None) -> tuple[list[Outcome], int]:
    """A row's outcomes to pre-draft now, and how many late branches (k = g, bonus ranked by the first step) to
    add when the draft has not read past its last candidate (that share sized as if its distribution there had
    the shape of the one before: `placeholder_top`). `fixed`: the user's bonuses per k (its first g + 1
    entries), else the geometric split of `budget` (or the calibrated ranking, with `pk`). `limit`
    (`SSDConfig.max_outcomes`): the likeliest this many of them, late ones included."""
    g = len(c)
    fanout = None
    if pk is None:
        fanout = fanout_split(fixed, budget, alpha, g)
        budget = sum(fanout)
    cap = budget if limit is None else min(budget, limit)
    known = g < len(row.tops) and row.tops[g] is not None
    # Nothing drafted, or candidates the draft never read (the n-gram fallback's): only k = g can be ranked.
    if len(row.tops) < g or (not known and g == 0):
        return [], cap
    tops = row.tops[: g + 1] if known else row.tops[:g] + [placeholder_top(row.tops[g - 1])]
    outcomes = predict_outcomes(c, tops, fanout, alpha, cap) if pk is None else rank_outcomes(c, tops, pk, cap)
    if known:
        return outcomes, 0
    return [o for o in outcomes if o.accepted < g], sum(o.accepted == g for o in outcomes)


def _unread(row, candidates: list[int]) -> tuple[list[int], list[int]]:
    """(tokens, positions) the draft has not read before the row's last outcome: the row's tokens since it last
    drafted, then candidates it did not feed (the last one, at least; none for a row without candidates)."""
    start, base = row.draft_fed + row.draft_feed, len(row.real)
    return (row.real[start:] + candidates[row.tagged:],
            list(range(start, base)) + list(range(base + row.tagged, base + len(candidates))))
