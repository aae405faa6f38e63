"""Plain batched decoding: the target's own sampling loop, for batches where drafting cannot pay.

Where a batched verify is compute-bound (CPU cores at large B), every drafted candidate costs about as much as
a token decoded alone, and the fastest thing to run is what the user would run without hf_ssd: transformers'
`_sample` over the whole batch. Its output is the target's own by construction. Each step is timed (a stopping
criterion that never stops) into the pair's plain-step estimate at this batch size (and its AR estimate), against
which a loop call's speedup is measured (batch.py, `BatchPlan.plain`).
"""

from __future__ import annotations

import time

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from ..stats import SSDStats


class StepClock(StoppingCriteria):
    """Called by the sampling loop after every step's token: the time between two calls is one decode step (the
    first interval, from the start, holds the prompt's prefill)."""

    def __init__(self):
        self.times = [time.perf_counter()]

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    @property
    def steps(self) -> list[float]:
        """Seconds of each decode step after the prefill."""
        return [b - a for a, b in zip(self.times[1:], self.times[2:])]


def decode_plain(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
                 model_kwargs: dict, costs, stats: SSDStats, eos: set[int]):
    """The whole call as the target's own batched decoding; its steps measured into `costs` (verify of 0
    candidates: an AR round) and `stats`."""
    clock = StepClock()
    criteria = StoppingCriteriaList([*stopping_criteria, clock])
    out = type(model)._sample(model, input_ids, logits_processor, criteria, generation_config, synced_gpus,
                              streamer, **model_kwargs)
    steps = clock.steps
    with costs.lock:
        for seconds in steps:  # not rounds of the loop's: its first call at this size still explores
            costs.add_plain_step(seconds)
            costs.add_verify(0, seconds, None)  # also the loop's AR estimate: a step over the same rows
    sequences = out.sequences if hasattr(out, "sequences") else out
    start = input_ids.shape[1]
    stats.rows = []
    for i, row in enumerate(sequences[:, start:].tolist()):
        new = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        stats.rows.append({"index": i, "new_tokens": new, "rounds": new, "proposed": 0, "accepted": 0,
                           "acceptance": 0.0})
        stats.new_tokens += new
    prefill = clock.times[1] - clock.times[0] if len(clock.times) > 1 else 0.0
    stats.add_round("prefill", prefill)
    for seconds in steps:
        stats.add_round("plain batched", seconds)
    stats.rounds += len(clock.times) - 1
    stats.intervals = {"verify": [(clock.times[0], clock.times[-1])], "speculate": [], "fallback": []}
    stats.draft_path = "plain batched"
    return out
