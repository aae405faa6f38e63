"""The calibrated outcome predictor: calibration (hf_ssd/speculation/predictor.py), acceptance-length law and ranking
(hf_ssd/speculation/outcomes.py)."""

from __future__ import annotations

import random
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hf_ssd.speculation.outcomes import length_probs, rank_outcomes
from hf_ssd.speculation.predictor import AcceptanceCalibration, drafted_probs, hedged_length_probs


def _top(pairs):
    probs, ids = zip(*pairs)
    return torch.tensor(probs), torch.tensor(ids)


def _calibrated(candidates, tops, cal, budget, length_prior=None):
    """The calibrated fan-out's outcomes, as the generator ranks them."""
    return rank_outcomes(candidates, tops, hedged_length_probs(cal, drafted_probs(candidates, tops), length_prior),
                         budget)


@given(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=10))
def test_length_probs_sum_to_one(ps):
    probs = length_probs(ps)
    assert len(probs) == len(ps) + 1
    assert abs(sum(probs) - 1.0) < 1e-9 and all(p >= -1e-12 for p in probs)


def test_prior_is_the_acceptance_prior_for_every_q():
    """Before any verification the calibrated predictor ranks like the geometric law."""
    cal = AcceptanceCalibration(prior=0.6)
    assert cal.p_accept(0.05) == pytest.approx(0.6) and cal.p_accept(0.97) == pytest.approx(0.6)


def test_calibration_learns_a_miscalibrated_draft():
    """A draft whose confident tokens are always accepted and unsure ones always rejected: the curve gets steep,
    and observations at positions after the rejection do not count."""
    rng = random.Random(0)
    cal = AcceptanceCalibration()
    for _ in range(300):
        qs = [rng.choice([0.95, 0.35]) for _ in range(4)]
        k = next((j for j, q in enumerate(qs) if q < 0.5), 4)
        cal.observe(qs, k)
    assert cal.p_accept(0.95) > 0.97
    assert cal.p_accept(0.35) < 0.05
    untouched = AcceptanceCalibration().p_accept(0.65)
    assert cal.p_accept(0.65) == pytest.approx(untouched, abs=0.1)  # never observed: stays near the prior


def test_drafted_probs_reads_the_drafted_token():
    tops = [_top([(0.6, 7), (0.3, 3)]), _top([(0.5, 2), (0.4, 8)]), _top([(0.9, 1), (0.1, 2)])]
    assert drafted_probs([7, 8], tops) == pytest.approx([0.6, 0.4])
    assert drafted_probs([9], tops) == [0.0]  # outside the recorded top list


def test_rank_outcomes_puts_budget_where_the_draft_is_unsure():
    cal = AcceptanceCalibration()
    for _ in range(50):  # a draft whose confidence tells: sure tokens kept, unsure ones rejected
        cal.observe([0.98, 0.4], 1)
    candidates = [7, 8, 9]
    tops = [
        _top([(0.98, 7), (0.01, 3), (0.01, 4)]),  # sure: a rejection here is unlikely
        _top([(0.40, 8), (0.35, 5), (0.25, 6)]),  # unsure: k = 1 with bonus 5 is likely
        _top([(0.97, 9), (0.02, 1), (0.01, 2)]),
        _top([(0.60, 11), (0.30, 12), (0.10, 13)]),  # after the last candidate
    ]
    outcomes = _calibrated(candidates, tops, cal, budget=3)
    assert len(outcomes) == 3
    assert [o.prob for o in outcomes] == sorted((o.prob for o in outcomes), reverse=True)
    assert (outcomes[0].accepted, outcomes[0].bonus) == (1, 5)
    assert all(not (o.accepted < 3 and o.bonus == candidates[o.accepted]) for o in outcomes)  # never the rejected
    ks = {o.accepted for o in outcomes}
    assert 0 not in ks  # the confident first position gets nothing
    # The probabilities are a distribution over all outcomes: the top ones sum to at most 1.
    assert sum(o.prob for o in _calibrated(candidates, tops, cal, budget=50)) == pytest.approx(1.0, abs=1e-6)


def _sure_calibration():
    cal = AcceptanceCalibration()
    for _ in range(50):  # every drafted token at q = 0.98 was accepted
        cal.observe([0.98, 0.98], 2)
    return cal


_SURE_TOPS = [
    _top([(0.98, 7), (0.015, 3), (0.005, 4)]),
    _top([(0.98, 8), (0.015, 5), (0.005, 6)]),
    _top([(0.5, 11), (0.3, 12), (0.1, 13), (0.06, 14), (0.04, 15)]),  # after the last candidate
]


def test_rank_outcomes_gives_every_k_its_likeliest_bonus_when_the_budget_covers_them():
    """A calibration that calls both candidates sure puts a budget of 4 on k = 2 alone; the hedge keeps one
    outcome per k (the likeliest bonus, never the rejected candidate) and ranks the rest overall."""
    cal = _sure_calibration()
    overall = _calibrated([7, 8], _SURE_TOPS, cal, budget=50)  # every outcome, most likely first
    assert {o.accepted for o in overall[:4]} == {2}  # by rank alone, the budget of 4 would go to k = 2
    hedged = _calibrated([7, 8], _SURE_TOPS, cal, budget=4)
    assert sorted((o.accepted, o.bonus) for o in hedged if o.accepted < 2) == [(0, 3), (1, 5)]
    assert [o.bonus for o in hedged if o.accepted == 2] == [11, 12]
    assert [o.prob for o in hedged] == sorted((o.prob for o in hedged), reverse=True)
    # Fewer slots than acceptance lengths: ranked overall, as before.
    assert {o.accepted for o in _calibrated([7, 8], _SURE_TOPS, cal, budget=2)} == {2}


def test_rank_outcomes_mixes_the_measured_length_law_into_the_calibrated_one():
    """P(k) is the mean of the calibrated law and `length_prior`: a measured law that says k = 0 is common
    moves budget to k = 0, and the probabilities still sum to one over all outcomes."""
    cal = _sure_calibration()
    pk_cal = length_probs([cal.p_accept(0.98)] * 2)
    prior = [0.6, 0.2, 0.2]
    ranked = _calibrated([7, 8], _SURE_TOPS, cal, budget=50, length_prior=prior)
    by_k = [sum(o.prob for o in ranked if o.accepted == k) for k in range(3)]
    assert by_k == pytest.approx([0.5 * (a + b) for a, b in zip(pk_cal, prior)], abs=1e-6)
    wide = _calibrated([7, 8], _SURE_TOPS, cal, budget=6, length_prior=prior)
    assert sum(o.accepted == 0 for o in wide) == 2  # both k = 0 bonuses outrank the unlikely k = 2 ones
    assert sum(o.accepted == 0 for o in _calibrated([7, 8], _SURE_TOPS, cal, budget=6)) == 1  # the floor alone


def test_rank_outcomes_budget_zero_and_no_candidates():
    cal = AcceptanceCalibration()
    assert _calibrated([4], [_top([(0.5, 4), (0.5, 2)]), _top([(1.0, 3)])], cal, 0) == []
    only = _calibrated([], [_top([(0.7, 1), (0.3, 2)])], cal, 2)
    assert [(o.accepted, o.bonus) for o in only] == [(0, 1), (0, 2)]


# ----- in generate: fanout="calibrated" ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair():
    from conftest import make_model, noisy_copy

    import hf_ssd

    target = make_model(0)
    hf_ssd.enable(target)
    return target, noisy_copy(target, 0.01)


@pytest.mark.parametrize("layout", ["inline", "thread"])
@pytest.mark.parametrize("budget", [1, 4])
def test_calibrated_fanout_is_exact_and_learns(pair, layout, budget):
    import hf_ssd
    from hf_ssd.speculation.predictor import calibration_for

    target, draft = pair
    config = hf_ssd.SSDConfig(fanout="calibrated", fanout_budget=budget, layout=layout, schedule="fixed",
                              hit_rate_warning=0.0)
    before = calibration_for(draft, False).curve()
    hits = 0
    # With overlap, a branch only exists if the job drafted a step before the verification ended: give each
    # target forward 10 ms (sleeping, no CPU), as a real target is slower than its draft, so hits do not
    # depend on how busy the machine is.
    slow = target.register_forward_pre_hook(lambda *_: time.sleep(0.01)) if layout == "thread" else None
    try:
        for seed in range(6):
            ids = torch.randint(2, 96, (1, 6), generator=torch.Generator().manual_seed(seed))
            ref = target.generate(ids, max_new_tokens=24, do_sample=False)
            out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft, ssd_config=config)
            assert out.tolist() == ref.tolist()
            hits += hf_ssd.last_stats(target).cache_hits
    finally:
        if slow is not None:
            slow.remove()
    assert hits > 0
    assert calibration_for(draft, False).curve() != before  # verifications were observed (and carried over)


def test_calibrated_is_a_valid_fanout_and_typos_are_not():
    from hf_ssd import SSDConfig, SSDConfigError

    assert SSDConfig(fanout="calibrated").fanout == "calibrated"
    with pytest.raises(SSDConfigError, match="must be one of"):
        SSDConfig(fanout="calibrate")
