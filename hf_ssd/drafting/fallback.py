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


def draft_until_unsure(drafter: Drafter, context: list[int], n: int, threshold: float) -> DraftResult:
    """Draft up to n tokens sequentially, stopping after the first token at which the draft's probability of its
    own top token is below `threshold` (that token is still proposed, as in transformers' ConfidenceCriteria).

    Exactness. The stop only decides how many candidates are proposed; each proposed token is drawn from the
    draft's distribution q exactly as `Drafter.draft` draws it, and its log q row goes to the verifier, so the
    verification (greedy matching, or speculative sampling against that q) is unchanged. In greedy mode the
    candidates are a prefix of what `draft` would propose, and the output is the target's whatever the length.
    In sampling mode, the decision to propose position j + 1 is a function of the prefix drafted so far (the
    draft's distribution after it; for the token just drawn that is max q, which does not depend on which token
    was drawn). Given that the target accepted the prefix, the prefix is the output so far, so the decision is a
    function of the output prefix alone: stopping means the next token is the target's own sample from p
    (the bonus), continuing means a draw from q corrected by speculative sampling, whose result is distributed
    as p as well. Either way the next output token has the target's distribution given the prefix, as in SD of a
    fixed length. (A rule that looked at verification randomness, or at the target's probabilities, would not
    be exact; this one looks at neither.)

    The trunk is left as `Drafter.draft` leaves it: it holds context + all but the last drafted token. No Saguaro
    scaling: plain SD has no cache to steer residuals into.
    """
    return drafter.draft(context, n, [], stop_below=threshold)


def run_fallback(
    kind: str, drafter: Drafter, context: list[int], n: int, short_n: int, ngram_size: int, fanout: list[int],
    stop: float = 0.0,
) -> DraftResult:
    """The candidates of a round without a cache hit. `stop` > 0 (plain SD only): the confidence stop of
    `draft_until_unsure`."""
    if n <= 0 or kind == "ar":
        return DraftResult([], None)
    if kind == "sd" and stop > 0:
        return draft_until_unsure(drafter, context, n, stop)
    if kind == "sd":
        return drafter.draft(context, n, fanout)
    if kind == "short":
        return drafter.draft(context, min(n, short_n), fanout)
    if kind == "ngram":
        tokens = ngram_lookup(context, n, ngram_size)
        logits = one_hot_logits(tokens, drafter.out_vocab, drafter.device) if drafter.do_sample and tokens else None
        return DraftResult(tokens, logits)
    raise ValueError(f"unknown fallback {kind!r}")
