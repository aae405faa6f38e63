"""The speculation cache of one prompt's generator (loop/assisted.py): continuations pre-drafted for the outcomes
(k accepted, bonus) of the round being verified, keyed (round, (k, bonus)).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

Key = tuple  # (round_id, (k, bonus))


@dataclass
class Branch:
    """A continuation pre-drafted for one outcome of round `round_id`.

    `tokens` are the drafted ids, `logits` the log-probabilities they were sampled from ([len, V], only when
    sampling), and `state` what the drafter needs to adopt the branch's draft KV cache on a hit; `prob` is the
    speculator's estimate of the outcome's probability.
    """

    round_id: int
    accepted: int
    bonus: int
    prob: float
    tokens: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    state: Any = None

    @property
    def key(self) -> Key:
        return (self.round_id, (self.accepted, self.bonus))


class SpeculationCache:
    """Map outcome -> Branch of at most `capacity` entries. A round pre-drafts at most `SSDConfig.cache_size`
    outcomes (`_outcome_limit`), and `begin_round` drops the entries of earlier rounds (the context has moved on),
    so the cache never overflows; if it ever did, the least likely entry would go, the new one included."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: dict[Key, Branch] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(list(self._entries.values()))

    def begin_round(self, round_id: int) -> None:
        for key in [k for k in self._entries if k[0] < round_id]:
            del self._entries[key]

    def put(self, branch: Branch) -> bool:
        """Insert (or replace) a branch; False when it was dropped at once (a full cache, and the least likely)."""
        self._entries.pop(branch.key, None)
        if len(self._entries) >= self.capacity:
            victim = min(self._entries, key=lambda k: self._entries[k].prob)
            if branch.prob < self._entries[victim].prob:
                return False
            del self._entries[victim]
        self._entries[branch.key] = branch
        return True

    def get(self, round_id: int, accepted: int, bonus: int) -> Branch | None:
        return self._entries.get((round_id, (accepted, bonus)))

    def hit_mass(self, round_id: int) -> float:
        """The predicted probability that round `round_id`'s outcome is held (sum over its entries)."""
        return sum(b.prob for k, b in self._entries.items() if k[0] == round_id)

    def clear(self) -> None:
        self._entries.clear()
