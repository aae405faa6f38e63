"""Verification rules for one row: greedy matching and speculative sampling (Leviathan et al.; Chen et al.).

Both are exact: greedy returns the target's own argmax tokens, speculative sampling returns tokens distributed
exactly as the target's (processed) distribution whatever the draft proposed, given the draft distribution q
each candidate was drawn from.
"""

from __future__ import annotations

import torch


def accept_greedy(choice: list[int], candidates: list[int]) -> tuple[int, int]:
    """(accepted count k, bonus) from the target's choices at each candidate position and after the last."""
    k = 0
    while k < len(candidates) and candidates[k] == choice[k]:
        k += 1
    return k, choice[k]


def accept_sampled(p: torch.Tensor, q: torch.Tensor | None, candidates: list[int]) -> tuple[int, int]:
    """p: [n + 1, V] target probabilities, q: [n, V] draft probabilities the candidates were drawn from.

    Candidate j is kept with probability min(1, p_j(c) / q_j(c)); the first one rejected is replaced by a draw
    from the residual max(0, p_j - q_j) (normalised), and if all n are kept the bonus is drawn from p_n."""
    for j, c in enumerate(candidates):
        pc, qc = float(p[j, c]), float(q[j, c])
        if float(torch.rand(())) * qc < pc:
            continue
        residual = (p[j] - q[j]).clamp_min(0.0)
        total = float(residual.sum())
        # total = 0 means p_j <= q_j everywhere, i.e. p_j = q_j: then no rejection happens (probability 0).
        return j, int(torch.multinomial(residual / total if total > 0 else p[j], 1))
    n = len(candidates)
    return n, int(torch.multinomial(p[n], 1))
