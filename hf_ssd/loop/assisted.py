"""`SSDCandidateGenerator`: SSD as a transformers candidate generator.

The stock assisted-decoding loop is the main loop and the verifier: it calls `get_candidates`, runs the target
over them, accepts (greedy matching or speculative sampling) and reports the outcome through
`update_candidate_strategy`. Around that, this class is the speculator's front end:

- `get_candidates` collects the background job of the round just verified, looks the real outcome up in the
  speculation cache (hit: the pre-drafted branch is returned at once; miss: the configured fallback), then
  submits the next job, which predicts this round's outcomes and pre-drafts a branch for each while the
  target verifies.
- `update_candidate_strategy` records the outcome (accepted count, bonus token).

Which option runs each round (overlapped SSD at some budget and gamma, plain SD, or AR) is the scheduler's
choice from costs measured here (schedule.py, costs.py); every option only changes what is proposed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..config import SSDConfig
from ..drafting.fallback import run_fallback
from ..drafting.probe import step_seconds
from ..drafting.static import make_drafter
from ..scheduling.costs import CostModel
from ..scheduling.schedule import CATCH_UP_LAG, LATE_GRACE, Option, Scheduler, allowed_options
from ..speculation.cache import Branch, SpeculationCache
from ..speculation.fanout import fanout_split
from ..speculation.outcomes import (
    Outcome,
    bonus_probs,
    bonus_rank,
    placeholder_top,
    predict_outcomes,
    rank_outcomes,
)
from ..speculation.predictor import calibration_for, drafted_probs, hedged_length_probs
from ..speculation.speculator import Speculator
from ..stats import SSDStats


class LastRow(NamedTuple):
    outcome: Outcome  # (g - 1, c_g): the row's outcome until its first step
    share: int  # rows for k = g, this one included: all feed c_g in the first step
    extra: Callable  # (top after c_g, its first token) -> (P(g, first), the other (g, bonus) outcomes)


class SSDCandidateGenerator(CandidateGenerator):
    def __init__(
        self,
        draft_model,
        config: SSDConfig,
        generation_config,
        logits_processor,
        layout: str,
        out_vocab: int,
        cpu_threads: int | None = None,
        hooks: dict | None = None,
        prompt_mask: torch.Tensor | None = None,
        costs: Callable[[int], CostModel] | None = None,
    ):
        self.config = config
        self.max_length = generation_config.max_length
        eos = getattr(generation_config, "_eos_token_tensor", None)
        self.eos = set(eos.flatten().tolist()) if eos is not None else set()
        do_sample = self.do_sample = bool(generation_config.do_sample)
        on_gpu = draft_model.device.type == "cuda"
        fixed_budget, _ = config.resolved_budget(on_gpu)
        # Test/tooling hooks: stage name -> callable (fault injection, "options" filter); "every_family": True
        # makes a first call with no estimates try every option family once (`hf-ssd tune`).
        self.hooks = hooks or {}
        # On a CPU shared with other work, one thread can beat all cores: AR and SD may also run with one.
        self.cpu_threads = cpu_threads
        fewer = (1,) if layout == "thread" and not config.is_set("cpu_threads") and (cpu_threads or 1) > 1 else ()
        # The static path preallocates its tree for the widest option (rows x max_length columns on the device):
        # it keeps budgets up to 16.
        static, _ = config.resolved_draft_path(on_gpu)
        self.options = allowed_options(config, layout, fixed_budget, fewer, wide=not static)
        longest = max(o.gamma for o in self.options)  # before any filter: sizes the static buffers
        fanout_max = max(config.fanout) if isinstance(config.fanout, list) else 0
        top_k = max([fanout_max] + [o.budget for o in self.options]) + 1  # before any filter: keys the estimates
        if "options" in self.hooks:  # `hf-ssd tune` and tests measure chosen options one at a time
            self.options = list(self.hooks["options"](self.options)) or self.options
        default = Option("ssd", config.gamma, fixed_budget)
        if default not in self.options:
            default = next((o for o in self.options if o.kind == "ssd"), self.options[0])
        # When sampling, the speculator draws from its own generator, seeded from the caller's RNG: draws on two
        # threads never interleave on one generator. Seeded runs repeat exactly with layout="inline",
        # schedule="fixed" and fanout="geometric"; otherwise timing, or what the calibrated predictor learned in
        # earlier calls, decides what was pre-drafted and which option ran (the output distribution is exact
        # either way). Greedy calls leave the caller's RNG alone.
        gen = None
        if do_sample:
            gen = torch.Generator(device=draft_model.device)
            gen.manual_seed(int(torch.randint(0, 2**62, (1,))))
        # The static path's tree holds as many rows as a round can pre-draft: the widest option's outcomes.
        widest = max([sum(config.fanout) if isinstance(config.fanout, list) else 0] + [o.budget for o in self.options])
        rows = min(config.max_outcomes or widest, config.cache_size, widest)
        self.drafter = make_drafter(draft_model, config, logits_processor, do_sample, top_k, gen, out_vocab,
                                    self.max_length, max(1, rows), prompt_mask, longest)
        self.cache = SpeculationCache(config.cache_size)
        self.speculator = Speculator(layout, cpu_threads, draft_model.device)
        # `costs(top_k)` returns the estimates kept for this pair; without it they last one call.
        self.costs = costs(top_k) if costs is not None else CostModel(on_gpu, top_k, config.initial_acceptance)
        with self.costs.lock:
            self.costs.new_call()  # new text: earlier acceptance counts weigh less
            if self.costs.draft_step_hint is None:
                self.costs.draft_step_hint = step_seconds(draft_model)
        # fanout="calibrated": P(accept | the draft's probability) learned from verifications, kept per draft.
        self.calibration = (calibration_for(draft_model, do_sample, config.initial_acceptance)
                            if config.fanout == "calibrated" else None)
        self.scheduler = Scheduler(config, self.costs, self.options, default, inline=layout == "inline",
                                   deferred_record=self.drafter.defers_record,
                                   every_family=bool(self.hooks.get("every_family")),
                                   warmup_budget=config.warmup_budget if config.schedule == "auto" else None)
        self.stats = SSDStats(layout=layout, schedule=config.schedule, draft_path=self.drafter.path)
        self.stats.profile = getattr(self.costs, "profile", None)  # the tuning profile the estimates started from (hf_ssd/scheduling/profile.py)
        self.round = 0
        self._pending: tuple[list[int], list[int]] | None = None  # (context, candidates) being verified
        self._outcome: tuple[int, int] | None = None
        self._verify_start = 0.0
        self.verify_intervals: list[tuple[float, float]] = []
        self.draft_intervals: list[tuple[float, float]] = []
        # Scheduling state: the option deciding the next round, the one whose candidates are being verified,
        # the job running during this verification (its budget, the hit rate predicted for it, its timings).
        # Round 1's option; the new draft has read none of the prompt.
        prompt = prompt_mask.shape[-1] if prompt_mask is not None else 0
        self._next: tuple[Option, object, bool] = self.scheduler.decide(prompt, prompt, self.max_length - prompt)
        self._current: tuple[Option, object, bool] | None = None
        self._round_start = 0.0
        self._job_budget: int | None = None
        self._job_predicted = 0.0
        self._job_info: dict = {}
        self._sd_tops: list = []

    # ----- fan-out ---------------------------------------------------------------------------------------
    def _fanout(self, budget: int, g: int, alpha: float) -> list[int]:
        # Per-k counts: also what Saguaro sampling reads for "calibrated" (the tokens likely to be cached per k).
        return fanout_split(self.config.fanout, budget, alpha, g)

    def _outcome_limit(self, budget: int) -> int:
        limit = self.config.max_outcomes
        if limit is None:
            limit = sum(self.config.fanout) if isinstance(self.config.fanout, list) else budget
        return min(limit, self.config.cache_size)

    def _hook(self, stage: str) -> None:
        hook = self.hooks.get(stage)
        if hook is not None:
            hook()

    # ----- CandidateGenerator API --------------------------------------------------------------------------
    @property
    def num_drafting_tokens(self) -> int:
        """The most candidates a round may propose (transformers >= 5.25 sizes a hybrid cache's recording of past
        recurrent states by it before the first round)."""
        return max((o.gamma for o in self.options), default=self.config.gamma)

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        now = time.perf_counter()
        context = input_ids[0].tolist()
        option, prediction, explored = self._next
        if self.cpu_threads:  # this round's critical-path threads (the draft below and the verify after)
            want = option.threads or self.cpu_threads
            if torch.get_num_threads() != want:
                torch.set_num_threads(want)
        gamma = option.gamma if option.kind != "ar" else 0
        n = min(gamma, self.max_length - len(context) - 1)
        branch = None
        job_budget = self._job_budget
        decided = None
        if self._pending is not None:
            self._measure_round(now)
            # The option of the round after this one is decided while the job finishes its current step (the
            # caller would only wait for it): from the estimates up to the round before, which is all a
            # decision needs. The job's own timings and this outcome inform the next one.
            self.speculator.signal()
            with self.costs.lock:
                decided = self._decide(context)
            self.speculator.collect()  # waits for the job; re-raises its error here
            if self._outcome is not None:
                self._measure_outcome()
                if job_budget is not None:
                    k, bonus = self._outcome
                    predicted = self.cache.hit_mass(self.round)
                    branch = self.cache.get(self.round, k, bonus)
                    if n > 0:
                        self.stats.add_lookup(predicted, branch is not None and bool(branch.tokens))
        alpha = self.costs.acceptance  # the pair's one acceptance estimate (costs.py), as the scheduler's
        event = {"round": self.round + 1, "t_request": now, "option": option.name}
        draft_seconds = 0.0
        kind = "hit"

        if branch is not None and branch.tokens and n > 0:
            tokens = branch.tokens[:n]
            logits = branch.logits[: len(tokens)] if branch.logits is not None else None
            with self.speculator.on_critical_path():
                self.drafter.adopt(branch.state, tokens)
            self.stats.cache_hits += 1
            self.stats.partial_hits += int(len(branch.tokens) < gamma)
            self.costs.add_lookup(job_budget, True, self._job_predicted)
            event["hit"] = True
        else:
            # An SSD round without a hit (a miss, or round 1) runs the configured fallback; plain SD drafts gamma
            # tokens now, and AR proposes nothing.
            kind = {"ssd": self.config.fallback, "sd": "sd", "ar": "ar"}[option.kind]
            short_n = max(1, self.config.fallback_gamma or gamma // 2)
            if kind == "sd" and option.kind == "ssd" and self.scheduler.auto_fallback:
                with self.costs.lock:  # the length the model finds best (`Scheduler.fallback_length`)
                    short_n, kind = self.scheduler.miss_fallback(option), "short"
            if job_budget is not None and n > 0:
                self.stats.cache_misses += 1
                self.stats.fallbacks[kind] = self.stats.fallbacks.get(kind, 0) + 1
                self.costs.add_lookup(job_budget, False, self._job_predicted)
            lag = self._draft_lag(context)
            drafting = kind in ("sd", "short") and n > 0
            catch_up = drafting and lag > CATCH_UP_LAG
            d0 = time.perf_counter()
            with self.speculator.on_critical_path():
                if catch_up:
                    # The draft first reads what it lags (the prompt, AR rounds), timed apart: a catch-up is a
                    # prefill. Timed with the steps, it kept a call's first drafting round, the one after AR
                    # rounds, from measuring the draft's step at all.
                    self.drafter.sync(context[:-1])
                c1 = time.perf_counter()
                result = run_fallback(
                    kind, self.drafter, context, n, short_n,
                    self.config.ngram_size, self._fanout(option.budget, gamma, alpha),
                    option.stop if option.kind == "sd" else 0.0,
                )
            d1 = time.perf_counter()
            if drafting:
                draft_seconds = d1 - d0  # not a job's overhead (below)
                self.draft_intervals.append((d0, d1))
                self.stats.fallback_draft_time += draft_seconds
                self.costs.add_draft(len(result.tokens), d1 - c1, option.threads)
                if catch_up and not option.threads:
                    self.costs.add_draft_prefill(lag - 1, c1 - d0)
            tokens, logits = result.tokens, result.logits
            event["hit"] = False
        tokens, logits = self._cut_at_eos(tokens, logits)
        # The draft's top tokens at the candidates' positions, for the bonus ranks when no job records them
        # (plain SD rounds); valid only where the trunk holds these candidates (drafted or adopted).
        drafted = event["hit"] or kind in ("sd", "short")
        tops = self.drafter.top
        self._sd_tops = [tops.get(len(context) - 1 + j) for j in range(len(tokens))] if drafted else []

        self.round += 1
        self.cache.begin_round(self.round)
        self._pending = (context, tokens)
        self._outcome = None
        self._current = (option, prediction, explored)
        self._round_start = now
        self.stats.proposed_tokens += len(tokens)
        # The option of the next round decides whether a job runs during this verification. Nothing to
        # pre-draft if this verification surely ends the generation (length budget spent).
        if decided is None:  # round 1
            with self.costs.lock:
                decided = self._decide(context)
        self._next = decided
        nxt = self._next[0]
        self._job_budget = None
        # Built before the job starts: tensor creation lets the job's thread take the interpreter lock, and the
        # caller would then wait for the job's preamble with the verification not yet begun.
        candidate_ids = torch.tensor([context + tokens], dtype=input_ids.dtype, device=input_ids.device)
        if nxt.kind == "ssd" and len(context) + 1 < self.max_length:
            self._submit(context, tokens, alpha, nxt)
        self._verify_start = time.perf_counter()
        critical = self._verify_start - now
        # Critical-path time a job costs besides drafting: waiting for it and adopting its branch; inline, the
        # job just run. Charged to the budget of that job.
        budget = self._job_budget if self.scheduler.inline and self._job_budget is not None else job_budget
        if self.round > 1 and budget is not None:
            self.costs.add_overhead(budget, max(0.0, critical - draft_seconds))
        self.stats.target_wait_time += critical
        event.update(t_return=self._verify_start, n_candidates=len(tokens))
        if self.config.record_timeline:
            self.stats.timeline.append(event)

        if logits is not None:
            logits = logits.unsqueeze(0).to(input_ids.device)
            if logits.is_cuda:
                logits.record_stream(torch.cuda.current_stream(logits.device))  # made on the speculator's stream
        return candidate_ids, logits

    # ----- measurements ----------------------------------------------------------------------------------
    def _measure_round(self, now: float) -> None:
        """The round that just ended: its option's time share, and the target's time for its candidates."""
        option, prediction, explored = self._current
        self.stats.add_round(option.name, now - self._round_start, prediction, explored)
        if self.round > 1 and self._outcome is not None:  # how the round went against the model's own view
            with self.costs.lock:
                model = self.scheduler.model(option)
            if model is not None:
                self.costs.add_round_outcome(option, self._outcome[0] + 1, now - self._round_start, model)
        if self.round > 1:  # round 1's verification is the target's prompt prefill
            overlapped = self._job_budget is not None and not self.scheduler.inline
            self.costs.add_verify(len(self._pending[1]), now - self._verify_start,
                                  self._job_budget if overlapped else None, option.threads)
        elif self._job_budget is None and not option.threads:
            self.costs.add_prefill(sum(map(len, self._pending)), now - self._verify_start)
        self.costs.add_round(now - self._round_start)

    def _measure_outcome(self) -> None:
        """Where the bonus ranked among the draft's top tokens, the job's hit, and the job's own timings."""
        k, bonus = self._outcome
        candidates = self._pending[1]
        info = self._job_info if self._job_budget is not None else {}
        tops = info.get("tops", self._sd_tops)
        if k < len(tops) and tops[k] is not None:
            rank = bonus_rank(tops[k], candidates[k] if k < len(candidates) else None, bonus)
            self.costs.add_rank(rank)
            if k == len(candidates) > 0 and not self.do_sample and (self._current is None or not self._current[0].stop):
                self.costs.add_next_kept(k + 1, rank == 0)  # greedy: a draft one longer would have kept it
        known = tops[: len(candidates)]
        if known and all(t is not None for t in known):  # the draft's confidence at each candidate position
            self.costs.add_confidence([(torch.stack([t[0][0] for t in known]).tolist(), k)])
        if self.calibration is not None and len(known) == len(candidates) and all(t is not None for t in known):
            self.calibration.observe(drafted_probs(candidates, known), k)
        if "record_s" in info:
            self.costs.add_record(info["record_s"])
        for width, seconds in info.get("steps", []):
            self.costs.add_tree_step(width, seconds)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches):
        self.verify_intervals.append((self._verify_start, time.perf_counter()))
        k = int(num_matches)
        self._outcome = (k, int(input_ids[0, -1]))
        g = len(self._pending[1]) if self._pending else 0
        self.stats.rounds += 1
        self.stats.accepted_tokens += k
        self.stats.new_tokens += k + 1
        self.costs.add_verified([(k, g, None)], by_position=self._current is None or not self._current[0].stop)
        if self.config.record_timeline and self.stats.timeline:
            self.stats.timeline[-1].update(t_verified=time.perf_counter(), accepted=k)

    # ----- speculation ------------------------------------------------------------------------------------
    def _decide(self, context: list[int]):
        return self.scheduler.decide(self._draft_lag(context), len(context), self.max_length - len(context))

    def _draft_lag(self, context: list[int]) -> int:
        """Context tokens the draft has not read (it skips AR rounds); a length, not a prefix compare: a job
        may be extending the draft's ids meanwhile."""
        return max(0, len(context) - len(self.drafter.ids))

    def _cut_at_eos(self, tokens, logits):
        for i, t in enumerate(tokens):
            if t in self.eos:  # drafting past EOS is wasted verification work
                return tokens[: i + 1], (logits[: i + 1] if logits is not None else None)
        return tokens, logits

    def _insert(self, branch: Branch) -> None:
        self.cache.put(branch)
        self.stats.branches_drafted += 1

    def _last_row(self, candidates: list[int], tops, alpha: float, share: int, info: dict, prior: list[float]):
        """The row feeding the last candidate (`Drafter.tree_steps(last=...)`) and, once it has, the `share`
        likeliest outcomes (g, bonus), its own first token being one of them."""
        g = len(candidates)
        if self.calibration is not None:
            p_all = hedged_length_probs(self.calibration, drafted_probs(candidates, tops[:g]), prior)[g]
        else:
            p_all = alpha**g  # P(all g accepted) under the fan-out's i.i.d. acceptance

        def extra(top, first):
            info["tops"][g] = top  # where a k = g bonus ranks is measured too
            bonuses = bonus_probs(top)
            prob = next((p_all * p for p, t in bonuses if t == first), 0.0)
            more = [Outcome(g, t, p_all * p) for p, t in bonuses if t != first and t not in self.eos]
            return prob, more[: share - 1]

        return LastRow(Outcome(g - 1, candidates[-1], p_all), share, extra)

    def _submit(self, context: list[int], candidates: list[int], alpha: float, option: Option) -> None:
        round_id = self.round
        g = len(candidates)
        budget, gamma = option.budget, option.gamma
        fanout = self._fanout(budget, g, alpha)
        next_fanout = self._fanout(budget, gamma, alpha)
        limit = self._outcome_limit(budget)
        info: dict = {}
        self._job_info, self._job_budget = info, budget
        with self.costs.lock:  # one view of estimates that other calls on this pair may be updating
            prior = list(self.costs.length_probs(g))  # measured P(k), read here: the caller's thread updates it
            # Uncalibrated: the calibration is measured hits over the model's own predictions (a calibrated one
            # would only correct the model by the square root of its error).
            self._job_predicted = (self.scheduler.hit_rate(budget, g, self.costs.acceptance, calibrated=False)
                                   if budget > 0 else 0.0)
            # When the outcome is expected: the last, optional step (feeding the gamma-th token) is skipped if it
            # would not finish by then, since the caller would wait for it (an unfinished step cannot be cut).
            verify_s = self.costs.verify(g, None if self.scheduler.inline else budget)
            step_s = self.costs.tree_step.predict(max(budget, 1))
        deadline = time.perf_counter() + verify_s if verify_s is not None and not self.scheduler.inline else None

        def job(should_stop):
            # 1. Outcome prediction: draft distributions at every candidate position and after the last.
            self._hook("predict")
            t0 = time.perf_counter()
            # The trunk usually lacks only the last candidate (a branch's last token is drafted, not fed): then
            # that token is fed by a row of the first tree step instead of a record forward of its own, and the
            # outcomes k < g, known now, get that step too (docs/scheduling.md, "the last candidate").
            # Inline, a job runs to its end anyway: there it would only trade the exact k = g distribution for
            # a guessed share.
            deferred = (not self.scheduler.inline and self.drafter.defers_record
                        and self.drafter.holds_but_last(context, candidates))
            if deferred:
                tops = [self.drafter.top[len(context) - 1 + j] for j in range(g)] + [None]
            else:
                self.drafter.record(context + candidates, record_from=len(context) - 1)
                tops = self.drafter.candidate_tops(len(context), g)
            info["tops"], info["record_s"] = tops, time.perf_counter() - t0
            # Deferred, the budget is split as if the draft's distribution after the last candidate had the shape
            # of the one before it; its real top tokens fill the k = g share after the first step.
            ranked = tops[:g] + [placeholder_top(tops[g - 1])] if deferred else tops
            if self.calibration is not None:  # ranked overall by P(k) * P(bonus | k), not split per k first
                pk = hedged_length_probs(self.calibration, drafted_probs(candidates, ranked), prior)
                outcomes = rank_outcomes(candidates, ranked, pk, min(budget, limit))
            else:
                outcomes = predict_outcomes(candidates, ranked, fanout, alpha, limit)
            # Outcomes that end the generation (EOS bonus, length budget spent) need no next round.
            outcomes = [
                o for o in outcomes if o.bonus not in self.eos and len(context) + o.accepted + 2 < self.max_length
            ]
            last = None
            if deferred:
                share = sum(o.accepted == g for o in outcomes)  # the k = g outcomes the budget wants
                outcomes = [o for o in outcomes if o.accepted < g]
                if share == 0 and min(budget, limit) >= 2 and outcomes and len(context) + g + 2 < self.max_length:
                    # The row feeding the last candidate also drafts the branch of (g, the draft's own choice):
                    # worth a row even when the stand-in distribution ranked k = g low (it was only a guess).
                    if len(outcomes) >= min(budget, limit):
                        outcomes.pop()
                    share = 1
                if share:
                    last = self._last_row(candidates, tops, alpha, share, info, prior)
            self.stats.outcomes_predicted += len(outcomes) + (last.share if last else 0)
            rows = outcomes[: min(budget, limit)]
            if last is not None:
                rows += [last.outcome] * last.share
            if not rows:
                return
            steps, stamp = [], [time.perf_counter()]

            def on_step(j):  # the job's own step timings, read by the caller after collect
                t = time.perf_counter()
                steps.append((len(rows), t - stamp[0]))
                stamp[0] = t

            # 2. Tree drafting: one batched draft forward per step for all branches, until the outcome arrives.
            self._hook("draft")
            tree = self.drafter.start_tree(len(context), rows)

            def stop():
                if should_stop():
                    return True
                if deadline is None or step_s is None or not steps:
                    return False
                over = time.perf_counter() + step_s - deadline  # how far the next step would end past it
                # The optional last step only if it ends in time; any other only if it ends within half a step of
                # the expected outcome: the caller would wait for the rest (a step cannot be cut), and a token
                # more in every branch is worth less than most of a step's wait.
                return over > 0 if len(steps) >= gamma else over > LATE_GRACE * step_s

            tail = (len(rows) - last.share, last.extra, last.share) if last is not None else None
            drafted = self.drafter.tree_steps(tree, rows, gamma, next_fanout, stop, on_step, last=tail)
            # 3. Cache insert.
            self._hook("insert")
            for state, result in drafted:
                if result.tokens:
                    o = state.outcome
                    self._insert(Branch(round_id, o.accepted, o.bonus, o.prob, result.tokens, result.logits, state))
            info["steps"] = steps

        self.speculator.submit(job)

    def close(self) -> None:
        try:
            self.speculator.close()
        finally:  # whatever close raised, the static buffers go back for the next call
            self.drafter.release()
            self.cache.clear()
        if self._current is not None and self.stats.rounds >= self.round:  # the last round: now verified
            self.stats.add_round(self._current[0].name, time.perf_counter() - self._round_start, *self._current[1:])
            self._current = None
        self.stats.draft_forwards = self.drafter.forwards
        budgets = sorted({o.budget for o in self.options if o.kind == "ssd"})
        self.stats.cost_model = self.costs.snapshot(self.scheduler.default.gamma, budgets)
        self.stats.warmup_rounds, self.stats.warming_up = self.scheduler.warmup_rounds, self.scheduler.warming
