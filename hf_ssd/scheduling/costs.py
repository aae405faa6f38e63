"""Online cost measurements for the scheduler, kept per (target, draft, device) across `generate` calls.

Everything is measured on the caller's thread from timestamps the generator takes anyway (the speculation job
hands its own timings back with its results), and decays exponentially so the estimates follow a machine
whose load changes. Nothing here affects what is proposed; it only informs the choice of option.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import threading
import weakref

from ..speculation.outcomes import length_probs

MAX_POSITION = 32  # per-position acceptance is tracked for draft positions 1..MAX_POSITION (later ones: the last)
POSITION_DECAY = 0.95
POSITION_PRIOR = 2.0
CONFIDENCE_BINS = 20
CONFIDENCE_DECAY = 0.97
NEW_CALL_KEEP = 0.5  # weight of earlier calls' acceptance statistics when a new call starts
# ... at most this many rounds' worth (position 1's count): prompts differ (the real pair on HumanEval + GSM
# prompts: 0% to 89% per call), so a call's own first drafted rounds must outweigh what the calls before showed.
CALL_PRIOR_ROUNDS = 2.0
CALL_HISTORY = 16  # calls whose own acceptance `call_acceptances` keeps (schedule.Scheduler.trial_pays)
MISS_PRIOR = 2.0  # predicted misses a budget's own miss ratio needs to outweigh the pooled one
# Rounds a budget's own overhead needs to outweigh the mean over all budgets (`overhead_for(beside=True)`): beside
# the verify a job's critical-path time is mostly waits of a few ms in some rounds, and seven rounds' worth of them
# (the decay) differed by 1-1.5 ms between budgets whose rounds' medians differed by 0.1 (simulated device, B = 8).
OVERHEAD_PRIOR = 4.0
# The verify's slowdown beside a speculation job (`CostModel.interference`) under which the hardware counts as idle
# for the job (`idle_beside_jobs`), so that the early verdict's overrule may trust the model's wider fan-outs
# (loop/batch.py) and a job's width costs the critical path only its waits (`overhead_for`): the simulated device
# (forwards that sleep) measured 1.00-1.04 at B = 2-8, the real pair on CPU cores 1.5 at B = 4.
OVERLAP_IDLE = 1.15
STATE_FORMAT = 1  # of `CostModel.state_dict()`; a saved state of another format is not loaded


def _num(value) -> float:
    """A saved estimate as a finite float (anything else: ValueError, so that a damaged state is refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"not a finite number: {value!r}")
    return float(value)


def _nums(values, length: int | None = None) -> list[float]:
    if not isinstance(values, list) or (length is not None and len(values) != length):
        raise ValueError(f"expected a list of {length} numbers, got {values!r:.80}")
    return [_num(v) for v in values]


class Ewma:
    """Exponentially weighted mean with a prior worth `prior_weight` observations."""

    def __init__(self, prior: float | None = None, prior_weight: float = 1.0, decay: float = 0.9):
        self.decay = decay
        self.weight = prior_weight if prior is not None else 0.0
        self.total = (prior or 0.0) * self.weight
        self.count = 0  # real observations

    def update(self, value: float) -> None:
        self.weight = self.decay * self.weight + 1.0
        self.total = self.decay * self.total + value
        self.count += 1

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None

    def state_dict(self) -> dict:
        return {"weight": self.weight, "total": self.total, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        weight, total, count = _num(state["weight"]), _num(state["total"]), int(state["count"])
        self.weight, self.total, self.count = weight, total, count


class LinearFit:
    """Weighted least squares y = a + b x with forgetting, b >= 0.

    With a single x value seen so far the slope is unknown: `prior_slope(mean_x, mean_y)` supplies it
    (e.g. proportional for sequential draft steps, a small relative slope for a memory-bound verify).
    """

    def __init__(self, prior_slope, decay: float = 0.95):
        self.prior_slope = prior_slope
        self.decay = decay
        self.w = self.wx = self.wxx = self.wy = self.wxy = 0.0
        self.count = 0

    def update(self, x: float, y: float) -> None:
        d = self.decay
        self.w, self.wx, self.wxx = d * self.w + 1.0, d * self.wx + x, d * self.wxx + x * x
        self.wy, self.wxy = d * self.wy + y, d * self.wxy + x * y
        self.count += 1

    def state_dict(self) -> dict:
        return {"w": self.w, "wx": self.wx, "wxx": self.wxx, "wy": self.wy, "wxy": self.wxy, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        sums = [_num(state[k]) for k in ("w", "wx", "wxx", "wy", "wxy")]
        count = int(state["count"])
        self.w, self.wx, self.wxx, self.wy, self.wxy = sums
        self.count = count

    def predict(self, x: float) -> float | None:
        if self.w <= 0:
            return None
        mx, my = self.wx / self.w, self.wy / self.w
        var = self.wxx / self.w - mx * mx
        if var > 0.1:
            slope = max(0.0, (self.wxy / self.w - mx * my) / var)
            if my - slope * mx < 0.0 and self.wxx > 0:
                # A negative time at x = 0 (e.g. one slow long draft on a loaded machine steepens the slope):
                # fit through the origin instead, so that short drafts do not look free.
                return max(1e-6, self.wxy / self.wxx * x)
        else:
            slope = self.prior_slope(mx, my)
        return max(1e-6, my + slope * (x - mx))


class PointFit:
    """A cost that need not be linear in x: the measured mean at each whole x seen, the linear fit elsewhere.

    Why: on CPU a forward's time is not linear in its number of rows. With torch's float32 kernels there a
    forward over 2-3 token rows can take two to three times one row and 5-8 rows less than 3 (the matrix
    products switch kernels), so a line through verify times of 5-8 candidates rated the one-row AR step
    twice its real cost. Once x has been measured its own (decayed) mean answers; a fractional x interpolates
    between its neighbours.
    """

    def __init__(self, prior_slope, decay: float = 0.95, point_decay: float = 0.8):
        self.line = LinearFit(prior_slope, decay)
        self.point_decay = point_decay
        self.points: dict[int, Ewma] = {}

    @property
    def count(self) -> int:
        return self.line.count

    def update(self, x: float, y: float) -> None:
        self.line.update(x, y)
        if x == int(x):
            self.points.setdefault(int(x), Ewma(decay=self.point_decay)).update(y)

    def state_dict(self) -> dict:
        return {"line": self.line.state_dict(), "points": {str(x): e.state_dict() for x, e in self.points.items()}}

    def load_state_dict(self, state: dict) -> None:
        line = LinearFit(self.line.prior_slope, self.line.decay)
        line.load_state_dict(state["line"])
        points = {}
        for x, e in state["points"].items():
            points[int(x)] = Ewma(decay=self.point_decay)
            points[int(x)].load_state_dict(e)
        self.line, self.points = line, points

    def _at(self, x: int) -> float | None:
        point = self.points.get(x)
        return point.value if point is not None else self.line.predict(x)

    def predict(self, x: float) -> float | None:
        lo = math.floor(x)
        if x == lo:
            return self._at(lo)
        a, b = self._at(lo), self._at(lo + 1)
        return None if a is None or b is None else a + (x - lo) * (b - a)


def _proportional(mx: float, my: float) -> float:
    return my / mx if mx > 0 else 0.0


def _relative(rate: float):
    return lambda mx, my: rate * my / (1.0 + rate * mx)


def _locked(method):
    """Updates of a CostModel hold its lock: one pair's model is shared by every call on the pair, concurrent
    calls on several threads included, and `Scheduler.decide` iterates its tables under the same lock."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return locked


MIN_TRIED = 1e-3  # the least weight a new call leaves the scalar acceptance's counts (`CostModel.new_call`)


class CostModel:
    """Measured costs of one (target, draft, device, layout, mode) combination. All times in seconds.

    - `verify_alone(n)`: target time per round (verify n candidates + the loop) with no speculator running.
    - `verify_overlapped[b](n)`: the same while a speculation job of fan-out budget b runs (interference).
    - `draft(n)`: drafting n tokens sequentially on the critical path (plain SD, miss fallbacks).
    - `verify_alone_with[t]`, `draft_with[t]`: the same two at t torch threads where the scheduler tries fewer
      threads than the default (a CPU shared with other work can run faster on one thread than on two).
    - `tree_step(w)`: one batched pre-draft step over w branches, as the background job measures it.
    - `record`: the job's time before its first branch step (one prompt: its outcome-prediction forward; a
      batch: copying the rows for its branches); `overhead[b]`: critical-path time a job of budget b
      adds to the next round besides drafting (waiting for its current step, adopting a branch; with
      layout "inline" the whole job).
    - `ranks`: where the target's bonus token ranked among the draft's top tokens (the last cell: not among
      them), from which the hit rate of any fan-out budget is predicted; `misses[b]` / `expected_misses[b]`
      calibrate that prediction against the measured misses of budget b (`miss_ratio`).
    - `acceptance`: per-token acceptance rate.
    - `position_tried[j]` / `position_accepted[j]`: per draft position j (1-based), decayed counts of rounds
      that drafted at least j tokens and accepted the first j - 1 (tried), and of those that accepted j too:
      P(accept j | accepted j - 1), from which `expected_tokens(n)` and `length_probs(g)` follow (rounds whose
      draft length was chosen by a confidence stop are left out: they select confident prefixes).
    - `confidence_seen[i]` / `confidence_accepted[i]`: a histogram, by the draft's probability of its own top
      token (CONFIDENCE_BINS bins), of drafted positions whose prefix was accepted, and how many of them the
      target accepted; it models the confidence-stopped SD options for any threshold (`confidence_model`).
    - Batches (loop/batch.py) also keep, per batch size: `plain_step`, a step of plain batched decoding (the
      target's own loop, plain.py); `loop_speedup`, per loop call, plain's time for its output (its steps at
      `plain_step`) over the loop's time after the prefill, judged once loop calls add up to enough chosen steps
      (`loop_pending`: plain's seconds, the loop's and the steps of calls not yet judged);
      `draft_prefill(tokens)`, the draft's prompt prefill, which plain decoding never pays; `plain_streak`, plain
      calls in a row; `plain_verdict`, the last verdict made before the loop was judged at the size;
      `straggle`, per loop call, its time after the prefill over its longest row's n tokens at its rounds' rate (a
      mean over each round's live rows), less 1, times sqrt(n): a call lasts until its slowest row ends, and
      where rows gain tokens at random the slowest lags by about sqrt(n) rounds (`straggle_at(n)`).
    """

    def __init__(self, on_gpu: bool, top_k: int, initial_acceptance: float):
        self.on_gpu = on_gpu
        self.verify_alone = PointFit(_relative(0.02))
        self.verify_overlapped: dict[int, PointFit] = {}
        self.draft = LinearFit(_proportional)
        self.verify_alone_with: dict[int, PointFit] = {}
        self.draft_with: dict[int, LinearFit] = {}
        # A batched step over more branches costs more on CPU cores, nearly nothing more on a GPU (prior only).
        self.tree_step = PointFit(_relative(0.02 if on_gpu else 0.25))
        self.record = Ewma()
        self.overhead: dict[int, Ewma] = {}
        self.top_k = top_k
        # Prior: the bonus is usually the draft's first choice, sometimes its second (worth ~5 rounds).
        self.ranks = [0.0] * (top_k + 1)
        self.ranks[0], self.ranks[1], self.ranks[top_k] = 3.0, 1.0, 1.0
        self.rank_decay = 0.98
        self.misses: dict[int, float] = {}
        self.expected_misses: dict[int, float] = {}
        self.accepted = initial_acceptance * 4.0
        self.tried = 4.0
        # Undecayed totals (accepted, tried) and their values when the running call started: each call's own
        # acceptance joins `call_acceptances` when the next one starts.
        self.totals = (0.0, 0.0)
        self.call_start = (0.0, 0.0)
        self.call_acceptances: collections.deque = collections.deque(maxlen=CALL_HISTORY)
        self.positions = [0.0] * (MAX_POSITION + 1)  # index j: rounds that tried position j (1-based)
        self.positions_accepted = [0.0] * (MAX_POSITION + 1)
        self.confidence_seen = [0.0] * CONFIDENCE_BINS
        self.confidence_accepted = [0.0] * CONFIDENCE_BINS
        self.rounds_seen = 0
        self.plain_step = Ewma(decay=0.95)
        self.loop_speedup = Ewma(decay=0.7)
        self.draft_prefill = LinearFit(_proportional)
        self.plain_streak = 0
        self.plain_verdict: bool | None = None  # the last early verdict (loop/batch.py `BatchPlan.plain`)
        self.loop_pending = (0.0, 0.0, 0.0)
        self.straggle = Ewma(decay=0.7)
        # The warm-up (schedule.Scheduler.warmup_fits): the target's prompt prefill by tokens, the seconds of
        # rounds run on this pair, and, until the draft's own costs are measured, its cost per token read as a
        # share of the target's (`cost_model_for` sets it from parameter counts) and a step's time.
        self.prefill = LinearFit(_proportional)
        self.work_s = 0.0
        self.draft_share = 0.5
        self.draft_step_hint: float | None = None  # a draft step as its probe timed it (probe.step_seconds)
        # Per option: decayed sums of (rounds, measured tokens, predicted tokens, measured s, predicted s)
        # over its rounds, which correct what the model gets wrong about it (e.g. acceptance that is not
        # independent per position, costs that are not linear).
        self.outcomes: dict[object, list[float]] = {}
        # Held by every update (`_locked`) and by whoever reads several estimates as one view (`decide`, a job's
        # set-up, `snapshot`). Reentrant: a reader holding it may call methods that take it again.
        self.lock = threading.RLock()
        self._memo: dict | None = None  # see `frozen`

    # ----- updates ------------------------------------------------------------------------------------------
    @_locked
    def new_call(self, keep: float = NEW_CALL_KEEP) -> None:
        """A new generate call is new text: what earlier calls showed about acceptance (scalar, per position,
        by confidence) keeps only `keep` of its weight, the first two at most CALL_PRIOR_ROUNDS rounds' worth,
        so the new prompt's rounds soon dominate. Costs (times) are properties of the machine and keep theirs.
        The call before's own acceptance joins `call_acceptances`."""
        tried = self.totals[1] - self.call_start[1]
        if tried > 0:
            self.call_acceptances.append((self.totals[0] - self.call_start[0]) / tried)
        self.call_start = self.totals
        # P(accept | the draft's confidence) is the draft's calibration, less a property of the text: it keeps
        # `keep` of its weight.
        self.confidence_seen = [keep * c for c in self.confidence_seen]
        self.confidence_accepted = [keep * c for c in self.confidence_accepted]
        if self.positions[1] > 0:
            keep = min(keep, CALL_PRIOR_ROUNDS / self.positions[1])
        # Never to nothing: calls that verify no candidate (AR, a draft-less fallback) would shrink the scalar's
        # counts to zero over hundreds of calls (a batch of one's first round, its prompt's, verifies none).
        scalar = max(keep, min(1.0, MIN_TRIED / self.tried)) if self.tried > 0 else keep
        self.accepted, self.tried = scalar * self.accepted, scalar * self.tried
        self.positions = [keep * c for c in self.positions]
        self.positions_accepted = [keep * c for c in self.positions_accepted]

    @_locked
    def add_verified(self, rows: list[tuple[int, int, bool | None]], by_position: bool = True) -> None:
        """One verified round: (accepted, proposed, next_kept) per row (one prompt: one row). `by_position`: the
        draft lengths were not chosen from the draft's confidence (a confidence stop selects confident prefixes).

        The counts decay once a round, not once a row: the text drifts by rounds, and decaying per row left a
        batch of 8 rows about 2.5 rounds of memory, so the deep positions (tried only by rows that accepted
        every position before them) held under one round's counts and read as the prior.
        `next_kept` (greedy, every candidate accepted, the draft's top token after them known): whether that
        token is the target's bonus, i.e. whether a draft one token longer would have kept it too. Without it
        the position after the running gamma is never measured, and its prior (the scalar acceptance, lower
        than acceptance after an accepted prefix) holds the scheduler at that gamma."""
        rows = [r for r in rows if r[1] > 0]
        if not rows:
            return
        self.accepted, self.tried = 0.95 * self.accepted, 0.95 * self.tried
        for accepted, proposed, _ in rows:
            self.accepted += accepted
            self.tried += min(proposed, accepted + 1)
            self.totals = (self.totals[0] + accepted, self.totals[1] + min(proposed, accepted + 1))
        if not by_position:
            return
        d = POSITION_DECAY
        self.positions = [d * c for c in self.positions]
        self.positions_accepted = [d * c for c in self.positions_accepted]
        for accepted, proposed, next_kept in rows:
            for j in range(1, min(proposed, accepted + 1, MAX_POSITION) + 1):
                self.positions[j] += 1.0
                self.positions_accepted[j] += float(j <= accepted)
            if next_kept is not None and accepted == proposed:
                self.add_next_kept(proposed + 1, next_kept)

    @_locked
    def add_next_kept(self, position: int, kept: bool) -> None:
        """Whether the draft's next token after a wholly accepted draft of `position` - 1 tokens would have been
        kept (greedy: it is the target's bonus), counted at `position` in the round's counts (`add_verified`,
        which one prompt's generator calls before it reads the draft's tokens after its candidates)."""
        if position <= MAX_POSITION:
            self.positions[position] += 1.0
            self.positions_accepted[position] += float(kept)

    @_locked
    def add_confidence(self, rows: list[tuple[list[float], int]]) -> None:
        """One verified round: per row (one prompt: one row), the draft's top probability at each candidate
        position and the accepted count.

        Positions up to the first rejection are known (accepted before it, rejected at it); later ones are not
        counted (nothing says whether the target would have kept them). The counts decay once a round, not once
        a row, as in `add_verified`: a batch's rows would otherwise shorten the memory by its size."""
        rows = [r for r in rows if r[0]]
        if not rows:
            return
        d = CONFIDENCE_DECAY
        self.confidence_seen = [d * c for c in self.confidence_seen]
        self.confidence_accepted = [d * c for c in self.confidence_accepted]
        for confidences, accepted in rows:
            for j, q in enumerate(confidences[: accepted + 1]):
                i = min(CONFIDENCE_BINS - 1, max(0, int(q * CONFIDENCE_BINS)))
                self.confidence_seen[i] += 1.0
                self.confidence_accepted[i] += float(j < accepted)

    @_locked
    def add_rank(self, rank: int | None) -> None:
        self.ranks = [c * self.rank_decay for c in self.ranks]
        self.ranks[self.top_k if rank is None or rank >= self.top_k else rank] += 1.0

    def add_lookup(self, budget: int, hit: bool, predicted: float) -> None:
        self.add_lookups(budget, [(hit, predicted)])

    @_locked
    def add_lookups(self, budget: int, lookups: list[tuple[bool, float]]) -> None:
        """One round's lookups (hit, predicted P(hit)), one per row: the counts decay once a round, so that a batch
        keeps as many rounds of them as one prompt does. (Decayed per lookup, a batch of 8 kept about 2.5 rounds:
        on the simulated device b = 8 missed 10% of its lookups against 3.4% for b = 16, while the model, its own
        misses outweighed by the prior, rated both 0.987.)"""
        if not lookups:
            return
        self.misses[budget] = 0.95 * self.misses.get(budget, 0.0) + sum(not hit for hit, _ in lookups)
        self.expected_misses[budget] = (0.95 * self.expected_misses.get(budget, 0.0)
                                        + sum(1.0 - predicted for _, predicted in lookups))

    @_locked
    def add_verify(self, n: int, seconds: float, budget: int | None, threads: int = 0) -> None:
        if threads:
            self.verify_alone_with.setdefault(threads, PointFit(_relative(0.02))).update(n, seconds)
        elif budget is None:
            self.verify_alone.update(n, seconds)
        else:
            self.verify_overlapped.setdefault(budget, PointFit(_relative(0.02))).update(n, seconds)

    @_locked
    def add_round_outcome(self, option, tokens: int, seconds: float, predicted) -> None:
        sums = self.outcomes.setdefault(option, [0.0] * 5)
        for i, v in enumerate((1.0, tokens, predicted.tokens, seconds, predicted.seconds)):
            sums[i] = 0.9 * sums[i] + v

    def correction(self, option, prior_rounds: float = 3.0) -> tuple[float, float]:
        """(measured / predicted tokens, measured / predicted seconds) over this option's rounds.

        Shrunk towards 1 by `prior_rounds` rounds that went as predicted, so one odd round moves little. (Pooling
        the ratios over a family of options was tried: a few unlucky rounds then locked a whole family out
        while a less measured one kept its optimistic model; see docs/scheduling.md.)"""
        sums = self.outcomes.get(option)
        if sums is None or sums[2] <= 0 or sums[4] <= 0:
            return 1.0, 1.0
        weight, tokens, pred_tokens, seconds, pred_seconds = sums
        t_prior, s_prior = prior_rounds * pred_tokens / weight, prior_rounds * pred_seconds / weight
        return (tokens + t_prior) / (pred_tokens + t_prior), (seconds + s_prior) / (pred_seconds + s_prior)

    def measured_rate(self, option, toward: float | None = None, prior_rounds: float = 3.0) -> float:
        """Tokens a row per second over this option's own rounds (decayed as `correction`'s sums), 0 if none;
        `toward` given: shrunk towards that rate by `prior_rounds` rounds of the option's mean length that ran at
        it, so that one lucky round does not rate an option (the first tokens of an answer are the easiest)."""
        sums = self.outcomes.get(option)
        if sums is None or sums[3] <= 0:
            return 0.0
        rate = sums[1] / sums[3]
        return rate if toward is None else self.shrunk_rate(option, rate, toward, prior_rounds)

    def shrunk_rate(self, option, rate: float, toward: float, prior_rounds: float = 3.0) -> float:
        """`rate` as `measured_rate(option, toward)` reads it where the option's own rounds ran at that rate: a
        prediction compared with a shrunk measurement is shrunk alike (`toward` where none ran)."""
        sums = self.outcomes.get(option)
        if sums is None or sums[3] <= 0:
            return toward
        weight, _, _, seconds, _ = sums
        prior_s = prior_rounds * seconds / weight
        return (rate * seconds + prior_s * toward) / (seconds + prior_s)

    @_locked
    def add_record(self, seconds: float) -> None:
        self.record.update(seconds)

    @_locked
    def add_tree_step(self, width: int, seconds: float) -> None:
        self.tree_step.update(width, seconds)

    @_locked
    def add_plain_step(self, seconds: float) -> None:
        self.plain_step.update(seconds)

    @_locked
    def add_loop_call(self, plain_s: float, loop_s: float, steps: float, min_steps: float) -> None:
        """A loop call's chosen rounds: plain's time for their output, theirs, and plain's steps for it. One short
        call is weak evidence (a few rounds, the job's start and stop), so calls add up until they hold
        `min_steps` steps; then their speedup is recorded."""
        p, t, n = (a + b for a, b in zip(self.loop_pending, (plain_s, loop_s, steps)))
        if n >= min_steps and t > 0:
            self.loop_speedup.update(p / t)
            p = t = n = 0.0
        self.loop_pending = (p, t, n)

    @_locked
    def add_straggle(self, ratio: float, tokens: int) -> None:
        self.straggle.update((ratio - 1.0) * math.sqrt(tokens))

    def straggle_at(self, tokens: int) -> float:
        """A loop call's predicted time over its longest row's `tokens` at its rounds' rate (1: none measured).
        Real pair at B = 4: 1.21 in 16-token calls, 1.08-1.34 in 64-token ones."""
        if not self.straggle.count or tokens <= 0:
            return 1.0
        return 1.0 + self.straggle.value / math.sqrt(tokens)

    @_locked
    def add_draft_prefill(self, tokens: int, seconds: float) -> None:
        self.draft_prefill.update(tokens, seconds)

    @_locked
    def add_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.update(tokens, seconds)

    @_locked
    def add_round(self, seconds: float = 0.0) -> None:
        self.rounds_seen += 1
        self.work_s += seconds

    def call_tried(self) -> float:
        """Drafted tokens verified since the running call started (`add_verified`'s `tried`)."""
        return self.totals[1] - self.call_start[1]

    @property
    def drafted(self) -> bool:
        """Whether any drafting was measured on this pair (the warm-up is over)."""
        return bool(self.draft.count or self.draft_with or self.verify_overlapped or self.tree_step.count)

    @_locked
    def add_overhead(self, budget: int, seconds: float) -> None:
        self.overhead.setdefault(budget, Ewma(decay=0.85)).update(seconds)

    # ----- estimates ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def frozen(self):
        """While the estimates cannot change (the caller holds `lock`): the per-position tables that every
        option's prediction reads are computed once (`Scheduler.decide` predicts ~90 options a round, on the
        critical path)."""
        self._memo = {}
        try:
            yield self
        finally:
            self._memo = None

    def memoized(self, key, compute):
        memo = self._memo
        if memo is None:
            return compute()
        value = memo.get(key)
        if value is None:
            value = memo[key] = compute()
        return value

    @property
    def acceptance(self) -> float:
        return min(max(self.accepted / self.tried, 0.0), 0.995)

    def position_acceptance(self, j: int) -> float:
        """P(accept position j | accepted j - 1), j 1-based: measured counts with a prior of POSITION_PRIOR
        rounds at the scalar acceptance (what an unseen position gets)."""
        if j > MAX_POSITION:
            j = MAX_POSITION
        return self.memoized(("p", j), lambda: min(0.995, (self.positions_accepted[j] + POSITION_PRIOR * self.acceptance)
                                                    / (self.positions[j] + POSITION_PRIOR)))

    def expected_tokens(self, n: float) -> float:
        """E(n) = 1 + sum_{j<=n} prod_{i<=j} p_i: expected new tokens (accepted prefix + bonus) of a round
        verifying n drafted tokens, with p_i the measured per-position acceptance (a fractional n
        interpolates)."""
        return self.memoized(("e", n), lambda: self._expected_tokens(n))

    def _expected_tokens(self, n: float) -> float:
        total, run = 1.0, 1.0
        whole = int(n)
        for j in range(1, whole + 1):
            run *= self.position_acceptance(j)
            total += run
        if n > whole:
            total += (n - whole) * run * self.position_acceptance(whole + 1)
        return total

    def length_probs(self, g: int) -> list[float]:
        """P(exactly k of g drafted tokens accepted), k = 0..g, from the per-position acceptance (not to be
        modified: it may be shared)."""
        return self.memoized(("l", g), lambda: self._length_probs(g))

    def _length_probs(self, g: int) -> list[float]:
        return length_probs([self.position_acceptance(j) for j in range(1, g + 1)])

    def confidence_model(self, threshold: float, cap: int, rows: int = 1) -> tuple[float, float]:
        """(expected drafted tokens, expected new tokens a row) of plain SD that drafts up to `cap` tokens and stops
        after the first whose top probability is below `threshold`; with `rows` > 1 the drafted tokens are the
        batch's: its steps go on until every row has stopped, P(some row drafts position j) = 1 - (1 - r^(j-1))^rows.

        From the confidence histogram: r = P(top probability >= threshold) at a position, a_hi / a_lo =
        acceptance of positions at / below it (each with a prior of 2 positions: r = 1 - threshold, a_hi = the
        scalar acceptance, a_lo = half of it). Position j is drafted when the j - 1 before it were all
        confident: P = r^(j-1), so the drafted count is sum_{j<cap} r^j; it yields a token when the j - 1
        before it were confident and accepted and it is accepted: (r a_hi)^(j-1) (r a_hi + (1 - r) a_lo), so
        E = 1 + m sum_{j<cap} (r a_hi)^j with m = r a_hi + (1 - r) a_lo. Assumes positions independent given
        their confidence."""
        cut = min(CONFIDENCE_BINS, max(0, int(round(threshold * CONFIDENCE_BINS))))
        seen_hi, seen_lo = sum(self.confidence_seen[cut:]), sum(self.confidence_seen[:cut])
        acc_hi, acc_lo = sum(self.confidence_accepted[cut:]), sum(self.confidence_accepted[:cut])
        a = self.acceptance
        w = 2.0
        r = (seen_hi + w * (1.0 - threshold)) / (seen_hi + seen_lo + w)
        a_hi = (acc_hi + w * a) / (seen_hi + w)
        a_lo = (acc_lo + w * 0.5 * a) / (seen_lo + w)
        m = r * a_hi + (1.0 - r) * a_lo
        drafted = sum(1.0 - (1.0 - r**j) ** rows for j in range(cap))
        tokens = 1.0 + m * sum((r * a_hi) ** j for j in range(cap))
        return drafted, tokens

    def coverage(self, f: int) -> float:
        """P(the bonus is among the draft's f most likely tokens): the hit chance of f branches at one k."""
        def compute():
            total = sum(self.ranks)
            return sum(self.ranks[: min(f, self.top_k)]) / total if total > 0 else 0.0

        return self.memoized(("c", f), compute)

    def miss_ratio(self, budget: int) -> float:
        """Measured misses over the model's predicted misses for this budget.

        Misses, not hits: where hits are near certain their ratio cannot tell budgets apart, while one miss in
        twenty against one predicted in fifty is a factor 2.5 that says what a wider fan-out is worth. Shrunk
        towards the ratio pooled over all budgets (by MISS_PRIOR predicted misses), so that a budget measured
        in a few rounds, or never, takes the model's shape scaled by what the others showed.
        """
        pooled = (sum(self.misses.values()) + MISS_PRIOR) / (sum(self.expected_misses.values()) + MISS_PRIOR)
        return (self.misses.get(budget, 0.0) + MISS_PRIOR * pooled) / (self.expected_misses.get(budget, 0.0)
                                                                      + MISS_PRIOR)

    @staticmethod
    def _nearest_key(table: dict, budget: int):
        if budget in table:
            return budget
        if not table:
            return None
        return min(table, key=lambda b: (abs(math.log2(max(b, 1)) - math.log2(max(budget, 1))), b))

    def _nearest(self, table: dict, budget: int):
        key = self._nearest_key(table, budget)
        return None if key is None else table[key]

    @_locked
    def add_draft(self, n: int, seconds: float, threads: int = 0) -> None:
        (self.draft_with.setdefault(threads, LinearFit(_proportional)) if threads else self.draft).update(n, seconds)

    def draft_time(self, n: int, threads: int = 0) -> float | None:
        if threads:
            fit = self.draft_with.get(threads)
            return fit.predict(n) if fit is not None else None
        return self.memoized(("d", n), lambda: self.draft.predict(n))

    def verify(self, n: int, budget: int | None, threads: int = 0) -> float | None:
        alone = self.verify_alone.predict(n)
        if threads:
            fit = self.verify_alone_with.get(threads)
            if fit is None or not fit.points or n in fit.points or alone is None:
                return fit.predict(n) if fit is not None else None
            # A length not measured at this thread count: the call's own threads' curve, at the ratio measured
            # at the nearest length. Its line would extrapolate AR steps (the rounds that run while the draft
            # lags) by a prior slope, and on CPU cores verifying 16 tokens on one thread costs far more than that
            # slope says: SD on one thread looked faster than on two and ran 1.5x slower (the real pair).
            near = min(fit.points, key=lambda x: abs(x - n))
            base = self.verify_alone.predict(near)
            return fit.predict(n) if not base else alone * fit.points[near].value / base
        if budget is None:
            if alone is None:  # only overlapped rounds seen: the cheapest of them bounds it from above
                seen = [f.predict(n) for f in self.verify_overlapped.values() if f.count]
                return min(seen) if seen else None
            return alone
        fit = self._nearest(self.verify_overlapped, budget)
        if fit is not None and (budget in self.verify_overlapped or alone is None):
            return fit.predict(n)
        if fit is not None and alone is not None:
            # Unmeasured budget: assume the interference ratio of the nearest measured one.
            return alone * max(1.0, fit.predict(n) / max(self.verify_alone.predict(n), 1e-9))
        return alone

    def interference(self) -> float | None:
        """The verify's slowdown measured beside a speculation job: its time overlapped over its time alone, at
        the candidate counts measured both ways, the largest over the budgets measured (None before any)."""
        ratios = [fit.points[n].value / alone for fit in self.verify_overlapped.values() for n in fit.points
                  if n in self.verify_alone.points and (alone := self.verify_alone.points[n].value)]
        return max(ratios, default=None)

    def idle_beside_jobs(self) -> bool:
        """Whether the jobs measured left the verify as fast as alone (within OVERLAP_IDLE; not measured: no)."""
        interference = self.interference()
        return interference is not None and interference <= OVERLAP_IDLE

    def overhead_for(self, budget: int, beside: bool = False) -> float:
        """Critical-path seconds a job of this budget adds to a round: the nearest budget measured. A job `beside`
        the verify (not inline) on hardware it leaves idle (`idle_beside_jobs`) costs it only waits whatever its
        width: shrunk towards the mean over all budgets by OVERHEAD_PRIOR rounds. (On CPU cores a wider job's steps
        are longer, and so is the wait for its last one: each budget keeps its own.)"""
        e = self._nearest(self.overhead, budget)
        if e is None or e.value is None:
            return 0.0
        if not (beside and self.memoized(("idle",), self.idle_beside_jobs)):  # a decision asks per option
            return e.value
        measured = [x for x in self.overhead.values() if x.weight > 0]
        mean = sum(x.total for x in measured) / sum(x.weight for x in measured)
        return (e.total + OVERHEAD_PRIOR * mean) / (e.weight + OVERHEAD_PRIOR)

    @_locked
    def snapshot(self, gamma: int, budgets: list[int]) -> dict:
        """The measured model at draft length gamma, for stats and `hf-ssd tune` (seconds)."""
        def r(x):
            return None if x is None else round(x, 6)

        return {
            "acceptance": round(self.acceptance, 4),
            "verify_s": {n: r(self.verify(n, None)) for n in sorted({0, 1, gamma})},
            "verify_overlapped_s": {b: r(self.verify(gamma, b)) for b in budgets},
            "draft_s": {n: r(self.draft.predict(n)) for n in sorted({1, gamma})},
            "tree_step_s": {b: r(self.tree_step.predict(b)) for b in budgets},
            "record_s": r(self.record.value),
            "overhead_s": {b: r(self.overhead_for(b)) for b in budgets},
            "bonus_in_top": {f: round(self.coverage(f), 4) for f in (1, 2, 4, 8) if f <= self.top_k},
            "miss_ratio": {b: round(self.miss_ratio(b), 3) for b in budgets},
            "rounds_seen": self.rounds_seen,
        }

    # ----- saving and loading (hf_ssd/scheduling/profile.py keeps them across processes) --------------------------------
    profile: str | None = None  # the tuning profile these estimates were loaded from (hf_ssd.scheduling.profile), if any

    def state_dict(self) -> dict:
        """Every measured estimate the scheduler reads, as plain JSON-able data (the caller holds `lock`).

        Priors and decay rates are not part of it: they come from the code. `load_state_dict` of the result on
        a new model of the same `top_k` and device kind makes it predict, and decide, exactly as this one."""
        def table(d: dict) -> dict:
            return {str(k): v.state_dict() for k, v in d.items()}

        return {
            "format": STATE_FORMAT, "on_gpu": self.on_gpu, "top_k": self.top_k,
            "verify_alone": self.verify_alone.state_dict(), "verify_overlapped": table(self.verify_overlapped),
            "draft": self.draft.state_dict(), "verify_alone_with": table(self.verify_alone_with),
            "draft_with": table(self.draft_with), "tree_step": self.tree_step.state_dict(),
            "record": self.record.state_dict(), "overhead": table(self.overhead),
            "ranks": list(self.ranks),
            "misses": {str(b): v for b, v in self.misses.items()},
            "expected_misses": {str(b): v for b, v in self.expected_misses.items()},
            "accepted": self.accepted, "tried": self.tried,
            "positions": list(self.positions), "positions_accepted": list(self.positions_accepted),
            "confidence_seen": list(self.confidence_seen), "confidence_accepted": list(self.confidence_accepted),
            "rounds_seen": self.rounds_seen,
            "plain_step": self.plain_step.state_dict(), "loop_speedup": self.loop_speedup.state_dict(),
            "straggle": self.straggle.state_dict(),
            "draft_prefill": self.draft_prefill.state_dict(), "prefill": self.prefill.state_dict(),
            "call_acceptances": list(self.call_acceptances),
            # Options are frozen dataclasses (schedule.Option): saved by their fields.
            "outcomes": [[dataclasses.asdict(o), list(v)] for o, v in self.outcomes.items()
                         if dataclasses.is_dataclass(o)],
        }

    def load_state_dict(self, state: dict) -> None:
        """Replace the estimates by a saved `state_dict()`. A state of another format, `top_k` or device kind,
        or a damaged one, raises ValueError and leaves this model as it was."""
        from .schedule import Option  # schedule imports this module

        try:
            if state.get("format") != STATE_FORMAT:
                raise ValueError(f"state format {state.get('format')!r}, expected {STATE_FORMAT}")
            if state["top_k"] != self.top_k or bool(state["on_gpu"]) != self.on_gpu:
                raise ValueError(f"state of top_k {state['top_k']} on_gpu {state['on_gpu']}, this model has "
                                 f"top_k {self.top_k} on_gpu {self.on_gpu}")

            def fit(value, make):
                f = make()
                f.load_state_dict(value)
                return f

            def table(d: dict, make) -> dict:
                return {int(k): fit(v, make) for k, v in d.items()}

            def point():
                return PointFit(_relative(0.02))

            new = {
                "verify_alone": fit(state["verify_alone"], lambda: PointFit(_relative(0.02))),
                "verify_overlapped": table(state["verify_overlapped"], point),
                "draft": fit(state["draft"], lambda: LinearFit(_proportional)),
                "verify_alone_with": table(state["verify_alone_with"], point),
                "draft_with": table(state["draft_with"], lambda: LinearFit(_proportional)),
                "tree_step": fit(state["tree_step"], lambda: PointFit(_relative(0.02 if self.on_gpu else 0.25))),
                "record": fit(state["record"], Ewma),
                "overhead": table(state["overhead"], lambda: Ewma(decay=0.85)),
                "ranks": _nums(state["ranks"], self.top_k + 1),
                "misses": {int(b): _num(v) for b, v in state["misses"].items()},
                "expected_misses": {int(b): _num(v) for b, v in state["expected_misses"].items()},
                "accepted": _num(state["accepted"]), "tried": _num(state["tried"]),
                "positions": _nums(state["positions"], MAX_POSITION + 1),
                "positions_accepted": _nums(state["positions_accepted"], MAX_POSITION + 1),
                "confidence_seen": _nums(state["confidence_seen"], CONFIDENCE_BINS),
                "confidence_accepted": _nums(state["confidence_accepted"], CONFIDENCE_BINS),
                "rounds_seen": int(state["rounds_seen"]),
                # Batch measurements came later: a profile saved without them loads with none.
                "plain_step": fit(state.get("plain_step", Ewma().state_dict()), lambda: Ewma(decay=0.95)),
                "loop_speedup": fit(state.get("loop_speedup", Ewma().state_dict()), lambda: Ewma(decay=0.7)),
                "straggle": fit(state.get("straggle", Ewma().state_dict()), lambda: Ewma(decay=0.7)),
                "draft_prefill": fit(state.get("draft_prefill", LinearFit(_proportional).state_dict()),
                                     lambda: LinearFit(_proportional)),
                "prefill": fit(state.get("prefill", LinearFit(_proportional).state_dict()),
                               lambda: LinearFit(_proportional)),
                "outcomes": {Option(**o): _nums(v, 5) for o, v in state["outcomes"]},
                "call_acceptances": collections.deque(
                    (_num(a) for a in state.get("call_acceptances", [])[-CALL_HISTORY:]), maxlen=CALL_HISTORY),
            }
            if new["tried"] <= 0 or new["rounds_seen"] < 0:
                raise ValueError("no acceptance counts")
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"damaged cost model state: {type(err).__name__}: {err}") from err
        for name, value in new.items():
            setattr(self, name, value)
        self._memo = None


_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {key: CostModel}
_models_lock = threading.Lock()


def cost_model_for(target, draft, device, layout: str, do_sample: bool, top_k: int,
                   initial_acceptance: float, draft_matmul: str = "auto", verify_matmul: str = "auto") -> CostModel:
    """The estimates of this pair on this device, created on first use; a second call starts informed.

    Keyed on the target object (weakly: they go with it) and the draft's identity, device, layout, mode
    (acceptance differs between greedy and sampling), `draft_matmul` (it changes the draft's step times) and
    `verify_matmul` (the verify's).
    The draft is held by id only, so a new draft that reuses a freed one's id inherits its estimates; that
    costs at most some exploration, never exactness.

    A model created here for the first time in a process starts from the pair's saved tuning profile where one
    matches (`hf_ssd.scheduling.profile`: written by `hf-ssd tune`; HF_SSD_NO_PROFILE=1 ignores it).
    """
    key = (id(draft), str(device), layout, bool(do_sample), top_k, draft_matmul, verify_matmul)
    with _models_lock:
        per_target = _models.setdefault(target, {})
        model = per_target.get(key)
        if model is None:
            model = per_target[key] = CostModel(getattr(device, "type", str(device)) == "cuda", top_k,
                                                initial_acceptance)
            model.draft_share = _parameter_share(draft, target)
            from . import profile  # it reads the models' weights and files: only on a model's first use

            profile.attach(model, target, draft, layout, bool(do_sample), top_k, draft_matmul, verify_matmul)
        return model


def _parameter_share(draft, target) -> float:
    """The draft's parameters over the target's: a forward's cost per token scales about so at batch 1."""
    def count(m):
        return sum(p.numel() for p in m.parameters()) if hasattr(m, "parameters") else 0
    d, t = count(draft), count(target)
    return min(1.0, d / t) if d and t else 0.5


def estimates_of(target, draft) -> list[tuple[tuple, CostModel]]:
    """The (key, CostModel) pairs kept for this target and draft (see `cost_model_for` for the key)."""
    with _models_lock:
        return [(k, m) for k, m in _models.get(target, {}).items() if k[0] == id(draft)]


def reset_estimates(target=None) -> None:
    """Forget measured costs (of one target, or all): the next call explores from the priors again."""
    with _models_lock:
        if target is None:
            _models.clear()
        else:
            _models.pop(target, None)
