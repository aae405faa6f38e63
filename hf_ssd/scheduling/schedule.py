"""The scheduler: which option runs the next round, from the measured costs (docs/scheduling.md).

Options:
- `ssd(b, g)`: overlapped SSD, a speculation job with fan-out budget b pre-drafts g tokens per branch while the
  target verifies; the next round hits the cache or runs the fallback.
- `sd(g)`: plain speculative decoding: no background job, g tokens drafted on the critical path.
- `sd(g, c)`: plain SD with a confidence stop: up to g tokens, stopping after the first whose draft probability
  of its top token is below c (what transformers' default assistant does with c = 0.4).
- `ar`: no draft: the target decodes one token per round.

Every option only changes what is proposed to the target's exact verification, so switching between rounds
never changes the output. Per option, expected tokens per round E and round time T follow the SSD paper's
analysis, with the expected tokens of a draft of length g from the measured per-position acceptance
(costs.CostModel.expected_tokens) rather than the i.i.d. (1 - a^(g+1)) / (1 - a); the option with the best
E / T runs, except on exploration rounds, which try another option so that a wrong early
estimate is corrected.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import NamedTuple

from ..speculation.fanout import fanout_split
from .costs import CostModel

AUTO_BUDGETS = (1, 2, 4, 8, 16)
# Wider fan-outs pay only where a batched step over many branches costs about one branch (an idle accelerator).
# They are never explored blind: the model picks them once the measured step costs of the narrower budgets
# extrapolate to cheap wide steps (on CPU cores they extrapolate to costly ones and are never chosen).
WIDE_BUDGETS = (32, 64)
AUTO_GAMMAS = tuple(range(1, 9))
CONFIDENCE_CAP = 16  # most tokens a confidence-stopped SD round drafts
CONFIDENCE_STOPS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)  # thresholds the scheduler may pick (multiples of 0.05)
EXPLORE = 0.08  # share of rounds that try another option family while estimates are young
EXPLORE_MIN = 0.02
EXPLORE_FLOOR = 0.5  # families predicted under this share of the best rate are not explored
# Context tokens the draft may lag behind (after AR rounds, or in a call that began with AR) for a drafting
# family to be explored or a round's draft time to be measured: catching up is a prefill (the real pair on CPU:
# ~1.5 s for a 450-token prompt, 6 AR steps), which one exploring round would pay and mis-measure.
CATCH_UP_TOKENS = 64
# Context tokens a drafting round finds unread beyond which the draft reads them before it drafts, timed apart (a
# catch-up, after AR rounds or at a prompt). One or two are the round's accepted token and bonus: every round's
# first draft step reads those.
CATCH_UP_LAG = 2
LATE_GRACE = 0.5  # one prompt's job step may end this share of a step after the expected outcome (assisted.py)
FULL_EVERY = 4  # decisions between two predictions of every option
SHORTLIST = 8  # options re-predicted at the other decisions: the best of the last full pass


def late_grace_s(alpha: float, tokens: int, gamma: int, round_s: float) -> float:
    """Seconds a batch's speculation job may let a step end past the expected outcome when it brings its branches
    from `tokens` to tokens + 1 each (the caller waits for it: a step cannot be cut). It pays while the round's
    tokens grow by a larger share than its time: a hit keeps the new token with P ~ alpha^(tokens + 1), out of
    a round's sum of alpha^i, i <= tokens. The step past `gamma` grows only the late branches (k = gamma, bonus
    ranked by the job's first step), whose outcome comes with P ~ alpha^gamma. (Simulated device, B = 8,
    acceptance ~0.6: a fixed half step let a 4th step end 3.5-5.4 ms past a 40-ms verify in half the jobs,
    1.70-1.72x; no late step at all, 1.75-1.76x.)"""
    alpha = min(max(alpha, 0.0), 1.0)
    # A late branch's step j brings its j-th token (its first step chose its bonus).
    kept = alpha ** (gamma + tokens) if tokens >= gamma else alpha ** (tokens + 1)
    return round_s * kept / sum(alpha**i for i in range(min(tokens, gamma) + 1))


@dataclass(frozen=True)
class Option:
    kind: str  # "ssd", "sd" or "ar"
    gamma: int = 0
    budget: int = 0
    threads: int = 0  # torch threads on the critical path (CPU, SD and AR only); 0: the call's default
    stop: float = 0.0  # SD only: stop drafting after a token whose top draft probability is below this (0: never)

    @property
    def name(self) -> str:
        t = f"t={self.threads}" if self.threads else ""
        if self.kind == "ssd":
            return f"ssd(b={self.budget},g={self.gamma})"
        if self.kind == "sd":
            c = f",c={self.stop:g}" if self.stop else ""
            return f"sd(g={self.gamma}{c}{',' + t if t else ''})"
        return f"ar({t})" if t else "ar"

    @property
    def family(self) -> str:
        """Exploration picks among families (kinds, budgets of SSD, confidence-stopped SD, thread counts); the
        model picks gamma (and the threshold)."""
        if self.kind == "ssd":
            return f"ssd{self.budget}"
        return f"{self.kind}{'c' if self.stop else ''}{self.threads or ''}"


AR = Option("ar")


@dataclass
class Prediction:
    tokens: float  # expected new tokens per round
    seconds: float  # expected round time

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class HitTerms(NamedTuple):
    """An SSD option's hit round, as the model sees it (`Scheduler._hit_terms`)."""

    verify: float  # seconds of the verification, with the job running
    overhead: float  # critical-path seconds the job adds (waiting for its step, adopting the branch)
    p_hit: float  # P(the cache holds the outcome)
    e_hit: float  # expected new tokens of a hit round

    @property
    def rate(self) -> float:
        """Tokens per second of hit rounds: what the automatic miss fallback trades drafting time against."""
        return self.e_hit / (self.verify + self.overhead)


def expected_tokens(n: int, alpha: float) -> float:
    """Expected tokens of one round verifying n drafted tokens: accepted prefix plus the bonus."""
    if alpha >= 1.0:
        return n + 1.0
    return (1.0 - alpha ** (n + 1)) / (1.0 - alpha)


def allowed_options(config, layout: str, fixed_budget: int, fewer_threads: tuple[int, ...] = (),
                    wide: bool = True, stops: bool = True) -> list[Option]:
    """The options the scheduler may pick, for one prompt and for batches; explicit settings are constraints.

    - schedule="fixed": only SSD with the configured gamma and budget (today's behaviour).
    - gamma set: that gamma only.
    - a fan-out set (fanout list or fanout_budget) or a layout set: the user asked for the speculator, so only
      SSD options (at that fan-out); the scheduler still tunes gamma where it is not set.
    - otherwise: AR, SD, confidence-stopped SD with `stops` (up to CONFIDENCE_CAP tokens, thresholds
      CONFIDENCE_STOPS; one prompt's) and SSD at budgets 1..16, and 32 and 64 with `wide` (within the cache size);
      `fewer_threads` adds AR and both SD kinds at those thread counts (CPU thread layout, `cpu_threads` unset).
    """
    gammas = (config.gamma,) if config.is_set("gamma") or config.is_set("fanout") else AUTO_GAMMAS
    if config.schedule == "fixed":
        return [Option("ssd", config.gamma, fixed_budget)]
    if config.is_set("fanout") or config.is_set("fanout_budget"):
        return [Option("ssd", g, fixed_budget) for g in gammas]
    budgets = [b for b in AUTO_BUDGETS + (WIDE_BUDGETS if wide else ()) if b <= config.cache_size]
    ssd = [Option("ssd", g, b) for b in budgets for g in gammas]
    if config.is_set("layout"):
        return ssd
    plain = [Option("ar", threads=t) for t in (0, *fewer_threads)]
    plain += [Option("sd", g, threads=t) for t in (0, *fewer_threads) for g in gammas]
    if stops and not config.is_set("gamma"):  # a confidence stop chooses the draft length: not with a gamma set
        plain += [Option("sd", CONFIDENCE_CAP, threads=t, stop=c) for t in (0, *fewer_threads) for c in CONFIDENCE_STOPS]
    return plain + ssd


class Scheduler:
    def __init__(self, config, costs: CostModel, options: list[Option], default: Option, inline: bool,
                 deferred_record: bool = False, rows: int | None = None, every_family: bool = False,
                 warmup_budget: float | None = None):
        self.config = config
        # Rows of a batch (loop/batch.py; None: one prompt's generator): a round runs the miss fallback if any row
        # misses, and a missed row may draft nothing (it takes its one token), at every batch size, one row too.
        self.rows, self.batch = rows or 1, rows is not None
        # Branches per row a job of budget b gives its rows: b, but a batch's job shares the branches of the rows
        # that have ended among the live ones (loop/batch.py `_job_budget`), which sets this before deciding.
        self.job_budget = lambda b: b
        # Jobs feed the last candidate in their first tree step (generator, "the last candidate"): branches of
        # the outcome k = g then start a step after the others.
        self.deferred_record = deferred_record and not inline
        self.costs = costs
        # A miss's fallback drafts the length the model finds best unless the user chose the fallback.
        self.auto_fallback = config.schedule == "auto" and not config.is_set("fallback")
        self.options = options
        self.default = default
        self.inline = inline
        # Never the caller's RNG (decisions must not move sampling); seeded by the pair's rounds so far, so that a
        # later call does not repeat the draws of the one before (a fixed seed explored at the same decisions of
        # every call: at B = 8 the first, whose job pre-drafts every row's first decoding round).
        self.rng = random.Random(len(options) * 1_000_003 + costs.rounds_seen)
        self._decisions = 0
        self._predictions: dict | None = None  # the last full pass (see `decide`)
        self._shortlist: list[Option] = []
        families: dict[str, list[Option]] = {}
        for o in options:
            families.setdefault(o.family, []).append(o)
        self.families = families
        # The warm-up (`warmup_fits`): a pair that has never drafted runs AR until learning fits its budget.
        self.warmup_budget = warmup_budget
        self.warmup_rounds = 0
        self.warming = (warmup_budget is not None and not every_family and AR in options and not costs.drafted)
        self._queue: list[Option] = self.first_rounds(every_family) if costs.rounds_seen == 0 and not self.warming else []
        self._learning = self.learning_rounds()  # once: each warm-up decision prices them
        self._trial: Option | None = None  # a trial round run, its verdict (`decide`) not drawn yet
        self._after_trial: list[Option] = []  # the learning rounds that run only if the trial round pays
        self._lost_trial = False  # a trial that did not beat AR: the rest of the call runs the target alone
        self._trial_considered = False  # a call's trial (`trial_pays`): considered once, at the first AR decision
        self.trials = 0

    def prefilled(self) -> None:
        """The prompt prefill ran as a round of its own (hf_ssd's loop): a warm-up counts it as its first AR round,
        which `decide` would otherwise make the round after it."""
        if self.warming and self._decisions == 0:
            self._decisions += 1
            self.warmup_rounds += 1

    def first_rounds(self, every_family: bool = False) -> list[Option]:
        """The rounds a pair with no estimates runs first: the default three times, then each other kind (SSD,
        AR, plain SD) once, in its family nearest the default (the call's threads, no confidence stop, the
        nearest budget).

        Round 1's verification is the target's prompt prefill, and a round's verification runs alongside the
        job of the round after it: the third default measures the default's verification beside its own job,
        and SSD comes before AR so that a job runs beside some verification of candidates. The other options are
        predicted from these measurements (an unmeasured budget from the nearest measured one, confidence-stopped
        SD from the draft's confidences; a thread count not yet run is unknown, and exploration tries it)
        rather than each tried once: trying each of the ~11 families cost a 48-token first call on the real
        pair 12 of its 24 rounds (docs/performance.md). `every_family` (`hf-ssd tune`, which saves what a new
        process starts from): the default twice, then each family once."""
        default = self.default
        if every_family:
            return [default, default] + [self._pick_gamma(fam, default.gamma) for name, fam in self.families.items()
                                         if name != default.family and fam[0].budget not in WIDE_BUDGETS]
        queue = [default, default, default]
        for kind in ("ssd", "ar", "sd"):
            near = [fam for fam in self.families.values()
                    if fam[0].kind == kind and kind != default.kind and not fam[0].threads and not fam[0].stop
                    and fam[0].budget not in WIDE_BUDGETS]
            if near:
                fam = min(near, key=lambda f: abs(math.log2(max(f[0].budget, 1)) - math.log2(max(default.budget, 1))))
                queue.append(self._pick_gamma(fam, default.gamma))
        return queue

    def learning_rounds(self) -> list[Option]:
        """The rounds that end a warm-up: the trial, plain SD (the round before it, AR, then runs no job: round 1's
        is the prompt prefill), then, if the trial paid (`decide`), `first_rounds` less AR, which the warm-up has
        measured."""
        sd = [fam for name, fam in self.families.items() if name == "sd"]
        head = [self._pick_gamma(sd[0], self.default.gamma)] if sd else []
        return head + [o for o in self.first_rounds() if o.kind != "ar"]

    def warmup_cost(self, context: int) -> float | None:
        """Seconds that learning whether drafting pays would cost at worst (`trial_cost` with the whole context
        unread). The other learning rounds run only if the trial shows drafting paying (`decide`)."""
        return self.trial_cost(context, context)

    def trial_cost(self, context: int, lag: int) -> float | None:
        """Seconds the trial round (the first of `learning_rounds`) costs at worst, from what has been measured:
        the draft reading the `lag` context tokens it has not read (as `catch_up`), then drafting the trial's
        gamma (a step as the draft's probe timed it) and the target verifying that many more tokens (at what its
        prefill of `context` tokens cost beyond one AR step, per further token), all of them rejected. None
        until the target's prefill and an AR step are measured."""
        c = self.costs
        t_ar, prefill = c.verify(0, None), c.prefill.predict(max(1, context))
        read = self.catch_up(lag) if lag > 0 else 0.0
        if t_ar is None or prefill is None or read is None or not self._learning:
            return None
        step = c.draft_step_hint if c.draft_step_hint is not None else c.draft_share * t_ar
        per_token = max(0.0, prefill - t_ar) / max(1, context - 1)
        return read + self._learning[0].gamma * (step + per_token)

    def trial_pays(self, context: int, lag: int, remaining: int, predictions: dict, ar) -> bool:
        """Whether a call about to run the target alone before drafting once should draft once (the trial).

        Its acceptance is unknown: calls differ (the real pair: 0% to 89% on HumanEval + GSM prompts), and what
        the calls before showed weighs little (costs.CALL_PRIOR_ROUNDS). The trial pays when the time it saves
        on average over the recent calls' acceptances (`CostModel.call_acceptances`; at each, the best drafting
        option's predicted rate against AR's over the `remaining` tokens, or nothing where AR is faster) exceeds
        its worst-case cost (`trial_cost`): a pair whose calls all drafted badly keeps the target alone, and
        a pair some of whose calls drafted well tries each call."""
        history = list(self.costs.call_acceptances)
        cost = self.trial_cost(context, lag)
        if not history or cost is None or ar is None or remaining <= 0:
            return False
        # The trial option and the drafting options the model ranked best (its last full pass).
        ranked = sorted((o for o, p in predictions.items() if p is not None and o.kind != "ar"),
                        key=lambda o: -predictions[o].rate)
        drafting = list(dict.fromkeys([self._learning[0]] + ranked[:SHORTLIST]))
        saved = 0.0
        for a in history:
            rates = [p.rate for p in (self.predict(o, a) for o in drafting) if p is not None]
            if rates:
                saved += max(0.0, remaining / ar.rate - remaining / max(rates))
        return saved / len(history) > cost

    def catch_up(self, tokens: int) -> float | None:
        """Seconds for the draft to read `tokens` it lags: its measured catch-ups, else the target's measured prefill
        at the draft's share of the target's parameters (None: neither measured)."""
        c = self.costs
        if c.draft_prefill.count:
            return c.draft_prefill.predict(tokens)
        return c.draft_share * c.prefill.predict(tokens) if c.prefill.count else None

    def warmup_fits(self, context: int, remaining: int) -> bool:
        """Whether learning fits the warm-up budget: its worst-case cost within `warmup_budget` of the pair's
        decode time so far and the AR time of the call's `remaining` tokens. A short call on a pair that has never
        drafted then runs as the target alone; longer ones, or later calls, learn (docs/scheduling.md)."""
        cost, t_ar = self.warmup_cost(context), self.costs.verify(0, None)
        return cost is not None and cost <= self.warmup_budget * (self.costs.work_s + remaining * t_ar)

    @staticmethod
    def _pick_gamma(family: list[Option], gamma: int) -> Option:
        # Confidence-stopped SD: transformers' default threshold when the model cannot say yet.
        return min(family, key=lambda o: (abs(o.gamma - gamma), abs(o.stop - 0.4)))

    # ----- model ----------------------------------------------------------------------------------------------
    def hit_rate(self, budget: int, gamma: int, alpha: float, calibrated: bool = True) -> float:
        """P(the cache holds the real outcome) for a job of this budget, from the measured bonus ranks.

        Outcome (k accepted, bonus) is pre-drafted when the bonus is among the F_k most likely draft tokens at
        position k, F = the geometric fan-out of the budget; summed over P(k), and its miss probability scaled by
        the measured misses against predicted ones (`CostModel.miss_ratio`; misses also count jobs the outcome
        cut short before a branch existed).
        `calibrated=False`: the model's own prediction, the one the calibration compares hits with.
        """
        def raw():
            fanout = fanout_split(self.config.fanout, budget, alpha, gamma)
            # P(k) from the measured per-position acceptance; the fan-out split is the job's (i.i.d. in alpha).
            return min(1.0, sum(pk * self.costs.coverage(f) for pk, f in zip(self.costs.length_probs(gamma), fanout)))

        p = self.costs.memoized(("h", budget, gamma, alpha), raw)
        return max(0.0, 1.0 - (1.0 - p) * self.costs.miss_ratio(budget)) if calibrated else p

    def _expected(self, n: float, alpha: float | None) -> float:
        return self.costs.expected_tokens(n) if alpha is None else expected_tokens(n, alpha)

    def _fallback(self, gamma: int, alpha: float | None, rate: float | None = None) -> tuple[float, float] | None:
        """(tokens, seconds of drafting) of a miss's fallback for a round of draft length gamma; `rate`: the
        tokens per second of the option's hit rounds, which the automatic fallback trades against."""
        kind = self.config.fallback
        if kind in ("ar", "ngram"):
            return 1.0, 0.0
        if self.auto_fallback and rate is not None:
            n = self.fallback_length(gamma, alpha, rate)
        else:
            n = gamma if kind == "sd" else min(gamma, self.config.fallback_gamma or max(1, gamma // 2))
        t = self.costs.draft_time(n)
        return (self._expected(n, alpha), t) if t is not None else None

    def fallback_length(self, gamma: int, alpha: float | None, rate: float) -> int:
        """The draft length of a miss's fallback when the user left `fallback` unset: the n in 1..gamma that
        maximises E(n) - rate * draft(n), the tokens the miss round yields less what its drafting time would
        have yielded at the rate of hit rounds. Where hits are much faster than drafting (an idle accelerator),
        a miss drafts one or two tokens instead of a whole gamma; on CPU cores, where SSD's rounds are about as
        slow as SD's, it drafts about what SD would. (n = 0 would leave the bonus unfed, and the next job would
        spend its first step feeding it.)"""
        best_n, best_v = gamma, None
        for n in range(1, gamma + 1):
            t = self.costs.draft_time(n)
            if t is None:
                return gamma
            v = self._expected(n, alpha) - rate * t
            if best_v is None or v > best_v:
                best_n, best_v = n, v
        return best_n

    def miss_fallback(self, option: Option) -> int:
        """`fallback_length` for a miss of an SSD round of this option, as the model predicts it."""
        terms = self._hit_terms(option, None)
        if self.batch:
            return 0 if terms is None else self._batch_fallback(option.gamma, None, terms)
        return option.gamma if terms is None else self.fallback_length(option.gamma, None, terms.rate)

    def _batch_fallback(self, gamma: int, alpha: float | None, terms: HitTerms) -> int:
        """The miss fallback's draft length in a batch of `rows` rows: a round drafts it when any row missed, so
        every row waits for it; n = 0 (a missed row takes its one token; the next job catches its draft up)
        often yields the most tokens per second."""
        p, any_miss = terms.p_hit, 1.0 - terms.p_hit**self.rows
        best_n, best = 0, None
        for n in range(gamma + 1):
            t = self.costs.draft_time(n) if n else 0.0
            if t is None:
                break
            rate = ((p * terms.e_hit + (1.0 - p) * self._expected(n, alpha))
                    / max(1e-9, terms.verify + terms.overhead + any_miss * t))
            if best is None or rate > best:
                best_n, best = n, rate
        return best_n

    def _hit_terms(self, option: Option, alpha: float | None) -> HitTerms | None:
        """The hit round of an SSD option (`HitTerms`), or None before its verify time is measured."""
        c = self.costs
        g, b = option.gamma, option.budget
        tv = c.verify(g, None if self.inline else b)
        if tv is None:
            return None
        step = c.tree_step.predict(max(b, 1))
        # A hit returns the tokens pre-drafted by the time the outcome arrived: with overlap, the steps that
        # end by then or within the job's grace after it (its own rule); inline, the whole branch.
        n_hit, steps = g, None
        if not self.inline and step is not None:
            record = c.record.value or 0.0
            if self.batch:  # `late_grace_s`, step by step
                a = c.acceptance if alpha is None else alpha
                steps = 1
                while steps <= g and record + (steps + 1) * step <= tv + late_grace_s(a, steps, g, tv):
                    steps += 1
            else:
                steps = max(1, math.floor(max(0.0, tv - record) / step + LATE_GRACE))
            n_hit = min(g, steps)
        # The job that must hit runs while the round's candidates are verified: after a hit, n_hit of them.
        p = self.hit_rate(self.job_budget(b), n_hit, c.acceptance if alpha is None else alpha) if b > 0 else 0.0
        e_hit = self._expected(n_hit, alpha)
        if self.deferred_record and steps is not None and steps > 1:
            # A hit on k = g (all n_hit candidates accepted) returns a branch that started a step late.
            all_kept = c.length_probs(n_hit)[n_hit] if alpha is None else alpha**n_hit
            e_hit += all_kept * (self._expected(min(g, steps - 1), alpha) - e_hit)
        return HitTerms(tv, c.overhead_for(b, beside=not self.inline), p, e_hit)

    def predict(self, option: Option, alpha: float | None = None) -> Prediction | None:
        """The model's E / T for this option, corrected by how its own past rounds compared with the model."""
        pred = self.model(option, alpha)
        if pred is None:
            return None
        tokens, seconds = self.costs.correction(option)
        if option.kind == "ar":
            tokens = 1.0  # exact: an AR round yields one token, whatever other options' rounds showed
        return Prediction(max(1.0, pred.tokens * tokens), pred.seconds * seconds)  # a round yields >= 1 token

    def model(self, option: Option, alpha: float | None = None) -> Prediction | None:
        """The model's E / T for this option; `alpha` given: i.i.d. acceptance at that rate instead of the
        measured per-position acceptance."""
        c = self.costs
        a = alpha  # None: measured per position
        if option.kind == "ar":
            t = c.verify(0, None, option.threads)
            return None if t is None else Prediction(1.0, t)
        g = option.gamma
        if option.kind == "sd" and option.stop:
            drafted, tokens = c.confidence_model(option.stop, g, self.rows)
            tv, td = c.verify(drafted, None, option.threads), c.draft_time(drafted, option.threads)
            return None if tv is None or td is None else Prediction(tokens, tv + td)
        if option.kind == "sd":
            tv, td = c.verify(g, None, option.threads), c.draft_time(g, option.threads)
            return None if tv is None or td is None else Prediction(self._expected(g, a), tv + td)
        terms = self._hit_terms(option, a)
        if terms is None:
            return None
        if self.batch and self.auto_fallback:
            n = self._batch_fallback(g, a, terms)
            fb = (self._expected(n, a), self.costs.draft_time(n) if n else 0.0)
        else:
            fb = self._fallback(g, a, terms.rate)
        if fb is None:
            return None
        p = terms.p_hit
        tokens = p * terms.e_hit + (1.0 - p) * fb[0]
        seconds = terms.verify + terms.overhead + (1.0 - p**self.rows) * fb[1]  # rows = 1: (1 - p)
        return Prediction(tokens, seconds)

    def best(self, predictions: dict | None = None) -> tuple[Option, Prediction | None]:
        predictions = predictions if predictions is not None else {o: self.predict(o) for o in self.options}
        best, best_pred = None, None
        for o in self.options:
            pred = predictions[o]
            if pred is not None and (best_pred is None or pred.rate > best_pred.rate):
                best, best_pred = o, pred
        return (best, best_pred) if best is not None else (self.default, None)

    def decide(self, draft_lag: int = 0, context: int = 0, remaining: int = 0) -> tuple[Option, Prediction | None, bool]:
        """(option for the next round, its prediction, whether this is an exploration round); `draft_lag`: context
        tokens the draft has not read yet; `context`: tokens the target has; `remaining`: new tokens the call may
        still make."""
        if self.warming:
            # Round 1 is AR whatever the budget: a learning round there would run beside the prompt prefill.
            if self._decisions == 0 or not self.warmup_fits(context, remaining):
                self._decisions += 1
                self.warmup_rounds += 1
                return AR, self.predict(AR), False
            self.warming = False
            # The trial, then AR while it is verified (a decision is made while the round before it runs), then
            # the rest only if the trial showed its option beating the target alone.
            self._queue, self._after_trial, self._trial = [self._learning[0], AR], self._learning[1:], self._learning[0]
        if self._trial is not None and not self._queue:
            trial, ar = self.predict(self._trial), self.predict(AR)
            if trial is not None and ar is not None and trial.rate > ar.rate:
                self._queue = self._after_trial
            else:
                # Drafting lost in the one round of it this call measured; the model, from that round and what
                # earlier calls showed, would still rate other options above AR. On the real pair on CPU, after a
                # lost trial, unmeasured ssd(b=64,g=8) and confidence-stopped SD ran a 48-token call at 0.69x the
                # target alone, and plain SD at other gammas (the measured family) at 0.87x.
                self._lost_trial = True
            self._trial, self._after_trial = None, []
        if self._queue:
            o = self._queue.pop(0)
            return o, self.predict(o), True
        if self._lost_trial:
            self._decisions += 1
            return AR, self.predict(AR), False
        # Every FULL_EVERY rounds all ~90 options are predicted; in between only the SHORTLIST best of the last
        # full pass (the others keep that pass's predictions). A decision waits on the caller's thread while the
        # job finishes its step, and its Python holds the interpreter lock the job needs after that step.
        self._decisions += 1
        with self.costs.frozen():
            if self._predictions is None or self._decisions % FULL_EVERY == 0:
                predictions = {o: self.predict(o) for o in self.options}
                ranked = sorted((o for o in self.options if predictions[o] is not None),
                                key=lambda o: -predictions[o].rate)
                self._predictions, self._shortlist = predictions, ranked[:SHORTLIST]
            else:
                predictions = dict(self._predictions)
                for o in self._shortlist:
                    predictions[o] = self.predict(o)
        best, pred = self.best(predictions)
        ar = predictions.get(AR)
        if draft_lag > CATCH_UP_TOKENS and best.kind != "ar" and ar is not None and pred is not None and remaining:
            # Drafting now first makes the draft read what it lags: worth it only if the call's remaining tokens
            # repay that prefill.
            read = self.catch_up(draft_lag)
            if read is not None and remaining / ar.rate <= read + remaining / pred.rate:
                best, pred = AR, ar
        if best.kind == "ar" and not self._trial_considered:
            # Once a call: the target alone is best by what the calls before showed, but not by this one.
            self._trial_considered = True
            if self.costs.call_tried() == 0 and self.trial_pays(context, draft_lag, remaining, predictions, ar):
                self.trials += 1
                self._queue = [AR]  # decided while the trial is verified; then its verdict, and the model
                trial = self._trial = self._learning[0]
                return trial, predictions.get(trial) or self.predict(trial), True
        # Exploration gets rarer as measurements accumulate (down to 2% of rounds), and skips families
        # predicted at under EXPLORE_FLOOR of the best rate: re-measuring those costs more than it can reveal.
        epsilon = max(EXPLORE_MIN, EXPLORE / math.sqrt(max(1.0, self.costs.rounds_seen / 25)))
        rates = {name: max((p.rate for p in map(predictions.get, fam) if p is not None), default=None)
                 for name, fam in self.families.items() if name != best.family and fam[0].budget not in WIDE_BUDGETS}
        floor = EXPLORE_FLOOR * pred.rate if pred is not None else 0.0
        worth = [name for name, r in rates.items() if (r is None or r >= floor)
                 and (draft_lag <= CATCH_UP_TOKENS or self.families[name][0].kind == "ar")]
        if worth and self.rng.random() < epsilon:
            family = self.rng.choice(worth)
            # Within the family, the gamma the model likes best (or the default's when it cannot say yet).
            cands = self.families[family]
            scored = [(predictions[o].rate, o) for o in cands if predictions[o] is not None]
            o = max(scored, key=lambda x: x[0])[1] if scored else self._pick_gamma(cands, self.default.gamma)
            return o, predictions[o], True
        return best, pred, False
