"""The speculation cache: pre-drafted continuations keyed by the verification outcome they assume."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Branch:
    """A continuation pre-drafted for one outcome of round `round_id`.

    `tokens` are the drafted ids, `logits` the log-probabilities they were sampled from ([len, V], only when
    sampling), and `state` what the drafter needs to adopt the branch's draft KV cache on a hit.
    """

    round_id: int
    accepted: int
    bonus: int
    prob: float
    tokens: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    state: Any = None

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.round_id, self.accepted, self.bonus)


class SpeculationCache:
    """Bounded map outcome -> Branch with LRU or lowest-probability eviction.

    Entries of earlier rounds can never hit again (the context has moved on), so `begin_round` drops them
    before the policy has to choose among live entries.
    """

    def __init__(self, capacity: int, eviction: str = "probability"):
        self.capacity = capacity
        self.eviction = eviction
        self._entries: OrderedDict[tuple[int, int, int], Branch] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def begin_round(self, round_id: int) -> None:
        for key in [k for k in self._entries if k[0] < round_id]:
            del self._entries[key]

    def put(self, branch: Branch) -> None:
        key = branch.key
        if key in self._entries:
            del self._entries[key]
        while len(self._entries) >= self.capacity:
            self._evict_one()
        self._entries[key] = branch

    def _evict_one(self) -> None:
        if self.eviction == "lru":
            self._entries.popitem(last=False)
        else:
            victim = min(self._entries, key=lambda k: self._entries[k].prob)
            del self._entries[victim]
        self.evictions += 1

    def get(self, round_id: int, accepted: int, bonus: int) -> Branch | None:
        key = (round_id, accepted, bonus)
        branch = self._entries.get(key)
        if branch is not None:
            self._entries.move_to_end(key)
        return branch

    def clear(self) -> None:
        self._entries.clear()
