"""Unit tests of the SSD parts: fan-out allocation, outcome prediction, speculation cache, config checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hf_ssd
from hf_ssd.drafting.fallback import ngram_lookup, one_hot_logits
from hf_ssd.speculation.cache import Branch, SpeculationCache
from hf_ssd.speculation.fanout import geometric_fanout
from hf_ssd.speculation.outcomes import bonus_rank, length_probs, predict_outcomes


@given(budget=st.integers(0, 200), alpha=st.floats(0.0, 1.0), gamma=st.integers(1, 12))
def test_geometric_fanout_sums_to_budget_and_is_monotone(budget, alpha, gamma):
    counts = geometric_fanout(budget, alpha, gamma)
    assert len(counts) == gamma + 1
    assert sum(counts) == budget
    assert all(c >= 0 for c in counts)
    if alpha < 1.0:
        # P(k) decreases along k < gamma, so the fan-out never grows there.
        assert all(counts[k] >= counts[k + 1] for k in range(gamma - 1))


def test_geometric_fanout_follows_acceptance():
    low = geometric_fanout(12, 0.2, 4)
    high = geometric_fanout(12, 0.9, 4)
    assert low[0] > high[0]  # low acceptance: early rejection is the likely outcome
    assert high[4] > low[4]  # high acceptance: all accepted is likely
    assert geometric_fanout(10, 0.5, 3) == [5, 3, 1, 1]


def test_length_probs_at_one_rate_are_the_geometric_law():
    for alpha in (0.0, 0.3, 0.99, 1.0):
        law = [alpha**k * (1 - alpha) for k in range(5)] + [alpha**5]
        assert length_probs([alpha] * 5) == pytest.approx(law, abs=1e-12)
    assert length_probs([0.5, 0.8]) == pytest.approx([0.5, 0.5 * 0.2, 0.5 * 0.8])  # position by position


def _top(pairs):
    probs, ids = zip(*pairs)
    return torch.tensor(probs), torch.tensor(ids)


def test_predict_outcomes_excludes_drafted_token_and_ranks():
    candidates = [7, 8]
    tops = [
        _top([(0.6, 7), (0.3, 3), (0.1, 4)]),  # predicting candidate 1 (=7): rejection bonus is 3 or 4
        _top([(0.5, 8), (0.4, 5), (0.1, 6)]),  # predicting candidate 2 (=8)
        _top([(0.9, 9), (0.1, 2)]),  # after the last candidate: the bonus itself
    ]
    outcomes = predict_outcomes(candidates, tops, fanout=[2, 1, 1], alpha=0.5, max_outcomes=10)
    keys = {(o.accepted, o.bonus) for o in outcomes}
    assert keys == {(0, 3), (0, 4), (1, 5), (2, 9)}
    assert (0, 7) not in keys and (1, 8) not in keys
    probs = [o.prob for o in outcomes]
    assert probs == sorted(probs, reverse=True)
    # P(k=0) = 0.5; the bonus 3 has 0.3 of the 0.4 mass left after excluding the drafted token.
    first = {(o.accepted, o.bonus): o.prob for o in outcomes}
    assert first[(0, 3)] == pytest.approx(0.5 * 0.75)
    assert len(predict_outcomes(candidates, tops, [2, 1, 1], 0.5, max_outcomes=2)) == 2


def test_bonus_rank_skips_the_rejected_candidate():
    top = _top([(0.5, 8), (0.3, 5), (0.2, 6)])
    assert bonus_rank(top, 8, 5) == 0  # the rejected candidate 8 cannot be the bonus: 5 is first after it
    assert bonus_rank(top, None, 5) == 1  # after the last candidate nothing is skipped
    assert bonus_rank(top, 8, 4) is None  # not among the draft's tops


def test_predict_outcomes_without_candidates_predicts_next_token():
    outcomes = predict_outcomes([], [_top([(0.7, 1), (0.2, 2), (0.1, 3)])], [2], alpha=0.5, max_outcomes=8)
    assert [(o.accepted, o.bonus) for o in outcomes] == [(0, 1), (0, 2)]


def _branch(round_id, k, bonus, prob):
    return Branch(round_id, k, bonus, prob, [1])


def test_cache_never_exceeds_capacity_and_keeps_the_likeliest():
    cache = SpeculationCache(3)
    for i, p in enumerate([0.5, 0.1, 0.3, 0.4]):
        cache.put(_branch(1, i, i, p))
        assert len(cache) <= 3
    assert cache.get(1, 1, 1) is None  # the least likely went first
    assert all(cache.get(1, i, i) is not None for i in (0, 2, 3))
    assert not cache.put(_branch(1, 5, 5, 0.05))  # less likely than every entry: dropped at once
    assert cache.get(1, 5, 5) is None and len(cache) == 3
    assert cache.hit_mass(1) == pytest.approx(0.5 + 0.3 + 0.4)


def test_cache_hit_miss_and_stale_rounds():
    cache = SpeculationCache(8)
    cache.put(_branch(3, 1, 42, 0.2))
    assert cache.get(3, 1, 42) is not None
    assert cache.get(3, 1, 41) is None  # other bonus: miss
    assert cache.get(3, 2, 42) is None  # other accepted count: miss
    cache.begin_round(4)
    assert len(cache) == 0  # earlier rounds can never hit again


def test_ngram_lookup_and_one_hot():
    assert ngram_lookup([1, 2, 3, 9, 1, 2], n=3, max_ngram=2) == [3, 9, 1]
    assert ngram_lookup([1, 2, 3], n=3, max_ngram=2) == []
    logits = one_hot_logits([2, 0], vocab=4, device="cpu")
    assert torch.equal(logits.softmax(-1), torch.tensor([[0.0, 0, 1, 0], [1.0, 0, 0, 0]]))


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        ({"gamma": 0}, "gamma"),
        ({"gamma": 2.5}, "gamma must be an int"),
        ({"fanout": [1, 2]}, r"gamma \+ 1"),
        ({"fanout": "linear"}, "fanout"),
        ({"eviction": "lru"}, "eviction was removed"),
        ({"fallback": "none"}, "fallback"),
        ({"saguaro_c": 1.0}, "saguaro_c"),
        ({"layout": "gpu"}, "layout"),
        ({"cache_size": 0}, "cache_size"),
        ({"hit_rate_warning": 2}, "hit_rate_warning"),
    ],
)
def test_config_rejects_bad_values(kwargs, phrase):
    with pytest.raises(hf_ssd.SSDConfigError, match=phrase):
        hf_ssd.SSDConfig(**kwargs)
