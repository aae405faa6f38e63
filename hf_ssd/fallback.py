"""What a cache miss does: draft now (full or shorter gamma), propose nothing, or look up an n-gram."""

from __future__ import annotations

import torch

from .drafter import Drafter, DraftResult


def ngram_lookup(context: list[int], n: int, max_ngram: int) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the context's last n-gram, copy what followed."""
    for size in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-size:]
        for start in range(len(context) - size - 1, -1, -1):
            if context[start : start + size] == tail:
                follow = context[start + size : start + size + n]
                if follow:
                    return follow
    return []


def one_hot_logits(tokens: list[int], vocab: int, device) -> torch.Tensor:
    """The proposal of a deterministic token is a point mass: log 1 there, log 0 elsewhere."""
    logits = torch.full((len(tokens), vocab), float("-inf"), device=device)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return logits


def run_fallback(
    kind: str, drafter: Drafter, context: list[int], n: int, short_n: int, ngram_size: int, fanout: list[int]
) -> DraftResult:
    if n <= 0 or kind == "ar":
        return DraftResult([], None)
    if kind == "sd":
        return drafter.draft(context, n, fanout)
    if kind == "short":
        return drafter.draft(context, min(n, short_n), fanout)
    if kind == "ngram":
        tokens = ngram_lookup(context, n, ngram_size)
        logits = one_hot_logits(tokens, drafter.out_vocab, drafter.device) if drafter.do_sample and tokens else None
        return DraftResult(tokens, logits)
    raise ValueError(f"unknown fallback {kind!r}")
