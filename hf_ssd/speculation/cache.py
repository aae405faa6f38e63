"""The speculation cache: pre-drafted continuations keyed by the chain of verification outcomes they assume.

A branch drafted during the verification of round t for its outcome (k, bonus) is keyed (t, (k, bonus)). A
deeper branch, drafted under such a branch for the outcome of the round after, is keyed
(t, (k, bonus), (k2, bonus2)): it is valid only if round t ends with (k, bonus) *and* the next round, verifying
the first branch's tokens, ends with (k2, bonus2). When round t's outcome hits, `promote` re-keys the branches
under the hit as round t + 1's entries, so the next job starts with them already drafted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

Key = tuple  # (round_id, (k, bonus), (k2, bonus2), ...)


@dataclass
class Branch:
    """A continuation pre-drafted for one outcome of round `round_id` (and, if `rest`, of rounds after it).

    `tokens` are the drafted ids, `logits` the log-probabilities they were sampled from ([len, V], only when
    sampling), and `state` what the drafter needs to adopt the branch's draft KV cache on a hit. `rest` lists the
    deeper outcomes (k, bonus, probability given the outcomes before it); `prob` is the probability of the
    whole chain; `depth` how many rounds ahead the branch was drafted (1 + len(rest) when drafted).
    """

    round_id: int
    accepted: int
    bonus: int
    prob: float
    tokens: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    state: Any = None
    rest: tuple[tuple[int, int, float], ...] = ()
    depth: int = 0

    def __post_init__(self) -> None:
        if self.depth == 0:
            self.depth = 1 + len(self.rest)

    @property
    def key(self) -> Key:
        return (self.round_id, (self.accepted, self.bonus)) + tuple((k, b) for k, b, _ in self.rest)


class SpeculationCache:
    """Bounded map outcome chain -> Branch with LRU or lowest-probability eviction.

    Entries of earlier rounds can never hit again (the context has moved on), so `begin_round` drops them
    before the policy has to choose among live entries. A full cache evicts before inserting: `"lru"` the least
    recently inserted or looked up, `"probability"` the least likely chain (the new branch itself when it is
    the least likely).
    """

    def __init__(self, capacity: int, eviction: str = "probability"):
        self.capacity = capacity
        self.eviction = eviction
        self._entries: OrderedDict[Key, Branch] = OrderedDict()
        self.evictions = 0
        self.evicted_by_depth: dict[int, int] = {}
        self._newest = -1  # the latest round_id among the entries (or of an entry since dropped)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(list(self._entries.values()))

    def begin_round(self, round_id: int) -> None:
        if self._newest < round_id:
            self._entries.clear()  # the usual case: every entry is of an earlier round
            return
        for key in [k for k in self._entries if k[0] < round_id]:
            del self._entries[key]

    def put(self, branch: Branch) -> bool:
        """Insert (or replace) a branch; False when the policy dropped it at once."""
        key = branch.key
        if key in self._entries:
            del self._entries[key]
        while len(self._entries) >= self.capacity:
            if self.eviction != "lru":
                victim = min(self._entries, key=lambda k: self._entries[k].prob)
                if branch.prob < self._entries[victim].prob:
                    self._count(branch)
                    return False
            self._evict_one()
        self._entries[key] = branch
        self._newest = max(self._newest, branch.round_id)
        return True

    def _count(self, branch: Branch) -> None:
        self.evictions += 1
        self.evicted_by_depth[branch.depth] = self.evicted_by_depth.get(branch.depth, 0) + 1

    def _evict_one(self) -> None:
        if self.eviction == "lru":
            _, branch = self._entries.popitem(last=False)
        else:
            victim = min(self._entries, key=lambda k: self._entries[k].prob)
            branch = self._entries.pop(victim)
        self._count(branch)

    def get(self, round_id: int, accepted: int, bonus: int) -> Branch | None:
        key = (round_id, (accepted, bonus))
        branch = self._entries.get(key)
        if branch is not None:
            self._entries.move_to_end(key)
        return branch

    def peek(self, round_id: int, accepted: int, bonus: int) -> Branch | None:
        """Like `get`, without counting as a use (the speculator checking what is already drafted)."""
        return self._entries.get((round_id, (accepted, bonus)))

    def has(self, key: Key) -> bool:
        return key in self._entries

    def held(self, round_id: int) -> int:
        """How many one-round entries round `round_id` has already (promoted from deeper levels)."""
        return sum(1 for k in self._entries if k[0] == round_id and len(k) == 2)

    def hit_mass(self, round_id: int) -> float:
        """The predicted probability that round `round_id`'s outcome is held (sum over its one-round entries)."""
        return sum(b.prob for k, b in self._entries.items() if k[0] == round_id and len(k) == 2)

    def promote(self, round_id: int, accepted: int, bonus: int) -> int:
        """Round `round_id` ended with (accepted, bonus): the branches drafted under that outcome become entries
        of round `round_id` + 1 (their first outcome dropped, probabilities now given it). Returns how many."""
        head = (accepted, bonus)
        entries: OrderedDict[Key, Branch] = OrderedDict()
        moved = 0
        for key, branch in self._entries.items():
            if key[0] == round_id and len(key) > 2 and key[1] == head:
                (k, b, p), rest = branch.rest[0], branch.rest[1:]
                prob = p
                for _, _, q in rest:
                    prob *= q
                branch = Branch(round_id + 1, k, b, prob, branch.tokens, branch.logits, branch.state, rest,
                                branch.depth)
                self._newest = max(self._newest, round_id + 1)
                moved += 1
            entries[branch.key] = branch
        self._entries = entries
        return moved

    def clear(self) -> None:
        self._entries.clear()
