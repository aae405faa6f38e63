"""hf_ssd's decoding loop for batches (B > 1), entered through transformers' `custom_generate`.

transformers prepares the generation config, logits processors, stopping criteria and the attention mask, then
calls `decode`. Each round, for the rows still generating:

1. schedule: AR or plain SD at some gamma, from costs measured at this batch size (`BatchPlan`);
2. propose: the draft's candidates for every row, one batched draft forward per position (`BatchDrafter`);
3. verify: one target forward over all rows (each row's unverified tokens and its candidates);
4. accept: per row, greedy matching or speculative sampling (`accept.py`), then the row's new tokens one by one
   through the stopping criteria; finished rows leave the batch.

Rows accept different counts: both caches are `RaggedCache`s (rejected columns masked, explicit positions), so
every row computes what it would compute alone. The output is padded as transformers pads a batch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..costs import cost_model_for
from ..drafter import CONTEXT_FREE
from ..schedule import AUTO_GAMMAS, Option, Scheduler
from ..stats import SSDStats
from .accept import accept_greedy, accept_sampled
from .draft import BatchDrafter
from .ragged import RaggedCache


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
    done: bool = False

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


def batch_options(config) -> tuple[list[Option], Option]:
    """(options, default): AR and plain SD; a set gamma is kept, schedule="fixed" runs SD at gamma only."""
    default = Option("sd", config.gamma)
    if config.schedule == "fixed":
        return [default], default
    gammas = (config.gamma,) if config.is_set("gamma") else AUTO_GAMMAS
    return [Option("ar")] + [Option("sd", g) for g in gammas], default


class BatchPlan:
    """The scheduler of each batch size in use (live rows rounded up to a power of two), over the pair's cost
    estimates at that size: a batched verify costs more per row on CPU cores than on an idle accelerator."""

    def __init__(self, target, draft, config, do_sample: bool):
        self.target, self.draft, self.config, self.do_sample = target, draft, config, do_sample
        self.options, self.default = batch_options(config)
        self._schedulers: dict[int, Scheduler] = {}

    def scheduler(self, rows: int) -> Scheduler:
        size = 1 << max(0, math.ceil(math.log2(max(rows, 1))))
        if size not in self._schedulers:
            costs = cost_model_for(self.target, self.draft, self.draft.device, f"batch{size}", self.do_sample, 2,
                                   self.config.initial_acceptance, self.config.draft_matmul)
            with costs.lock:
                costs.new_call()
            self._schedulers[size] = Scheduler(self.config, costs, self.options, self.default, inline=True)
        return self._schedulers[size]


def _rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[Row]:
    ids = input_ids.tolist()
    mask = attention_mask.tolist() if attention_mask is not None else [[1] * len(r) for r in ids]
    return [Row(i, list(r), [t for t, keep in zip(r, row_mask) if keep]) for i, (r, row_mask) in enumerate(zip(ids, mask))]


class _Processing:
    """The generation's logits processors for each row's context (all rows at once where they are context-free)."""

    def __init__(self, processors):
        self.procs = processors
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
        processed = []
        for row, c, scores in zip(rows, candidates, out):
            context = torch.tensor([row.ids + c], device=logits.device)
            base = len(row.ids)
            processed.append(torch.cat([self.procs(context[:, : base + j], scores[j : j + 1].clone())
                                        for j in range(len(c) + 1)]))
        return processed


def _verify(target: RaggedCache, rows: list[Row], candidates: list[list[int]], pad: int):
    """3. One target forward: each row's unverified tokens (right-aligned) then its candidates. Returns (logits
    [rows, G + 1, V] at the last unverified token and at every candidate position, tokens fed per row)."""
    pending = [row.real[row.target_fed:] for row in rows]
    wp, g = max(len(p) for p in pending), max(len(c) for c in candidates)
    ids = torch.full((len(rows), wp + g), pad, dtype=torch.long)
    valid = torch.zeros(len(rows), wp + g, dtype=torch.long)
    pos = torch.zeros(len(rows), wp + g, dtype=torch.long)
    for i, (row, p, c) in enumerate(zip(rows, pending, candidates)):
        lo, hi = wp - len(p), wp + len(c)
        ids[i, lo:hi] = torch.tensor(p + c)
        valid[i, lo:hi] = 1
        pos[i, lo:hi] = torch.arange(row.target_fed, row.target_fed + len(p) + len(c))
    return target.forward(ids, valid, pos, keep_last=g + 1), [len(p) for p in pending]


def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
           streamer=None, *, ssd_draft, ssd_config, ssd_stats: SSDStats, **model_kwargs):
    """The `custom_generate` callable of batched calls (see the module docstring)."""
    do_sample = bool(generation_config.do_sample)
    pad = int(generation_config._pad_token_tensor) if generation_config._pad_token_tensor is not None else 0
    vocab = model.config.get_text_config().vocab_size
    rows = _rows(input_ids, model_kwargs.get("attention_mask"))
    target = RaggedCache(model)
    drafter = BatchDrafter(ssd_draft, vocab, do_sample, logits_processor, pad)
    plan = BatchPlan(model, ssd_draft, ssd_config, do_sample)
    process = _Processing(logits_processor)
    max_length = generation_config.max_length
    stats = ssd_stats
    stats.batch_size = len(rows)
    live = [r for r in rows if len(r.ids) < max_length]
    for r in rows:
        r.done = r not in live
    first = True
    while live:
        scheduler = plan.scheduler(len(live))
        rnd = _schedule(scheduler, live, first, max_length)
        t0 = time.perf_counter()
        _propose(drafter, live, rnd)
        t1 = time.perf_counter()
        logits, fed = _verify(target, live, rnd.candidates, pad)
        new_tokens = _accept(rnd, process(live, rnd.candidates, logits), do_sample)
        rnd.draft_s, rnd.verify_s = t1 - t0, time.perf_counter() - t1
        _commit(target, drafter, live, rnd, fed)
        appended = _advance(live, new_tokens, stopping_criteria, input_ids.device)
        _measure(scheduler, stats, rnd, live, appended, first)
        first = False
        live = _leave(live, target, drafter)
    stats.rows = [r.stats() for r in rows]
    stats.draft_forwards = drafter.kv.forwards
    width = max(len(r.ids) for r in rows)
    sequences = torch.tensor([r.ids + [pad] * (width - len(r.ids)) for r in rows], dtype=input_ids.dtype,
                             device=input_ids.device)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _schedule(scheduler: Scheduler, live: list[Row], first: bool, max_length: int) -> Round:
    """1. The round's option (AR or SD at some gamma) and each row's candidate budget (the length it has left)."""
    if first:  # the target's prompt prefill, alone: it yields each row's first token
        option, prediction, explored = Option("ar"), None, False
    else:
        with scheduler.costs.lock:
            option, prediction, explored = scheduler.decide()
    gamma = option.gamma if option.kind == "sd" else 0
    return Round(option, prediction, explored, [max(0, min(gamma, max_length - len(r.ids) - 1)) for r in live],
                 prefill=first)


def _propose(drafter: BatchDrafter, live: list[Row], rnd: Round) -> None:
    """2. The draft's candidates for every row (none in an AR round)."""
    if max(rnd.limits) > 0:
        rnd.candidates, rnd.q = drafter.propose(live, rnd.limits)
    else:
        rnd.candidates, rnd.q = [[] for _ in live], [None] * len(live)


def _accept(rnd: Round, scores: list[torch.Tensor], do_sample: bool) -> list[list[int]]:
    """4. Per row: the accepted candidates and the bonus (greedy matching or speculative sampling)."""
    new_tokens = []
    for c, q, s in zip(rnd.candidates, rnd.q, scores):
        if do_sample:
            k, bonus = accept_sampled(torch.softmax(s, dim=-1), q, c)
        else:
            k, bonus = accept_greedy(s.argmax(-1).tolist(), c)
        rnd.accepted.append(k)
        new_tokens.append(c[:k] + [bonus])
    return new_tokens


def _commit(target: RaggedCache, drafter: BatchDrafter, live: list[Row], rnd: Round, fed: list[int]) -> None:
    """Both caches keep each row's accepted candidates only; the bonus is fed next round."""
    g = max(len(c) for c in rnd.candidates)
    target.keep(g, torch.arange(g)[None, :] < torch.tensor(rnd.accepted)[:, None])
    drafter.commit(live, rnd.accepted)
    for row, f, k in zip(live, fed, rnd.accepted):
        row.target_fed += f + k


def _advance(live: list[Row], new_tokens: list[list[int]], stopping_criteria, device) -> int:
    """Each row's new tokens, one by one through the stopping criteria, as the target alone would stop (a row
    may stop within its accepted candidates). Returns the tokens appended."""
    appended = 0
    for row, tokens in zip(live, new_tokens):
        for t in tokens:
            row.ids.append(t)
            row.real.append(t)
            row.new += 1
            appended += 1
            if bool(stopping_criteria(torch.tensor([row.ids], device=device), None)[0]):
                row.done = True
                break
    return appended


def _leave(live: list[Row], target: RaggedCache, drafter: BatchDrafter) -> list[Row]:
    """Finished rows leave the batch (and both caches); masked columns are dropped when they pile up."""
    keep = [i for i, r in enumerate(live) if not r.done]
    if len(keep) < len(live):
        live = [live[i] for i in keep]
        if live:
            target.select(keep)
            drafter.kv.select(keep)
    target.maybe_compact()
    drafter.kv.maybe_compact()
    return live


def _measure(scheduler: Scheduler, stats: SSDStats, rnd: Round, live: list[Row], tokens: int, first: bool) -> None:
    """The round's costs and acceptance into the pair's estimates at this batch size, and into the stats."""
    costs = scheduler.costs
    n = max(len(c) for c in rnd.candidates)
    seconds = rnd.draft_s + rnd.verify_s
    with costs.lock:
        if not first:  # the first round's forwards include both prompts' prefill
            if n:
                costs.add_draft(n, rnd.draft_s)
            costs.add_verify(n, rnd.verify_s, None)
            model = scheduler.model(rnd.option)
            if model is not None:
                costs.add_round_outcome(rnd.option, tokens / len(live), seconds, model)
        for c, k in zip(rnd.candidates, rnd.accepted):
            costs.add_acceptance(k, len(c))
            costs.add_positions(k, len(c))
        costs.add_round()
    for row, c, k in zip(live, rnd.candidates, rnd.accepted):
        row.rounds += 1
        row.proposed += len(c)
        row.accepted += k
    stats.add_round("prefill" if rnd.prefill else rnd.option.name, seconds, rnd.prediction, rnd.explored)
    stats.rounds += 1
    stats.proposed_tokens += sum(len(c) for c in rnd.candidates)
    stats.accepted_tokens += sum(rnd.accepted)
    stats.new_tokens += tokens
    stats.verify_time += rnd.verify_s
    stats.fallback_draft_time += rnd.draft_s
