"""A one-time check, before a draft's first generation, that it runs the drafter's batched step.

Some architectures build their own masks or positions and fail on a left-padded batch with a cache (e.g.
CPM-Ant); that must be found before generation starts, not in the middle of it. The probe runs the real drafter
path on a 6-token sequence (a trunk prefill, two tree steps of two branches) and compares each branch with
the model's own forward. A failure refuses the draft; a disagreement (positions taken from the cache length
rather than the position ids, as in TrOCR or GIT) only costs acceptance, so it is logged.
"""

from __future__ import annotations

import logging
import time
import weakref

import torch

from .drafter import Drafter
from .kvcache import UnsupportedDraftError
from .outcomes import Outcome

logger = logging.getLogger("hf_ssd")

_probed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> once it passed: its step's seconds, or True
# Errors an architecture raises on inputs it cannot take (shapes, masks, kwargs). Anything else (an interrupt, a
# fault planted by a test, CUDA out of memory) is not about the architecture and propagates unchanged.
_SHAPE_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, AttributeError, KeyError)


@torch.no_grad()
def probe_draft(model) -> None:
    if model in _probed:
        return
    drafter = Drafter(model, None, do_sample=False, top_k=1)
    vocab = max(2, min(drafter.out_vocab, drafter.in_vocab or drafter.out_vocab))
    seq = [(7 * i + 3) % vocab for i in range(6)]  # adoption is column slicing only: nothing to probe there
    outcomes = [Outcome(0, seq[1]), Outcome(2, seq[3])]  # two rows with different left padding
    try:
        drafter.sync(seq, record_from=3)
        tree = drafter.start_tree(4, outcomes)
        drafted = drafter.tree_steps(tree, outcomes, 1, [0, 0], lambda: False)
    except _SHAPE_ERRORS as exc:
        raise UnsupportedDraftError(
            f"SSD needs a draft model whose KV cache it can crop and batch; {type(model).__name__} fails on the "
            f"drafter's batched step (a left-padded batch with a 2D attention mask and position ids): "
            f"{type(exc).__name__}: {exc}. Use a draft of a standard decoder-only family (e.g. Llama, Qwen, Gemma)."
        ) from exc
    worst, seconds = 0.0, None
    for state, _ in drafted:
        o = state.outcome
        branch = seq[:4 + o.accepted] + [o.bonus]
        start = time.perf_counter()
        ref = torch.softmax(model(input_ids=torch.tensor([branch], device=drafter.device)).logits[0, -1].float(), -1)
        seconds = time.perf_counter() - start  # the last one: the first has faulted the weights in
        values, ids = state.top[4 + o.accepted]
        worst = max(worst, float((values - ref[: drafter.out_vocab].cpu()[ids]).abs().max()))
    if worst > 0.05:
        logger.warning(
            "hf_ssd: the draft %s computes branch tokens differently in a batch than alone (probability gap %.2f); "
            "output stays exact, but acceptance and cache hits may be low.", type(model).__name__, worst,
        )
    _probed[model] = seconds if seconds is not None else True


def step_seconds(model) -> float | None:
    """Seconds of one short forward of the draft, timed by its probe: the warm-up's view of a draft step before
    any drafting is measured (schedule.Scheduler.warmup_cost); it reads a few tokens, so it bounds a step from
    above."""
    seconds = _probed.get(model)
    return seconds if isinstance(seconds, float) else None
