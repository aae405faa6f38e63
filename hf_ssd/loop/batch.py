"""hf_ssd's decoding loop for every batch size (one prompt too, which warms up and catches its draft up as the
one-prompt path does), entered through transformers' `custom_generate`.

transformers prepares the generation config, logits processors, stopping criteria and the attention mask, then
calls `decode`. Each round, for the rows still generating:

1. schedule: AR, plain SD or overlapped SSD at some gamma (and fan-out budget per row), chosen from costs
   measured at this batch size (`BatchPlan`); the next round's option is chosen before this round's verify;
2. propose: a row whose outcome the speculator predicted (a hit) takes its pre-drafted branch; the others draft
   now, in one batched draft forward per position (`BatchDrafter`; after an SSD miss, the fallback length);
3. speculate: if the next round is SSD, a background job pre-drafts it for every row's likeliest outcomes while
   the target verifies (speculate.py);
4. verify: one target forward over all rows (each row's unverified token and its candidates);
5. accept: per row, greedy matching or speculative sampling (`accept.py`); the rows' new tokens go one by one
   through the stopping criteria; hit rows adopt their branch's draft state; finished rows leave the batch.

Rows accept different counts: both caches are `RaggedCache`s (rejected columns masked, explicit positions), so
every row computes what it would compute alone. The output is padded as transformers pads a batch; with
`return_dict_in_generate`, each step's scores and logits as transformers' loops return them, and for one prompt
its attentions and hidden states (`_Kept`).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..drafting.batch import BatchDrafter
from ..drafting.drafter import CONTEXT_FREE
from ..drafting.fallback import ngram_lookup
from ..drafting.matmul import setup_seconds, verifying
from ..drafting.probe import step_seconds
from ..scheduling.costs import cost_model_for, estimates_of
from ..scheduling.schedule import (
    AUTO_BUDGETS,
    CATCH_UP_LAG,
    WIDE_BUDGETS,
    Option,
    Scheduler,
    allowed_options,
    late_grace_s,
)
from ..speculation.batch import Branch, Tree, speculate
from ..speculation.fanout import fanout_split
from ..speculation.outcomes import Outcome, bonus_rank
from ..speculation.predictor import calibration_for, drafted_probs
from ..speculation.speculator import Speculator
from ..stats import SSDStats
from .accept import accept_greedy, accept_sampled
from .plain import decode_plain
from .ragged import RaggedCache

logger = logging.getLogger("hf_ssd")

# A job's branches over the whole batch: each copies its row's draft cache, so a batch divides them among its rows
# (per row one prompt's widest, 64, at B <= 2, 32 at B = 4, 16 at B = 8, 8 at B = 16). Where a batched draft step
# costs about one row (an accelerator), the wider fan-outs are what keep most rows hitting; on CPU cores their
# measured steps rule them out.
BATCH_BRANCHES = 128
PLAIN_REFRESH = 8  # after this many plain calls in a row at one batch size, one runs the loop (fresh estimates)
EARLY_REFRESH = 2  # the same while the plain verdict is an early one (no whole loop call judged at the size yet)
INFORMED_ROUNDS = 50  # rounds a smaller size's estimates need before a shrinking batch's rounds use them
# Before its whole-call verdict the loop must beat plain decoding by this factor in the rounds measured, once
# scaled by the straggle measured (a call lasts until its slowest row ends; `CostModel.straggle_at`): a round's rate
# misses the rest of what a whole call pays (the job beside the prompt prefill). It was 1.1 before the straggle was
# measured; real pair, B = 8: a warm-up's rounds measured 1.06-1.11x plain's rate, 64-token loop calls ran
# 0.76-0.92x; B = 4: rounds 1.27-1.38x, a 16-token call's straggle 1.21, loop calls 1.25-1.6x.
EARLY_MARGIN = 1.05
# An early verdict from measured rounds is overruled where the model's best option is of a family not measured
# and, scaled by how the measured options fared against its predictions, this much faster than plain decoding
# per row: an idle accelerator's batch of 2 or 4 (simulated device: model 1.45x for b = 8, measured 0.95-1.05x
# from plain SD and b = 1, loop calls 2.1x) runs the loop.
EARLY_OVERRULE = 1.3
VERDICT_MIN_STEPS = 24  # chosen decode steps loop calls add up to before their speedup over plain is recorded


@dataclass
class Row:
    """One sequence of the batch."""

    index: int  # in the caller's batch
    ids: list[int]  # as processors and stopping criteria see it: the caller's (padded) prompt, then new tokens
    real: list[int]  # what the models attend to: the prompt without its padding, then new tokens
    target_fed: int = 0  # tokens of `real` in the target's cache
    draft_fed: int = 0
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    new: int = 0
    explored_new: int = 0  # of `new`, gained in rounds run to measure an option (not chosen as the best)
    done: bool = False
    # Draft-side state of the round (draft.py): tokens fed as confirmed, candidate columns fed, the draft's top
    # tokens at each candidate position (and after the last); a hit's branch, ready for the next round.
    draft_feed: int = 0
    tagged: int = 0
    tops: list = field(default_factory=list)
    ready: Branch | None = None
    # Asked for by return_dict_in_generate: per round, the processed scores and raw logits of the tokens it kept;
    # one prompt's per-step attentions and hidden states (per kept token, a tuple over layers).
    scores: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    attentions: list = field(default_factory=list)
    hidden_states: list = field(default_factory=list)

    def stats(self) -> dict:
        return {"index": self.index, "new_tokens": self.new, "rounds": self.rounds, "proposed": self.proposed,
                "accepted": self.accepted, "acceptance": self.accepted / self.proposed if self.proposed else 0.0}


@dataclass
class Round:
    """One round over the live rows."""

    option: Option
    prediction: object
    explored: bool
    limits: list[int]  # candidates each row may get (the length left)
    candidates: list[list[int]] = field(default_factory=list)
    q: list = field(default_factory=list)  # per row: [n, V] draft distributions (sampling), else None
    accepted: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill: bool = False  # the first round: the target's prompt prefill alone
    hits: list[bool] = field(default_factory=list)  # per row: its candidates came from a pre-drafted branch
    looked_up: list[bool] = field(default_factory=list)  # per row: its candidates came from the n-gram lookup
    next: tuple | None = None  # (option, prediction, explored) of the next round, decided by this round's job
    job: Option | None = None  # the option of the next round, pre-drafted during this one's verify
    job_budget: int = 0  # branches per row of that job (`_job_budget`)
    tree: Tree | None = None
    job_predicted: list[float] = field(default_factory=list)  # per row: P(its outcome is pre-drafted)
    bonus: list[int] = field(default_factory=list)
    found: list = field(default_factory=list)  # per row: the index of its branch in the tree, or None
    overhead_s: float = 0.0  # critical-path time of the job beyond the verify (collecting, adopting)
    catch_up_s: float = 0.0  # the draft reading what it lagged before this round drafted (`_catch_up`)
    times: tuple = ()  # perf_counter (start, candidates ready, verify start, verify end)
    cut: list[bool] = field(default_factory=list)  # per row: its candidates were cut by the length left
    fresh_branches: bool = False  # its hits came from a job whose copies met new buffers (`Tree.grown`)

    @property
    def capped(self) -> bool:
        """Whether a row got all that the length left allowed: its tokens say less than the option gives."""
        return any(cut and len(c) == n for cut, c, n in zip(self.cut, self.candidates, self.limits))

    def typical(self) -> bool:
        """Whether its rate speaks for its option: not capped by the length left (a call's last rounds), and not
        served by a job that paid a one-time allocation (on the simulated device at B = 8 a warm-up's first job at
        a new width took 35-50 ms to copy its rows, drafted nothing, and its round read 0.8-0.96x plain's rate;
        with a call's capped last rounds, every SSD option of a 16-token warm-up could read under plain's, and
        the early verdict (`BatchPlan._condemned_early`) then ran two 64-token calls plainly where the loop ran
        1.5-1.9x)."""
        return not (self.capped or self.fresh_branches)


def batch_options(config, fixed_budget: int, hooks: dict, fewer_threads: tuple[int, ...] = ()
                  ) -> tuple[list[Option], Option]:
    """(options, default): `allowed_options`, confidence-stopped SD included (each row stops on its own draft's
    confidence, `BatchDrafter.propose`; each batch size keeps the budgets within BATCH_BRANCHES,
    `BatchPlan.scheduler`), AR and SD at `fewer_threads` too; the default is plain SD at the configured gamma
    where that is an option, else the first of them."""
    options = allowed_options(config, "thread", fixed_budget, fewer_threads, wide=True)
    default = Option("sd", config.gamma) if Option("sd", config.gamma) in options else options[0]
    if "options" in hooks:  # tests and tooling restrict the choice
        options = list(hooks["options"](options)) or options
        default = default if default in options else options[0]
    return options, default


class BatchPlan:
    """The scheduler of each batch size in use (live rows rounded up to a power of two), over the pair's cost
    estimates at that size: a batched verify costs more per row on CPU cores than on an idle accelerator."""

    def __init__(self, target, draft, config, do_sample: bool, layout: str, hooks: dict, top_k: int,
                 single: bool = False, cpu_threads: int | None = None):
        self.target, self.draft, self.config, self.do_sample = target, draft, config, do_sample
        self.layout, self.top_k, self.hooks = layout, top_k, hooks
        # A call of one prompt: a pair that has never drafted warms up (AR until learning whether drafting pays
        # fits `SSDConfig.warmup_budget`, then a trial round) within the call, instead of a first call of plain
        # decoding, which would leave one-prompt calls (the command line's one call) no faster than the target.
        self.single = single
        fixed_budget, _ = config.resolved_budget(draft.device.type == "cuda")
        if isinstance(config.fanout, list):  # the user's bonuses per k: that many branches a row
            fixed_budget = sum(config.fanout)
        # One prompt on CPU cores shared with other work can run faster on one thread than on all: its AR and SD
        # rounds may also run with one (a batch's verify is compute-bound: it keeps its threads).
        fewer = (1,) if (single and layout == "thread" and not config.is_set("cpu_threads")
                         and (cpu_threads or 1) > 1) else ()
        self.options, self.default = batch_options(config, fixed_budget, hooks, fewer)
        self.auto_budgets = not (config.is_set("fanout_budget") or config.is_set("fanout")
                                 or config.schedule == "fixed")
        self._schedulers: dict[int, Scheduler] = {}

    def scheduler(self, rows: int) -> Scheduler:
        size = _size(rows)
        if size not in self._schedulers:
            options = [o for o in self.options if o.kind != "ssd" or o.budget * size <= BATCH_BRANCHES
                       or not self.auto_budgets] or self.options
            default = self.default if self.default in options else options[0]
            costs = cost_model_for(self.target, self.draft, self.draft.device, estimates_key(size, self.layout),
                                   self.do_sample, self.top_k, self.config.initial_acceptance,
                                   self.config.draft_matmul, self.config.verify_matmul)
            with costs.lock:
                costs.new_call()
                if costs.draft_step_hint is None:  # what a warm-up prices a draft step at before any is measured
                    costs.draft_step_hint = step_seconds(self.draft)
            # A job's late branches (speculate.py) start a step after the others, as one prompt's do.
            warmup = self.config.warmup_budget if self.single and self.config.schedule == "auto" else None
            self._schedulers[size] = Scheduler(self.config, costs, options, default,
                                               inline=self.layout == "inline", rows=size, deferred_record=True,
                                               warmup_budget=warmup,
                                               every_family=bool(self.hooks.get("every_family")))
        return self._schedulers[size]

    def scheduler_for(self, live: int, start: int) -> Scheduler:
        """The scheduler of a round with `live` rows in a call that began with `start` rows: the live rows' size
        once its estimates hold INFORMED_ROUNDS rounds, else the call's own. A batch's last rows (its slowest,
        often a third of its rounds) would otherwise run on a size that only such tails measure, exploring from
        the priors while the call's size is informed; fewer rows cost about the same on an accelerator and less
        on CPU cores, so the call's estimates err on the slow side. Every round is measured at its live rows'
        own size (`decode`): a tail round's cheaper verify and higher rate per row, counted at the call's size,
        made SD look faster than plain decoding there (real pair, B = 8)."""
        if _size(live) != _size(start):
            costs = self._informed(_size(live))
            if costs is None or costs.rounds_seen < INFORMED_ROUNDS:
                return self.scheduler(start)
        return self.scheduler(live)

    def _informed(self, size: int):
        return self._schedulers[size].costs if size in self._schedulers else self._sizes().get(size)

    def plain(self, rows: list[Row], new_tokens: int) -> bool:
        """Whether the call runs plain batched decoding (plain.py) instead of the loop, from whole calls measured
        at its batch size. The first call at a size runs plain decoding (what the caller would run without
        hf_ssd) and measures its steps; the next runs the loop and measures its speedup over them; later calls
        compare plain's time for the call with the loop's (the draft's prompt prefill, then plain's time over the
        speedup). Before the loop is measured at a size, the nearest smaller measured size's verdict holds if it
        is plain (adding rows only makes a verify more compute-bound; `_smaller_says_plain`). Every PLAIN_REFRESH-th plain call in a row
        runs the loop anyway, so that its measured speedup follows the machine."""
        if Option("ar") not in self.options:
            return False
        size = _size(len(rows))
        costs = self.scheduler(len(rows)).costs
        prompt = sum(len(r.real) for r in rows)
        with costs.lock:
            plain = _plain_wins(costs, prompt, new_tokens)
            judged, why = plain is not None, "whole calls measured"
            if not judged and costs.plain_step.count == 0:
                plain, why = True, "a new size: plain first, measured"
            elif not judged:
                judged = self._smaller_says_plain(size)
                plain = judged or self._condemned_early(len(rows), prompt, new_tokens)
                why = "a smaller size's verdict" if judged else "early verdict from the rounds measured"
                costs.plain_verdict = plain
            costs.plain_streak = costs.plain_streak + 1 if plain else 0
            # An early verdict rests on a few rounds (a warm-up call's, perhaps slowed), and plain calls measure
            # no loop rounds to revise it: it is tried again sooner than a judged one (real pair, B = 2: a warm-up
            # condemned the loop, and 8 calls in a row then ran plain at 0.99x where the loop ran 1.77-1.79x).
            if costs.plain_streak > (PLAIN_REFRESH if judged else EARLY_REFRESH):
                costs.plain_streak, plain, why = 0, False, "refresh after plain calls in a row"
            logger.debug("hf_ssd: %d rows x %d new tokens: %s (%s; plain step %s s, loop speedup %s, straggle %s)",
                         len(rows), new_tokens, "plain batched decoding" if plain else "the loop", why,
                         _fmt(_plain_step(costs)), _fmt(costs.loop_speedup.value),
                         _fmt(costs.straggle_at(new_tokens - 1)))
        return plain

    def _smaller_says_plain(self, size: int) -> bool:
        """Whether the largest smaller size with a verdict found the loop's decoding no faster than plain's: its
        whole loop calls' speedup, or else its early verdict. Adding rows only makes a verify more compute-bound.
        Its refresh is then as rare as a judged verdict's (real pair: B = 8 condemned the loop early, and B = 16,
        left to the rounds of its one 16-token loop call, ran a 64-token loop call at 0.86x plain). The speedup,
        not the smaller size's verdict on this call: that one counts the draft's prefill against the call's new
        tokens, and a short call's plain verdict at B = 4 (whose loop decoded 1.3x plain) kept B = 8's 16-token
        call from measuring the loop, so that its first 64-token call did, at 0.83x."""
        nearest = self._nearest_smaller(size)
        if nearest is None:
            return False
        _, other = nearest
        with other.lock:
            if other.loop_speedup.count:
                return other.loop_speedup.value <= 1.0
            return bool(other.plain_verdict)

    def _condemned_early(self, rows: int, prompt_tokens: int, new_tokens: int) -> bool:
        """Before the loop's speedup is judged at this size: whether the loop rounds measured so far show that a
        call of these prompt and new tokens would run slower than plain decoding at its step (one token a row,
        `_plain_step`): the draft's prompt prefill (which plain decoding never pays), then the new tokens at the best
        option's rate, neither as measured (tokens a row over seconds, each option's own rounds) nor as the
        per-round model rates it. Both only ever condemn the loop early, where its whole-call verdict would wait
        for VERDICT_MIN_STEPS chosen steps: a size's first loop call explores every option family and chooses
        none, and on the real pair at B = 8 the next loop call ran 0.7-0.87x plain's speed (the draft's prefill
        of 8 prompts took an eighth of plain's decoding time there, and the best one-round option rate was 1.35x
        plain's). (The model alone is optimistic on CPU cores: it misses the rows that end early.) The loop must
        win by EARLY_MARGIN. Measured rounds are overruled where the model's best option wins by EARLY_OVERRULE
        once scaled by how the measured options fared: a first call measures plain SD and the narrowest SSD."""
        scheduler = self.scheduler(rows)
        costs = scheduler.costs
        step = _plain_step(costs)
        if not costs.rounds_seen or not step:
            return False
        steps = max(1, new_tokens - 1)  # the first token comes with the prefill, in both
        prefill_s = costs.draft_prefill.predict(prompt_tokens) or 0.0
        straggle = costs.straggle_at(steps)  # plain decoding has none

        def slower(rate: float) -> bool:  # tokens a row per second
            return rate <= 0 or (prefill_s + steps * straggle / rate) * EARLY_MARGIN >= steps * step

        # Each option's rate shrunk towards plain's (drafting gains nothing): a size's first loop call runs most
        # options for a round or two, and the best of a dozen one-round rates is a lucky one.
        measured = {o: costs.measured_rate(o, toward=1.0 / step) for o in costs.outcomes if o.kind != "ar"}
        scheduler.job_budget = lambda b: b  # a new call: all its rows live (a past call's tail set it wider)
        with costs.frozen():
            best_option, best = scheduler.best()
            predicted = {o: scheduler.predict(o) for o in measured}
        logger.debug("hf_ssd: early verdict at %d rows: plain step %.3f s, straggle %.2f, draft prefill %.2f s, "
                     "interference %s; per-row rate over plain's: model's best %s %.2f, measured %s", rows, step,
                     straggle, prefill_s, _fmt(costs.interference()), best_option.name,
                     (best.rate if best is not None else 0.0) * step,
                     {o.name: round(r * step, 2) for o, r in measured.items()})
        if best is not None and slower(best.rate):
            return True
        if not measured or not slower(max(measured.values())):
            return False
        # The rounds measured say slower, but they ran what a first call runs (plain SD, the narrowest SSD): where
        # the model rates best an option of a family not measured (a wider fan-out), overruled if that option,
        # scaled by how the measured options fared against their predictions, wins by EARLY_OVERRULE (simulated
        # device, B = 2: b = 1 and plain SD measured 1.05x and 0.95x plain, the model's b = 8 ran 2.1x). A family
        # measured slower stands (real pair, B = 8: the model rated sd(g=5) 1.69x, sd(g=4) measured 1.03x).
        # Each prediction shrunk as its measurement is (towards plain's rate by a few rounds): against the bare
        # prediction, an option that ran one round at its predicted rate read as faring worse (simulated device,
        # B = 16: scaled by 0.88, the loop condemned at 1.21x where it ran 1.65x).
        fared = [(measured[o], costs.shrunk_rate(o, p.rate, 1.0 / step)) for o, p in predicted.items()
                 if p is not None and p.rate > 0]
        if best is None or not fared or best_option.family in {o.family for o in measured}:
            return True
        # Wider fan-outs win only by hiding their job behind hardware the verify leaves idle: where the jobs
        # measured slowed the verify, a wider one would slow it more than the model, which assumes the narrower
        # one's slowdown, says.
        if costs.interference() is not None and not costs.idle_beside_jobs():
            return True
        scale = min(1.0, sum(m for m, _ in fared) / sum(r for _, r in fared))
        return best.rate * scale / straggle < EARLY_OVERRULE / step

    def _nearest_smaller(self, size: int) -> tuple[int, object] | None:
        """(batch size, CostModel) of this pair's estimates with a verdict (a judged loop call, or an early
        verdict) at the largest size of 2 .. size / 2, or None."""
        found = [(s, c) for s, c in self._sizes().items()
                 if 2 <= s <= size // 2 and (c.loop_speedup.count or c.plain_verdict is not None)]
        return max(found, key=lambda x: x[0], default=None)

    def _sizes(self) -> dict[int, object]:
        """Batch size -> this pair's CostModel for batches of that size in this plan's setting (device, layout,
        mode), created by earlier calls."""
        names = {estimates_key(s, self.layout): s for s in (1 << i for i in range(12))}
        return {names[key[2]]: costs for key, costs in estimates_of(self.target, self.draft)
                if key[2] in names and key[1] == str(self.draft.device)
                and key[3:] == (self.do_sample, self.top_k, self.config.draft_matmul, self.config.verify_matmul)}


def estimates_key(size: int, layout: str) -> str:
    """The name of a batch size's estimates (`cost_model_for`): one prompt's are the layout's own, whichever path
    ran it (the tuning profile `hf-ssd tune` writes is under it); a batch's are apart, its verify costing more."""
    return layout if size == 1 else f"batch{size}:{layout}"


def _listed(fanout) -> list[int]:
    """An explicit fan-out list's entries (bonuses per k), or none."""
    return list(fanout) if isinstance(fanout, list) else []


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _size(rows: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(rows, 1))))


def _plain_step(costs) -> float | None:
    """Seconds of a step of plain batched decoding at this size: the faster of plain calls' measured step and the
    loop's own AR rounds (the target alone over the same rows, measured beside the drafting options they are
    compared with). Plain calls measured on a machine slowed for a while would otherwise flatter the loop (real
    pair, B = 8: one run's plain step read 0.66 s against 0.50-0.55 s in others, and a loop call its rounds let
    through ran 0.84x plain). None before a plain call."""
    step = costs.plain_step.value
    if not step:
        return step
    ar = costs.measured_rate(Option("ar"), toward=1.0 / step)  # one token a row a round; shrunk as the others
    return min(step, 1.0 / ar) if ar > 0 else step


def _plain_wins(costs, prompt_tokens: int, new_tokens: int) -> bool | None:
    """Whether plain batched decoding is predicted no slower than the loop for a call of these prompt and new
    tokens, from the whole calls measured on `costs` (None: plain or the loop not measured)."""
    step, speedup = _plain_step(costs), costs.loop_speedup.value
    if not costs.loop_speedup.count or step is None or not speedup:
        return None
    plain_s = max(1, new_tokens - 1) * step  # the first token comes with the prefill, in both
    return plain_s <= (costs.draft_prefill.predict(prompt_tokens) or 0.0) + plain_s / speedup


def _rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[Row]:
    ids = input_ids.tolist()
    mask = attention_mask.tolist() if attention_mask is not None else [[1] * len(r) for r in ids]
    return [Row(i, list(r), [t for t, keep in zip(r, row_mask) if keep]) for i, (r, row_mask) in enumerate(zip(ids, mask))]


class _Processing:
    """The generation's logits processors for each row's context (all rows at once where they are context-free).

    A context-dependent processor may hold state per row of the caller's batch (transformers' repetition penalty
    keeps each row's padding length; a `prefix_allowed_tokens_fn` gets the row's index), so it is called with a
    batch of the caller's size: each row's context at its own index, rows of one context length together (one
    call per position), the other indices filled with a copy."""

    def __init__(self, processors, batch: int):
        self.procs = processors
        self.batch = batch
        self.free = all(type(p).__name__ in CONTEXT_FREE for p in processors or [])

    def __call__(self, rows: list[Row], candidates: list[list[int]], logits: torch.Tensor) -> list[torch.Tensor]:
        """logits [rows, G + 1, V]: per row its [n + 1, V] scores after the processors."""
        out = [logits[i, : len(c) + 1] for i, c in enumerate(candidates)]
        if not self.procs:
            return out
        if self.free:
            flat = torch.cat(out)
            dummy = torch.zeros(flat.shape[0], 1, dtype=torch.long, device=flat.device)
            scores = self.procs(dummy, flat)
            return list(scores.split([len(c) + 1 for c in candidates]))
        processed = [[None] * (len(c) + 1) for c in candidates]
        groups: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(len(row.ids), []).append(i)
        for members in groups.values():
            for j in range(max(len(candidates[i]) for i in members) + 1):
                at = [i for i in members if j <= len(candidates[i])]
                context = torch.tensor([rows[i].ids + candidates[i][:j] for i in at], device=logits.device)
                index = torch.tensor([rows[i].index for i in at], device=logits.device)
                fill = torch.zeros(self.batch, dtype=torch.long, device=logits.device)  # other indices: the first's
                fill[index] = torch.arange(len(at), device=logits.device)
                scores = torch.stack([out[i][j] for i in at])
                result = self.procs(context[fill], scores[fill])  # indexing copies: processors may write in place
                for i, r in zip(at, result[index]):
                    processed[i][j] = r
        return [torch.stack(p) for p in processed]


def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
           streamer=None, *, ssd_draft, ssd_config, ssd_stats: SSDStats, ssd_layout: str = "thread",
           ssd_hooks: dict | None = None, ssd_streamer=None, ssd_cpu_threads: int | None = None, **model_kwargs):
    """The `custom_generate` callable of batched calls (see the module docstring). `ssd_streamer`: the caller's
    streamer (one row), which transformers does not hand to a callable; it gets the prompt, each round's new
    tokens, then `end()`, as transformers' own loops give them. `ssd_cpu_threads`: the call's torch threads on CPU
    cores (`layouts.thread_settings`), which a round of an option with fewer sets for its own forwards."""
    streamer = ssd_streamer if ssd_streamer is not None else streamer
    if ssd_streamer is not None:
        ssd_streamer.put(input_ids.cpu())
    do_sample = bool(generation_config.do_sample)
    pad = int(generation_config._pad_token_tensor) if generation_config._pad_token_tensor is not None else 0
    keep = _Kept.of(generation_config, pad)
    eos = getattr(generation_config, "_eos_token_tensor", None)
    eos = set(eos.flatten().tolist()) if eos is not None else set()
    rows = _rows(input_ids, model_kwargs.get("attention_mask"))
    single = len(rows) == 1
    plan = BatchPlan(model, ssd_draft, ssd_config, do_sample, ssd_layout, ssd_hooks or {},
                     top_k=max(AUTO_BUDGETS + WIDE_BUDGETS + tuple(_listed(ssd_config.fanout))) + 1, single=single,
                     cpu_threads=ssd_cpu_threads)
    ssd_stats.batch_size = len(rows)
    if (not single and (ssd_hooks or {}).get("plain", True)
            and plan.plain(rows, generation_config.max_length - input_ids.shape[1])):
        return decode_plain(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                            streamer, model_kwargs, plan.scheduler(len(rows)).costs, ssd_stats, eos)
    target = RaggedCache(model)
    target.ask = keep.asked_of_the_model()
    # Sampling: the draft draws from its own generator, seeded from the caller's RNG, so that draws on the
    # speculator's thread never interleave with the target's on one generator (seeded inline runs repeat).
    gen = None
    if do_sample:
        gen = torch.Generator(device=ssd_draft.device)
        gen.manual_seed(int(torch.randint(0, 2**62, (1,))))
    drafter = BatchDrafter(ssd_draft, model.config.get_text_config().vocab_size, do_sample, logits_processor, pad,
                           top_k=plan.top_k, generator=gen, saguaro_c=ssd_config.saguaro_c)
    process = _Processing(logits_processor, batch=len(rows))
    # fanout="calibrated" set by the caller: jobs rank each row's outcomes by P(k) from the draft's confidence,
    # learned per draft model (shared with single-prompt calls). Left unset, a batch splits per k (geometric): on
    # the simulated device at B = 8, b = 16, the calibrated ranking hit 92-94% of the full batch's lookups
    # against 96% and took 60 rounds against 57-58 (docs/scheduling.md, "Batches").
    calibration = (calibration_for(ssd_draft, do_sample, ssd_config.initial_acceptance)
                   if ssd_config.fanout == "calibrated" and ssd_config.passed("fanout") else None)
    stops = _stop_rule(stopping_criteria, input_ids.device)
    ngram = ssd_config.ngram_size if ssd_config.fallback == "ngram" else 0  # a miss's lookup: its longest n-gram
    max_length = generation_config.max_length
    stats = ssd_stats
    live = [r for r in rows if len(r.ids) < max_length]
    for r in rows:
        r.done = r not in live
    # On one GPU the job's draft work goes on its own CUDA stream (so does the caller's, `on_critical_path`).
    speculator = Speculator(ssd_layout if ssd_layout in ("inline", "stream") else "thread", ssd_cpu_threads,
                            ssd_draft.device)
    inference = torch.is_inference_mode_enabled()  # the job's thread runs in the caller's mode

    def allowed(row: Row, o: Outcome) -> bool:  # an outcome worth a branch: the row goes on after it
        return o.bonus not in eos and len(row.ids) + o.accepted + 2 < max_length

    call_costs = plan.scheduler(len(rows)).costs  # the call's verdict on plain decoding is kept at its batch size
    ssd_stats.profile = getattr(call_costs, "profile", None)  # the tuning profile its estimates started from
    share = len(rows) if plan.auto_budgets else 0  # rows whose job branches the live rows share (`_job_budget`)
    first, nxt, grown, decoding = True, None, False, None
    measure = None  # the last round's measuring, done by the next round's job beside its verify (or at the end)
    rated = [0.0, 0.0]  # the decode rounds of the call's size: tokens a row as rates count them, seconds
    try:
        # One prompt's draft reads its prompt when it first drafts (`_catch_up`): a call that stays AR (a short
        # one on a pair that never drafted, or one whose trial lost) never pays for it.
        draft_prefill_s = 0.0
        if not single:
            with speculator.on_critical_path():
                draft_prefill_s = _prefill_draft(drafter, live, call_costs)
        while live:
            scheduler = plan.scheduler_for(len(live), len(rows))
            own = plan.scheduler(len(live))  # the round's costs go to its own size's estimates
            scheduler.job_budget = own.job_budget = functools.partial(_job_budget, share=share, live=len(live),
                                                                      room=ssd_config.cache_size)
            rnd = _schedule(scheduler, live, first, nxt, max_length, ssd_config)
            rnd.fresh_branches = grown
            _threads(rnd.option, ssd_cpu_threads)
            with speculator.on_critical_path():
                rnd.catch_up_s = _catch_up(drafter, live, rnd, own.costs, ngram)
                t0, copied = time.perf_counter(), setup_seconds()  # the draft's time from here: its steps
                _propose(drafter, live, rnd, ngram, _held(scheduler, rnd.option, drafter))
            t1, copied = time.perf_counter(), setup_seconds() - copied  # a first one-row step's float16 copies
            feed = _verify_feed(target, live, rnd.candidates, pad)  # before the job starts: see `_verify_feed`
            # The job measures the last round, decides the next round's option, then pre-drafts it if it is SSD
            # (in the prefill round too: its job pre-drafts round 2 behind the prefill). One prompt's AR and SD
            # rounds have none: they measure and decide after their verify (`_measure_now`).
            overlap = not single or rnd.prefill or rnd.option.kind == "ssd"
            if overlap:
                _submit(speculator, drafter, live, rnd, scheduler, allowed, inference, calibration, ssd_hooks or {},
                        measure, max_length)
                measure = None
            t2, timed = time.perf_counter(), setup_seconds()  # inline, the job ran in between: it is overhead
            logits, fed = _verify(target, feed, speculator.start)
            timed = setup_seconds() - timed  # a first verify's timing of the target's product (`verify_matmul`)
            scores = process(live, rnd.candidates, logits)
            new_tokens = _accept(rnd, scores, do_sample)
            t3 = time.perf_counter()
            speculator.collect()  # the job stops at its next step; its error is raised here
            nxt, grown = rnd.next, rnd.tree is not None and rnd.tree.grown
            _commit(target, drafter, live, rnd, fed)
            kept = _advance(live, new_tokens, stops, rnd.explored)
            keep(live, kept, scores, logits)
            keep.internals(live, kept, target, fed, rnd)
            if streamer is not None:  # one row (batches refuse a streamer)
                streamer.put(torch.tensor(live[0].ids[-kept[0]:]))
            with speculator.on_critical_path():
                _adopt(drafter, live, rnd)
            rnd.draft_s, rnd.verify_s, rnd.times = t1 - t0 - copied, t3 - t2 - timed, (t0, t1, t2, t3)
            rnd.overhead_s = (t2 - t1) + (time.perf_counter() - t3) + (draft_prefill_s if first else 0.0)
            done = functools.partial(_measure, own, stats, rnd, list(live), [r.tops for r in live], sum(kept),
                                     first, do_sample, calibration, ssd_config.record_timeline, own.job_budget,
                                     max_length)
            if overlap:
                measure = done
            else:
                _measure_now(measure, done)
                measure = None
            if not first and _size(len(live)) == _size(len(rows)):
                rated[0] += sum(kept) / len(live)
                rated[1] += rnd.draft_s + rnd.verify_s + rnd.overhead_s
            first = False
            live = _leave(live, target, drafter)
            decoding = decoding or time.perf_counter()  # the target's prefill done: decoding starts
    except BaseException as err:
        try:
            speculator.close()  # background work never outlives the call
        except BaseException as close_err:  # noqa: BLE001 - the error already propagating is the one to report
            logger.error("hf_ssd: closing the speculator after %s also failed: %r", type(err).__name__, close_err)
        raise
    speculator.close()
    if measure is not None:
        measure()
    stats.intervals["speculate"] = list(speculator.busy)
    call = plan.scheduler(len(rows))  # the call's size: its warm-up, and the estimates it leaves
    stats.warmup_rounds, stats.warming_up = call.warmup_rounds, call.warming
    stats.cost_model = call.costs.snapshot(call.default.gamma, sorted({o.budget for o in call.options if o.kind == "ssd"}))
    if decoding is not None:
        _measure_call(call_costs, rows, time.perf_counter() - decoding, stats.explored_seconds, rated)
    stats.rows = [r.stats() for r in rows]
    stats.draft_forwards = drafter.forwards
    width = max(len(r.ids) for r in rows)
    sequences = torch.tensor([r.ids + [pad] * (width - len(r.ids)) for r in rows], dtype=input_ids.dtype,
                             device=input_ids.device)
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences, **keep.outputs(rows))
    return sequences


@dataclass
class _Kept:
    """What `return_dict_in_generate` asks to keep beside the sequences: each new token's processed scores
    (`output_scores`) and raw logits (`output_logits`), float32, one [B, V] tensor per step as transformers' loops
    return them. A row that ended before the longest one gets, at each later step, scores that put all mass on the
    pad token it is padded with (transformers' own batched loop keeps computing finished rows; this loop drops
    them). One prompt (batches refuse them) also gets the target's attentions and hidden states per step, as
    transformers' loops split them: the first step's over the whole prompt, then one query each."""

    scores: bool
    logits: bool
    pad: int
    attentions: bool = False
    hidden_states: bool = False

    @classmethod
    def of(cls, generation_config, pad: int) -> _Kept:
        asked = bool(generation_config.return_dict_in_generate)
        return cls(asked and bool(generation_config.output_scores), asked and bool(generation_config.output_logits),
                   pad, asked and bool(generation_config.output_attentions),
                   asked and bool(generation_config.output_hidden_states))

    def asked_of_the_model(self) -> dict:
        """The target forward's keyword arguments for what is kept."""
        return {k: True for k, on in (("output_attentions", self.attentions),
                                      ("output_hidden_states", self.hidden_states)) if on}

    def __call__(self, live: list[Row], kept: list[int], scores: list[torch.Tensor], logits: torch.Tensor) -> None:
        """The round's kept tokens' scores and logits, per row (`kept`: its tokens appended this round)."""
        if not (self.scores or self.logits):
            return
        for i, (row, n) in enumerate(zip(live, kept)):
            if self.scores:
                row.scores.append(scores[i][:n].float().clone())
            if self.logits:
                row.logits.append(logits[i, :n].float().clone())

    def internals(self, live: list[Row], kept: list[int], target: RaggedCache, fed: list[int], rnd: Round) -> None:
        """One prompt's attentions and hidden states of the round's kept tokens, from the verify's forward: the
        token after query q (the row's unverified tokens, then its candidates) is step q - (fed - 1); its keys are
        the row's attended columns up to the query's own, in order (rejected candidates' columns are masked)."""
        if not (self.attentions or self.hidden_states) or target.internals is None:
            return
        row, n, p = live[0], kept[0], fed[0]
        attentions, hidden = target.internals
        columns = target.mask[0].nonzero().flatten()  # attended (rejected candidates are masked by now)
        block = p + len(rnd.candidates[0])  # the verify's columns (one row: no padding)
        before = int(target.mask[0, : target.columns - block].sum())  # attended before them
        steps = [slice(0, p)] if rnd.prefill else [slice(p - 1 + j, p + j) for j in range(n)]
        for q in steps:
            if self.attentions:
                row.attentions.append(tuple(
                    None if a is None else a[:, :, q][..., columns[: before + q.stop]] for a in attentions or ()))
            if self.hidden_states:
                row.hidden_states.append(tuple(h[:, q] for h in hidden or ()))

    def outputs(self, rows: list[Row]) -> dict:
        out = {"scores": self._steps(rows, "scores") if self.scores else None,
               "logits": self._steps(rows, "logits") if self.logits else None}
        if self.attentions:
            out["attentions"] = tuple(rows[0].attentions)
        if self.hidden_states:
            out["hidden_states"] = tuple(rows[0].hidden_states)
        return out

    def _steps(self, rows: list[Row], name: str) -> tuple[torch.Tensor, ...]:
        per_row = [torch.cat(getattr(r, name)) if getattr(r, name) else None for r in rows]
        some = next((t for t in per_row if t is not None), None)
        if some is None:
            return ()
        steps = max(t.shape[0] for t in per_row if t is not None)
        ended = torch.full((steps, some.shape[1]), float("-inf"), device=some.device)
        ended[:, self.pad] = 0.0
        full = torch.stack([ended if t is None else torch.cat([t, ended[t.shape[0]:]]) for t in per_row])
        return tuple(full[:, j] for j in range(steps))


def _prefill_draft(drafter: BatchDrafter, live: list[Row], costs) -> float:
    """0. The draft's prompt prefill, timed (it is what a loop call pays and plain decoding does not); its time is
    the prefill round's too."""
    t = time.perf_counter()
    fed = drafter.prefill(live)
    seconds = time.perf_counter() - t
    if fed:
        costs.add_draft_prefill(fed, seconds)
    return seconds


def _measure_call(costs, rows: list[Row], seconds: float, explored_s: float, rated=(0.0, 0.0)) -> None:
    """The loop's speedup over plain batched decoding in this call: plain's steps for the same output (until the
    longest row ended; all rows each step) at its step time (`_plain_step`), over the loop's time after the prefill.
    Rounds run to explore are left out (their time, and their share of the output in plain's steps): a size's
    first loop call explores most, and judged whole it would condemn the loop where its chosen rounds pay. Calls
    add up until they hold VERDICT_MIN_STEPS steps (`CostModel.add_loop_call`); until then the next call at this
    size runs the loop again.

    Also the call's straggle: its time after the prefill over what its rounds at its own size predict for it, the
    longest row's tokens at their rate (`rated`: their tokens a row, each round's over its live rows, and their
    seconds). A rate measured per round is a mean over the round's rows, and a call lasts until its slowest row
    ends, through rounds of fewer rows (real pair, B = 8: rounds at 1.06-1.11x plain's rate, calls at
    0.76-0.86x); the early verdict scales its predicted call by it (`BatchPlan._condemned_early`)."""
    after_prefill = sum(r.new for r in rows) - len(rows)  # each row's first token came with the prefill
    chosen = after_prefill - sum(r.explored_new for r in rows)
    longest = max(r.new for r in rows) - 1
    steps = longest * (chosen / after_prefill if after_prefill > 0 else 0.0)
    with costs.lock:
        if longest > 0 and rated[0] > 0 and rated[1] > 0:
            at_rate = longest * rated[1] / rated[0]
            costs.add_straggle(seconds / at_rate, longest)
            logger.debug("hf_ssd: loop call of %d rows: %.2f s after the prefill, %.2f s at its rounds' rate",
                         len(rows), seconds, at_rate)
        step, seconds = _plain_step(costs), seconds - explored_s
        if steps > 0 and step is not None and seconds > 0:
            costs.add_loop_call(steps * step, seconds, steps, VERDICT_MIN_STEPS)


def _decide(scheduler: Scheduler, live: list[Row], max_length: int) -> tuple[Option, object, bool]:
    """The next round's option. One row's context (what the draft has not read, what the target holds, what the
    call may still make) lets the scheduler warm up, catch the draft up and try drafting once a call
    (`Scheduler.decide`); a batch's rows differ, and its scheduler decides on the estimates alone."""
    lag = context = remaining = 0
    if len(live) == 1:
        row = live[0]
        lag = max(0, len(row.real) - row.draft_fed - row.draft_feed)
        context, remaining = len(row.real), max(0, max_length - len(row.ids))
    with scheduler.costs.lock:
        return scheduler.decide(lag, context, remaining)


def _schedule(scheduler: Scheduler, live: list[Row], first: bool, decided, max_length: int, config) -> Round:
    """1. The round's option and each row's candidate budget: its branch if it has one, else what the option
    drafts now (an SSD round drafts the miss fallback's length), never past the length left."""
    if first:  # the target's prompt prefill, alone: it yields each row's first token
        option, prediction, explored = Option("ar"), None, False
        scheduler.prefilled()
    elif decided is not None:
        option, prediction, explored = decided
    else:
        option, prediction, explored = _decide(scheduler, live, max_length)
    lefts = [max(0, max_length - len(r.ids) - 1) for r in live]
    hits = [option.kind == "ssd" and r.ready is not None and left > 0 for r, left in zip(live, lefts)]
    if option.kind == "ar" or all(hits):
        now = 0
    elif option.kind == "sd":
        now = option.gamma
    else:  # the model's miss fallback, priced only where a row missed (0.1 ms a round)
        now = _fallback_length(scheduler, option, config)
    wanted = [min(len(r.ready.tokens) if hit else now, option.gamma) for r, hit in zip(live, hits)]
    limits = [min(n, left) for n, left in zip(wanted, lefts)]
    return Round(option, prediction, explored, limits, prefill=first, hits=hits,
                 cut=[left < n for n, left in zip(wanted, lefts)])


def _threads(option: Option, cpu_threads: int | None) -> None:
    """The round's torch threads on the caller's thread (its draft steps and verify): the option's, else the
    call's. The job's thread keeps the call's (`Speculator`); the call's are restored when it ends."""
    want = option.threads or cpu_threads
    if want and torch.get_num_threads() != want:
        torch.set_num_threads(want)


def _catch_up(drafter: BatchDrafter, live: list[Row], rnd: Round, costs, ngram: int = 0) -> float:
    """1b. Before a round drafts (or, `rnd` None, a job pre-drafts), the draft reads what its drafting rows lag
    beyond the round's last tokens (a prompt it has not read, AR rounds), timed apart as a prefill: timed with
    the draft's steps, it would rate the draft's step by the lag. Returns its seconds."""
    if rnd is None:  # a job's: every row (the job drafts for all)
        drafting = [True] * len(live)
    elif rnd.option.kind == "ar" or (ngram and rnd.option.kind == "ssd"):  # AR, or a miss's lookup: no drafting
        return 0.0
    else:
        drafting = [not hit and n > 0 for hit, n in zip(rnd.hits, rnd.limits)]
    lagging = [r for r, d in zip(live, drafting)
               if d and not r.draft_feed and not r.tagged and len(r.real) - r.draft_fed > CATCH_UP_LAG]
    if not lagging:
        return 0.0
    t = time.perf_counter()
    fed = drafter.catch_up(live, lagging)
    seconds = time.perf_counter() - t
    if fed and not (rnd is not None and rnd.option.threads):  # the prefill's fit is of the call's threads
        costs.add_draft_prefill(fed, seconds)
    return seconds


def _fallback_length(scheduler: Scheduler, option: Option, config) -> int:
    """Candidates an SSD round drafts now for a row without a branch (a miss, or the first SSD round)."""
    if scheduler.auto_fallback:
        with scheduler.costs.lock:
            return scheduler.miss_fallback(option)
    if config.fallback == "ar":
        return 0
    if config.fallback == "short":
        return min(option.gamma, config.effective_fallback_gamma)
    return option.gamma


def _held(scheduler: Scheduler, option: Option, drafter: BatchDrafter) -> list[int]:
    """Saguaro sampling: per candidate position, the bonuses a job of this SSD option holds for a rejection there
    (the fan-out list, else its geometric split; `BatchDrafter.draw`); none otherwise."""
    if drafter.saguaro_c is None or option.kind != "ssd":
        return []
    return fanout_split(scheduler.config.fanout, scheduler.job_budget(option.budget), scheduler.costs.acceptance,
                        option.gamma)


def _propose(drafter: BatchDrafter, live: list[Row], rnd: Round, ngram: int = 0, held: list[int] = ()) -> None:
    """2. Candidates for every row: a hit's pre-drafted branch, or the draft's tokens now; with `ngram` (the
    "ngram" fallback's longest n-gram) a missed row of an SSD round looks its candidates up in its own context
    instead (prompt lookup: no draft forward; a point-mass q when sampling, which verification keeps exact).
    `held`: Saguaro sampling's bonuses held per position (`_held`)."""
    lookup = ngram > 0 and rnd.option.kind == "ssd"
    rnd.looked_up = [lookup and not hit and n > 0 for hit, n in zip(rnd.hits, rnd.limits)]
    draw = [0 if hit or looked else n for hit, looked, n in zip(rnd.hits, rnd.looked_up, rnd.limits)]
    if max(draw, default=0) > 0:
        rnd.candidates, rnd.q = drafter.propose(live, draw, stop=rnd.option.stop, cached=held)
    else:
        rnd.candidates, rnd.q = [[] for _ in live], [None] * len(live)
    for i, (row, hit, n) in enumerate(zip(live, rnd.hits, rnd.limits)):
        if not hit and not draw[i] and not rnd.prefill:  # the prefill round keeps the draft prefill's tops
            row.tops = []  # nothing drafted for this row this round
        if rnd.looked_up[i]:
            tokens = ngram_lookup(row.real, n, ngram)
            rnd.candidates[i] = tokens
            if drafter.do_sample and tokens:
                rnd.q[i] = torch.nn.functional.one_hot(torch.tensor(tokens), drafter.vocab).float()
        if hit:
            b = row.ready
            rnd.candidates[i] = b.tokens[:n]
            rnd.q[i] = torch.stack(b.q[:n]) if b.q else None
            row.tops = list(b.tops[:n]) + [b.tops[n] if n < len(b.tops) else None]
            row.tagged, row.draft_feed = len(b.tokens) - 1, 0
        row.ready = None


def _submit(speculator: Speculator, drafter: BatchDrafter, live: list[Row], rnd: Round, scheduler: Scheduler,
            allowed, inference: bool, calibration, hooks: dict, measure: Callable[[], None] | None,
            max_length: int) -> None:
    """3. The job beside the verify: it measures the last round (`measure`, `_measure`), decides the next round's
    option (`rnd.next`) and, if that is SSD, pre-drafts its branches. It starts as the target's forward starts
    (`_verify`), so that neither holds up the other's Python (the interpreter lock): on the simulated device at
    B = 8 measuring and deciding took 0.3 and 0.55 ms a round on the critical path, and the verify's first ops
    waited 1.3-2.3 ms a round for a job started before them."""
    candidates = [list(c) for c in rnd.candidates]
    fanout = scheduler.config.fanout if isinstance(scheduler.config.fanout, list) else None
    # Behind the prompt prefill the job's deadline is the prefill's predicted time: untimed, the caller waited for
    # a step begun just before the prefill ended (simulated device, B = 8: 3-9 ms a call).
    prompt = sum(len(r.real) for r in live) if rnd.prefill else 0

    def stage(name: str) -> None:  # tests plant faults at a job's stages (tests/test_faults.py)
        if name in hooks:
            hooks[name]()

    def job(should_stop):
        start = time.perf_counter()  # the clock of the job's deadline and of the set-up the model counts
        if measure is not None:
            measure()
        rnd.next = _decide(scheduler, live, max_length)
        option = rnd.next[0]
        if option.kind != "ssd":
            return
        rnd.job, rnd.tree = option, Tree()
        with torch.inference_mode(inference):  # rows the draft lags (AR rounds, an unread prompt) read first
            _catch_up(drafter, live, None, scheduler.costs)
        rnd.job_budget = budget = scheduler.job_budget(option.budget)  # `_job_budget`, as the model predicts it
        with scheduler.costs.lock, scheduler.costs.frozen():  # rows of one length share a prediction
            alpha = scheduler.costs.acceptance
            rnd.job_predicted = [scheduler.hit_rate(budget, len(c), alpha, calibrated=False) for c in candidates]
            verify_s = (scheduler.costs.prefill.predict(prompt) if prompt
                        else scheduler.costs.verify(max(map(len, candidates)), option.budget))
            priors = [list(scheduler.costs.length_probs(len(c))) for c in candidates] if calibration else None
        deadline = start + verify_s if not scheduler.inline and verify_s is not None else None
        with torch.inference_mode(inference):
            speculate(drafter, live, candidates, option.gamma, budget, alpha, allowed, rnd.tree, should_stop,
                      deadline, calibration, priors, stage,
                      grace=lambda n: late_grace_s(alpha, n, option.gamma, verify_s), fanout=fanout,
                      cached=_held(scheduler, option, drafter), limit=scheduler.config.max_outcomes,
                      started=start)

    speculator.submit(job, hold=True)


def _measure_now(before: Callable[[], None] | None, this: Callable[[], None]) -> None:
    """A round without a job (one prompt's AR or SD round) measures itself, and the round before it that no job
    measured, on the caller's thread once its verify is done; the next round then decides there too
    (`_schedule`). Beside the verify, a job's Python slowed it on shared cores as much as a narrow SSD job did,
    so that one prompt's SD and ssd(b=1) rounds measured alike (simulated on-core device: ssd(b=1) for 25-55%
    of the round time at 0-25% hits, where the one-prompt path, which has no job in its SD rounds, ran SD only).
    On the caller's thread they cost about 1 ms a round (the tiny pair's options), against 0.4 s a round on the
    real pair."""
    if before is not None:
        before()
    this()


def _job_budget(budget: int, share: int, live: int, room: int) -> int:
    """Branches per row of a job of this budget: the budget, or, once rows have left a call that began with
    `share` rows (0: the budget is the user's, kept as set), that call's branches shared among the live rows
    (within BATCH_BRANCHES). A step over them costs about what the full batch's did, and a batch's last rows,
    whose rounds decide when the call ends, then miss less. The scheduler predicts hits with it too. Never more
    than `room` (`SSDConfig.cache_size`: the entries a row's speculation may hold, as for one prompt)."""
    shared = budget if live >= share else max(budget, min(BATCH_BRANCHES, budget * share) // live)
    return min(shared, room)


def _verify_feed(target: RaggedCache, rows: list[Row], candidates: list[list[int]], pad: int):
    """The verify's input: each row's unverified tokens (right-aligned) then its candidates, as the target's block
    (ids, valid, positions, candidate tags: `RaggedCache.block`), the candidate width, and the tokens fed per row.
    Built from lists (four tensors, not four tensor ops a row), before the speculation job starts, whose Python
    competes for the interpreter lock."""
    pending = [row.real[row.target_fed:] for row in rows]
    wp, g = max(len(p) for p in pending), max(len(c) for c in candidates)
    ids, valid, pos, tags = [], [], [], []
    for row, p, c in zip(rows, pending, candidates):
        lo, n = wp - len(p), len(p) + len(c)
        right = g - len(c)
        ids.append([pad] * lo + p + c + [pad] * right)
        valid.append([0] * lo + [1] * n + [0] * right)
        pos.append([0] * lo + list(range(row.target_fed, row.target_fed + n)) + [0] * right)
        tags.append([0] * wp + list(range(1, len(c) + 1)) + [0] * right)
    ids, valid, pos, tags = (torch.tensor(x, dtype=torch.long) for x in (ids, valid, pos, tags))
    return target.block(ids, valid, pos, tag=tags), g, [len(p) for p in pending]


def _verify(target: RaggedCache, feed, launched: Callable[[], None]):
    """4. One target forward over every row's `_verify_feed`; `launched` is called as it starts. Returns (logits
    [rows, G + 1, V] at the last unverified token and at every candidate position, tokens fed per row)."""
    block, g, fed = feed
    with verifying(g > 0):  # candidates to score: the target's verify product (`SSDConfig.verify_matmul`)
        return target.run(block, keep_last=g + 1, launched=launched), fed


def _accept(rnd: Round, scores: list[torch.Tensor], do_sample: bool) -> list[list[int]]:
    """5. Per row: the accepted candidates and the bonus (greedy matching or speculative sampling)."""
    new_tokens = []
    for c, q, s in zip(rnd.candidates, rnd.q, scores):
        if do_sample:
            k, bonus = accept_sampled(torch.softmax(s, dim=-1), q, c)
        else:
            k, bonus = accept_greedy(s.argmax(-1).tolist(), c)
        rnd.accepted.append(k)
        rnd.bonus.append(bonus)
        new_tokens.append(c[:k] + [bonus])
    return new_tokens


def _commit(target: RaggedCache, drafter: BatchDrafter, live: list[Row], rnd: Round, fed: list[int]) -> None:
    """Both caches keep each row's accepted candidates only; the bonus is fed next round."""
    accepted = torch.tensor(rnd.accepted)
    target.settle(accepted)
    drafter.commit(live, rnd.accepted)
    for row, f, k in zip(live, fed, rnd.accepted):
        row.target_fed += f + k


def _stop_rule(criteria, device):
    """Whether a row's ids (a list) end it, as `criteria` (a StoppingCriteriaList) says. Where they are only
    generate's own length and EOS criteria the rule is those two in Python: called per new token with a tensor
    per call, they cost ~0.1 ms each on the caller's critical path (a tensor op waits for the interpreter lock
    that the speculation job's Python holds): about 2 ms a round at 8 rows on the simulated device."""
    criteria = list(criteria or [])
    if all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in criteria):
        length = min((c.max_length for c in criteria if type(c) is MaxLengthCriteria), default=None)
        eos = {int(t) for c in criteria if type(c) is EosTokenCriteria for t in torch.as_tensor(c.eos_token_id).flatten()}
        return lambda ids: (length is not None and len(ids) >= length) or ids[-1] in eos
    return lambda ids: bool(criteria and StoppingCriteriaList(criteria)(torch.tensor([ids], device=device), None)[0])


def _advance(live: list[Row], new_tokens: list[list[int]], stops, explored: bool) -> list[int]:
    """Each row's new tokens, one by one through the stopping criteria, as the target alone would stop (a row
    may stop within its accepted candidates). Returns the tokens each row appended."""
    kept = []
    for row, tokens in zip(live, new_tokens):
        n = 0
        for t in tokens:
            row.ids.append(t)
            row.real.append(t)
            n += 1
            if stops(row.ids):
                row.done = True
                break
        row.new += n
        row.explored_new += n * explored
        kept.append(n)
    return kept


def _adopt(drafter: BatchDrafter, live: list[Row], rnd: Round) -> None:
    """Rows whose outcome the job pre-drafted take that branch: its draft state becomes the row's, its tokens the
    next round's candidates."""
    tree = rnd.tree
    rnd.found = [None] * len(live)
    if tree is None or tree.cache is None:
        return
    sources = []
    for i, (row, k, bonus) in enumerate(zip(live, rnd.accepted, rnd.bonus)):
        b = tree.lookup(i, k, bonus) if not row.done else None
        rnd.found[i] = b
        sources.append((tree.cache, b) if b is not None else (drafter.kv, i))
    if any(b is not None for b in rnd.found):
        drafter.adopt(sources)  # copied at the next use of the draft's cache, usually the next job's
        for row, b in zip(live, rnd.found):
            if b is not None:
                row.ready = tree.take(b)
                row.draft_fed = len(row.real)  # the branch fed the row's whole new context (bonus included)


def _leave(live: list[Row], target: RaggedCache, drafter: BatchDrafter) -> list[Row]:
    """Finished rows leave the batch (and both caches); masked columns are dropped when they pile up."""
    keep = [i for i, r in enumerate(live) if not r.done]
    if len(keep) < len(live):
        live = [live[i] for i in keep]
        if live:
            target.select(keep)
            drafter.select(keep)
    target.maybe_compact()
    drafter.compact()
    return live


def _measure(scheduler: Scheduler, stats: SSDStats, rnd: Round, live: list[Row], tops: list[list], tokens: int,
             first: bool, do_sample: bool, calibration=None, timeline: bool = False, job_budget=None,
             max_length: int | None = None) -> None:
    """The round's costs, acceptance and the job's hits into the pair's estimates at this batch size, and into
    the stats (`_record`). Run by the next round's job: `tops` are each row's draft tops of the round (the next
    round replaces `Row.tops`), `job_budget` the round's own (`_job_budget`: the next round's live rows may
    differ), under which the model's prediction for the round is made."""
    costs = scheduler.costs
    n = max(len(c) for c in rnd.candidates)
    drafted_now = max((len(c) for c, hit, looked in zip(rnd.candidates, rnd.hits, rnd.looked_up)
                       if not hit and not looked), default=0)
    seconds = rnd.draft_s + rnd.verify_s + rnd.overhead_s + rnd.catch_up_s
    job = rnd.job
    with costs.lock:
        if first:  # the target's prompt prefill: what a catch-up and a trial round are priced from
            costs.add_prefill(sum(len(r.real) for r in live) - tokens, rnd.verify_s)
        else:  # the first round's forwards include both prompts' prefill
            threads = rnd.option.threads
            if drafted_now:
                costs.add_draft(drafted_now, rnd.draft_s, threads)
            costs.add_verify(n, rnd.verify_s, job.budget if job is not None and not scheduler.inline else None,
                             threads)
            decided_with, scheduler.job_budget = scheduler.job_budget, job_budget or scheduler.job_budget
            try:
                model = scheduler.model(rnd.option)
            finally:
                scheduler.job_budget = decided_with
            # Less the draft's catch-up: a read of what it lagged (a prompt, AR rounds), paid once and priced apart
            # where a decision must pay it (`Scheduler.catch_up`, `trial_cost`). In the option's rate it stayed:
            # real pair, B = 1, a call's trial round of sd(g=4) took 6.7 s against the model's 1.1 s, mostly the
            # draft's first read in the process, and its correction then priced sd(g=4) rounds 6x dearer, which,
            # never chosen again, it kept.
            if model is not None and rnd.typical():
                costs.add_round_outcome(rnd.option, tokens / len(live), seconds - rnd.catch_up_s, model)
        verified, confident = [], []
        stopped = bool(rnd.option.stop)  # a confidence stop chose each row's length: not a per-position sample
        for row_tops, c, k, bonus, looked in zip(tops, rnd.candidates, rnd.accepted, rnd.bonus, rnd.looked_up):
            if looked:  # the lookup's candidates: neither the draft's acceptance nor its confidence
                continue
            next_kept = None
            if k < len(row_tops) and row_tops[k] is not None:  # where the bonus ranked among the draft's tops
                rank = bonus_rank(row_tops[k], c[k] if k < len(c) else None, bonus)
                costs.add_rank(rank)
                if k == len(c) and not do_sample and not stopped:  # greedy: would a longer draft have kept it
                    next_kept = rank == 0
            verified.append((k, len(c), next_kept))
            known = row_tops[: len(c)]
            if c and all(t is not None for t in known):  # the draft's confidence at each candidate (`sd(g, c)`)
                confident.append(([float(t[0][0]) for t in known], k))
            if calibration is not None and c:  # P(accept | the draft's confidence), for the next jobs' P(k)
                calibration.observe(drafted_probs(c, known), k)
        costs.add_verified(verified, by_position=not stopped)
        costs.add_confidence(confident)
        if job is not None:
            tree = rnd.tree
            # The first step is not a step of its width: it feeds the late branches' unread tokens, and after a
            # change of width it meets fresh buffers (simulated device, B = 8: 12-20 ms against 10.6, and a few
            # such steps rated 16 branches a row at 14-30 ms a step, so the scheduler turned from them).
            for width, step_s in tree.steps[1:] if len(tree.steps) > 1 else tree.steps:
                costs.add_tree_step(max(1, round(width / len(live))), step_s)
            # The model counts the job's steps after its set-up (`_hit_terms`). A job that allocated its buffers paid
            # that once: neither its set-up nor its hits are what the option's later jobs do.
            if tree.setup_s is not None and not tree.grown:
                costs.add_record(tree.setup_s)
            if not first:  # the prefill round's overhead holds the draft's prompt prefill
                costs.add_overhead(job.budget, rnd.overhead_s)
            if not tree.grown:
                costs.add_lookups(rnd.job_budget, [(found is not None, predicted) for row, found, predicted
                                                   in zip(live, rnd.found, rnd.job_predicted) if _looks_up(row, max_length)])
        costs.add_round(seconds)
    for row, c, k in zip(live, rnd.candidates, rnd.accepted):
        row.rounds += 1
        row.proposed += len(c)
        row.accepted += k
    if job is not None:
        for row, found, predicted in zip(live, rnd.found, rnd.job_predicted):
            if not _looks_up(row, max_length):
                continue
            stats.add_lookup(predicted, found is not None)
            stats.cache_hits += found is not None
            stats.cache_misses += found is None
            if found is None:  # the next round's fallback for this row: the model's length, else the user's
                kind = "short" if scheduler.auto_fallback else scheduler.config.fallback
                stats.fallbacks[kind] = stats.fallbacks.get(kind, 0) + 1
        stats.branches_drafted += len(rnd.tree.branches)
        stats.outcomes_predicted += len(rnd.tree.branches)
    stats.add_round("prefill" if rnd.prefill else rnd.option.name, seconds, rnd.prediction, rnd.explored)
    stats.rounds += 1
    stats.proposed_tokens += sum(len(c) for c in rnd.candidates)
    stats.accepted_tokens += sum(rnd.accepted)
    stats.new_tokens += tokens
    stats.fallback_draft_time += rnd.draft_s
    _record(stats, rnd, len(live), timeline)


def _looks_up(row: Row, max_length: int | None) -> bool:
    """Whether a row's next round looks a branch up: it goes on for two tokens at least (a job pre-drafts no
    outcome that ends the row, `decode`'s `allowed`). Neither a hit nor a miss otherwise."""
    return not row.done and (max_length is None or len(row.ids) + 1 < max_length)


def _record(stats: SSDStats, rnd: Round, rows: int, timeline: bool) -> None:
    """The round's busy intervals (the verify; the draft on the critical path), from which the call's stats
    derive overlap and bubble ratio, and with `record_timeline` its event for `hf_ssd.plot_timeline` (candidates
    and accepted tokens summed over the rows; a hit when every row's candidates came from a branch)."""
    t0, t1, t2, t3 = rnd.times
    stats.intervals.setdefault("verify", []).append((t2, t3))
    if t1 > t0 and not all(rnd.hits):
        stats.intervals.setdefault("fallback", []).append((t0, t1))
    if timeline:
        stats.timeline.append({"round": stats.rounds, "option": "prefill" if rnd.prefill else rnd.option.name,
                               "rows": rows, "t_request": t0, "t_return": t2, "t_verified": t3,
                               "n_candidates": sum(map(len, rnd.candidates)), "accepted": sum(rnd.accepted),
                               "hit": bool(rnd.hits) and all(rnd.hits) and rnd.option.kind == "ssd"})
