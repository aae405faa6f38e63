"""`SSDCandidateGenerator`: SSD as a transformers candidate generator.

The stock assisted-decoding loop is the main loop and the verifier: it calls `get_candidates`, runs the target
over them, accepts (greedy matching or speculative sampling) and reports the outcome through
`update_candidate_strategy`. Around that, this class is the speculator's front end:

- `get_candidates` collects the background job of the round just verified, looks the real outcome up in the
  speculation cache (hit: the pre-drafted branch is returned at once; miss: the configured fallback), then
  submits the next job, which predicts this round's outcomes and pre-drafts a branch for each while the
  target verifies.
- `update_candidate_strategy` records the outcome (accepted count, bonus token).
"""

from __future__ import annotations

import time

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from .cache import Branch, SpeculationCache
from .config import SSDConfig
from .fallback import run_fallback
from .fanout import AcceptanceTracker, geometric_fanout
from .outcomes import predict_outcomes
from .speculator import Speculator
from .static_draft import make_drafter
from .stats import SSDStats


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
    ):
        self.config = config
        self.max_length = generation_config.max_length
        eos = getattr(generation_config, "_eos_token_tensor", None)
        self.eos = set(eos.flatten().tolist()) if eos is not None else set()
        do_sample = bool(generation_config.do_sample)
        self.budget, self.max_outcomes = config.resolved_budget(draft_model.device.type == "cuda")
        # When sampling, the speculator draws from its own generator, seeded from the caller's RNG: draws on two
        # threads never interleave on one generator. Seeded runs repeat exactly with layout="inline"; with
        # overlap, how far pre-drafting got when the outcome arrived can differ between runs (the output
        # distribution is exact either way). Greedy calls leave the caller's RNG alone.
        gen = None
        if do_sample:
            gen = torch.Generator(device=draft_model.device)
            gen.manual_seed(int(torch.randint(0, 2**62, (1,))))
        top_k = max(self._max_fanout(), 1) + 1
        self.drafter = make_drafter(draft_model, config, logits_processor, do_sample, top_k, gen, out_vocab,
                                    self.max_length, min(self.max_outcomes, config.cache_size), prompt_mask)
        self.cache = SpeculationCache(config.cache_size, config.eviction)
        self.acceptance = AcceptanceTracker(config.initial_acceptance)
        self.speculator = Speculator(layout, cpu_threads, draft_model.device)
        self.stats = SSDStats(layout=layout, draft_path=getattr(self.drafter, "path", "dynamic"))
        self.hooks = hooks or {}  # test hooks: stage name -> callable, for fault injection
        self.round = 0
        self._pending: tuple[list[int], list[int]] | None = None  # (context, candidates) being verified
        self._outcome: tuple[int, int] | None = None
        self._verify_start = 0.0
        self.verify_intervals: list[tuple[float, float]] = []
        self.draft_intervals: list[tuple[float, float]] = []

    # ----- fan-out ---------------------------------------------------------------------------------------
    def _max_fanout(self) -> int:
        if isinstance(self.config.fanout, list):
            return max(self.config.fanout)
        return self.budget

    def _fanout(self, g: int, alpha: float) -> list[int]:
        if isinstance(self.config.fanout, list):
            return self.config.fanout[: g + 1] + [0] * max(0, g + 1 - len(self.config.fanout))
        return geometric_fanout(self.budget, alpha, g)

    def _hook(self, stage: str) -> None:
        hook = self.hooks.get(stage)
        if hook is not None:
            hook()

    # ----- CandidateGenerator API --------------------------------------------------------------------------
    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        now = time.perf_counter()
        context = input_ids[0].tolist()
        n = min(self.config.gamma, self.max_length - len(context) - 1)
        branch = None
        if self._pending is not None:
            self.speculator.collect()  # waits for the job; re-raises its error here
            if self._outcome is not None:
                k, bonus = self._outcome
                branch = self.cache.get(self.round, k, bonus)
        alpha = self.acceptance.rate
        fanout = self._fanout(self.config.gamma, alpha)
        event = {"round": self.round + 1, "t_request": now}

        if branch is not None and branch.tokens and n > 0:
            tokens = branch.tokens[:n]
            logits = branch.logits[: len(tokens)] if branch.logits is not None else None
            with self.speculator.on_critical_path():
                self.drafter.adopt(branch.state, tokens)
            self.stats.cache_hits += 1
            self.stats.partial_hits += int(len(branch.tokens) < self.config.gamma)
            event["hit"] = True
        else:
            kind = self.config.fallback
            if self._pending is not None and n > 0:  # round 1 and an empty last round are not lookups
                self.stats.cache_misses += 1
                self.stats.fallbacks[kind] = self.stats.fallbacks.get(kind, 0) + 1
            d0 = time.perf_counter()
            with self.speculator.on_critical_path():
                result = run_fallback(
                    kind, self.drafter, context, n, self.config.effective_fallback_gamma, self.config.ngram_size,
                    fanout,
                )
            d1 = time.perf_counter()
            self.draft_intervals.append((d0, d1))
            self.stats.fallback_draft_time += d1 - d0
            tokens, logits = result.tokens, result.logits
            event["hit"] = False
        tokens, logits = self._cut_at_eos(tokens, logits)

        self.round += 1
        self.cache.begin_round(self.round)
        self._pending = (context, tokens)
        self._outcome = None
        self.stats.proposed_tokens += len(tokens)
        # Nothing to pre-draft if this verification surely ends the generation (length budget spent).
        if len(context) + 1 < self.max_length:
            self._submit(context, tokens, alpha)
        self._verify_start = time.perf_counter()
        self.stats.target_wait_time += self._verify_start - now
        event.update(t_return=self._verify_start, n_candidates=len(tokens))
        if self.config.record_timeline:
            self.stats.timeline.append(event)

        candidate_ids = torch.tensor([context + tokens], dtype=input_ids.dtype, device=input_ids.device)
        if logits is not None:
            logits = logits.unsqueeze(0).to(input_ids.device)
            if logits.is_cuda:
                logits.record_stream(torch.cuda.current_stream(logits.device))  # made on the speculator's stream
        return candidate_ids, logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches):
        self.verify_intervals.append((self._verify_start, time.perf_counter()))
        k = int(num_matches)
        self._outcome = (k, int(input_ids[0, -1]))
        g = len(self._pending[1]) if self._pending else 0
        self.stats.rounds += 1
        self.stats.accepted_tokens += k
        self.stats.new_tokens += k + 1
        self.acceptance.update(k, g)
        if self.config.record_timeline and self.stats.timeline:
            self.stats.timeline[-1].update(t_verified=time.perf_counter(), accepted=k)

    # ----- speculation ------------------------------------------------------------------------------------
    def _cut_at_eos(self, tokens, logits):
        for i, t in enumerate(tokens):
            if t in self.eos:  # drafting past EOS is wasted verification work
                return tokens[: i + 1], (logits[: i + 1] if logits is not None else None)
        return tokens, logits

    def _submit(self, context: list[int], candidates: list[int], alpha: float) -> None:
        round_id = self.round
        g = len(candidates)
        fanout = self._fanout(g, alpha)
        next_fanout = self._fanout(self.config.gamma, alpha)
        limit = min(self.max_outcomes, self.config.cache_size)
        gamma = self.config.gamma

        def job(should_stop):
            # 1. Outcome prediction: draft distributions at every candidate position and after the last.
            self._hook("predict")
            self.drafter.record(context + candidates, record_from=len(context) - 1)
            tops = self.drafter.candidate_tops(len(context), g)
            outcomes = predict_outcomes(candidates, tops, fanout, alpha, limit)
            # Outcomes that end the generation (EOS bonus, length budget spent) need no next round.
            outcomes = [
                o for o in outcomes if o.bonus not in self.eos and len(context) + o.accepted + 2 < self.max_length
            ]
            self.stats.outcomes_predicted += len(outcomes)
            if not outcomes:
                return
            # 2. Tree drafting: one batched draft forward per step for all branches, until the outcome arrives.
            self._hook("draft")
            tree = self.drafter.start_tree(len(context), outcomes)
            drafted = self.drafter.tree_steps(tree, outcomes, gamma, next_fanout, should_stop)
            # 3. Cache insert.
            self._hook("insert")
            for state, result in drafted:
                if result.tokens:
                    o = state.outcome
                    self.cache.put(Branch(round_id, o.accepted, o.bonus, o.prob, result.tokens, result.logits, state))
                    self.stats.branches_drafted += 1

        self.speculator.submit(job)

    def close(self) -> None:
        self.speculator.close()
        getattr(self.drafter, "release", lambda: None)()  # static buffers go back for the next call
        self.stats.evictions = self.cache.evictions
        self.stats.draft_forwards = self.drafter.forwards
        self.cache.clear()
