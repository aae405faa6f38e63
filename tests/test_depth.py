"""Pipeline depth > 1 (SSDConfig.pipeline_depth): pre-drafting rounds ahead, chain-keyed cache entries promoted
on a hit, unfinished branches carried into the next job, and eviction that acts.

- The cache: promotion re-keys exactly the branches under the hit; each policy keeps what it should.
- The drafter: a forked child row and a row resumed in a later batch draft exactly what the draft computes alone
  on the same context (so the gathered keys/values are right).
- Generation: greedy output is token-identical to the target alone over seeds and configs with hits served from
  depth 2 and evictions; sampled output matches the target's exact distribution (chi-square, false-fail rate
  < 1e-4 as in test_sampling.py).

The target's forward is padded to a fixed wall time by sleeping (hf_ssd.models.simulated): no CPU used, so the
speculator has time for deeper levels whatever the machine's load.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_model, noisy_copy
from test_sampling import GEN, PROMPT, N, assert_matches_target, exact_joint, sampling_pair

import hf_ssd
from hf_ssd import SSDConfig
from hf_ssd.drafting.drafter import Drafter, Unfinished
from hf_ssd.models.simulated import DeviceCost, simulate_device, unsimulate
from hf_ssd.speculation.cache import Branch, SpeculationCache
from hf_ssd.speculation.outcomes import Outcome


# ----- the cache -------------------------------------------------------------------------------------------------
def _branch(round_id, k, bonus, prob, rest=(), tokens=(1,)):
    return Branch(round_id, k, bonus, prob, list(tokens), rest=tuple(rest))


def test_promote_rekeys_only_the_branches_under_the_hit():
    cache = SpeculationCache(16)
    cache.put(_branch(5, 2, 40, 0.5))  # the hit itself
    cache.put(_branch(5, 2, 40, 0.5 * 0.6, [(3, 7, 0.6)]))  # under the hit
    cache.put(_branch(5, 2, 40, 0.5 * 0.6 * 0.5, [(3, 7, 0.6), (1, 9, 0.5)]))  # two rounds under it
    cache.put(_branch(5, 1, 41, 0.3 * 0.9, [(3, 7, 0.9)]))  # under another outcome
    cache.put(_branch(5, 1, 41, 0.3))
    assert cache.get(6, 3, 7) is None
    assert cache.promote(5, 2, 40) == 2
    cache.begin_round(6)
    child = cache.get(6, 3, 7)
    assert child is not None and child.prob == pytest.approx(0.6) and child.depth == 2
    grandchild = [b for b in cache if b.rest]
    assert len(grandchild) == 1 and grandchild[0].key == (6, (3, 7), (1, 9))
    assert grandchild[0].prob == pytest.approx(0.6 * 0.5)
    assert len(cache) == 2  # everything of round 5 (the other outcome's branches included) is gone
    assert cache.held(6) == 1 and cache.hit_mass(6) == pytest.approx(0.6)


@pytest.mark.parametrize("seed", range(5))
def test_probability_eviction_keeps_the_most_likely(seed):
    rng = random.Random(seed)
    cache = SpeculationCache(5, "probability")
    probs = [rng.random() for _ in range(30)]
    for i, p in enumerate(probs):
        depth = 1 + i % 3
        cache.put(_branch(1, i, i, p, [(0, 0, 1.0)] * (depth - 1)))
        assert len(cache) <= 5
    assert sorted(b.prob for b in cache) == sorted(probs)[-5:]
    assert cache.evictions == 25 and sum(cache.evicted_by_depth.values()) == 25


def test_probability_eviction_drops_a_new_branch_that_is_least_likely():
    cache = SpeculationCache(2, "probability")
    cache.put(_branch(1, 0, 0, 0.5))
    cache.put(_branch(1, 1, 1, 0.4))
    assert cache.put(_branch(1, 2, 2, 0.1, [(0, 3, 0.2)])) is False
    assert {b.accepted for b in cache} == {0, 1} and cache.evicted_by_depth == {2: 1}


def test_lru_eviction_keeps_the_recently_inserted_and_used():
    cache = SpeculationCache(3, "lru")
    for i in range(3):
        cache.put(_branch(1, i, i, 0.9 - i * 0.1))
    cache.get(1, 0, 0)  # used: now the most recent
    cache.put(_branch(1, 3, 3, 0.01))  # least likely, but new: LRU keeps it and drops entry 1
    assert {b.accepted for b in cache} == {0, 2, 3}
    assert cache.peek(1, 2, 2) is not None
    cache.put(_branch(1, 4, 4, 0.01))  # peek is not a use: entry 2 goes next
    assert {b.accepted for b in cache} == {0, 3, 4} and cache.evictions == 2


# ----- the drafter: forked and resumed rows draft what the draft computes alone ----------------------------------
def _alone(model, seq, n):
    """n greedy tokens of `model` after `seq`, each from a fresh forward over the whole sequence (no cache)."""
    seq = list(seq)
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            out.append(t)
            seq.append(t)
    return out


def test_fork_and_resume_rows_match_the_draft_alone():
    draft = make_model(7)
    d = Drafter(draft, None, do_sample=False, top_k=6)
    context = [5, 9, 14, 3, 22, 8]
    candidates = d.draft(context, 3, [])  # trunk now holds context + 2 of them
    d.record(context + candidates.tokens, record_from=len(context) - 1)
    tops = d.candidate_tops(len(context), 3)
    outcomes = [Outcome(3, int(tops[3][1][0])), Outcome(1, int(tops[1][1][1])), Outcome(0, int(tops[0][1][1]))]
    tree = d.start_tree(len(context), outcomes)
    gamma = 4
    level1 = d.tree_steps(tree, outcomes, gamma, [], lambda: False)
    for state, result in level1:
        seq = context + candidates.tokens[: state.outcome.accepted] + [state.outcome.bonus]
        assert result.tokens == _alone(draft, seq, gamma)
    # Children of two parents (different k, one of them the parent's last position): rows gathered from level 1.
    children = []
    for (state, result), k in zip(level1[:2], (gamma, 1)):
        bonus = int(state.tops(gamma)[k][1][1 if k < gamma else 0])
        children.append((state, result.tokens, Outcome(k, bonus)))
    fork = d.fork_tree(children)
    steps = [0]

    def stop_after_two():
        steps[0] += 1
        return steps[0] > 2

    cut = d.tree_steps(fork, [o for *_, o in children], gamma, [], stop_after_two)
    assert all(len(r.tokens) == 2 and s.fed == 2 for s, r in cut)
    # The next job resumes them in a batch next to a fresh trunk row; they end as if never cut.
    resumed = d.start_tree(len(context), outcomes[:1], [Unfinished(s, r.tokens, r.logits) for s, r in cut])
    rows = outcomes[:1] + [o for *_, o in children]
    done = d.tree_steps(resumed, rows, gamma, [], lambda: False)
    for (parent, tokens, o), (state, result) in zip(children, done[1:]):
        seq = context + candidates.tokens[: parent.outcome.accepted] + [parent.outcome.bonus] + tokens[: o.accepted]
        assert result.tokens == _alone(draft, seq + [o.bonus], gamma)
        assert state.fed == gamma + 1
    # Adopting a resumed child gives the trunk exactly its sequence, and the trunk drafts on correctly from it.
    state, result = done[2]
    d.adopt(state, result.tokens)
    seq = state.batch.prefix[state.row] + [state.outcome.bonus] + result.tokens
    assert d.ids == seq  # every drafted token was fed (the last step feeds the gamma-th)
    assert d.draft(seq, 2, []).tokens == _alone(draft, seq, 2)


def test_children_grown_mid_batch_match_the_draft_alone():
    """Rows added to a batch in flight (children whose prefix their parent has drafted already) draft what the
    draft computes alone, and their parents go on unchanged."""
    draft = make_model(8)
    d = Drafter(draft, None, do_sample=False, top_k=6)
    context = [7, 3, 19, 44, 2]
    d.sync(context)
    outcomes = [Outcome(0, 11), Outcome(0, 30)]
    tree = d.start_tree(len(context), outcomes)
    gamma, added = 4, []

    def grow(states, results):
        # After each step, one child under each parent: reject its newest token, take the draft's next-best.
        if len(results[0].tokens) not in (1, 3) or len(states) > 6:
            return []
        out = []
        for r in range(2):
            j = len(results[r].tokens) - 1
            values, ids = states[r].tops(j)[j]
            bonus = next(int(t) for t in ids.tolist() if t != results[r].tokens[j])
            out.append((r, Outcome(j, bonus)))
            added.append((r, j, bonus, list(results[r].tokens)))
        return out

    done = d.tree_steps(tree, outcomes, gamma, [], lambda: False, grow=grow)
    assert len(done) == 2 + len(added) == 6
    for (state, result), o in zip(done[:2], outcomes):
        assert result.tokens == _alone(draft, context + [o.bonus], gamma) and state.fed == gamma + 1
    for (r, j, bonus, parent_tokens), (state, result) in zip(added, done[2:]):
        seq = context + [outcomes[r].bonus] + parent_tokens[:j] + [bonus]
        assert result.tokens == _alone(draft, seq, gamma) and state.fed == gamma + 1
    # A grown child adopts like any branch.
    state, result = done[-1]
    d.adopt(state, result.tokens)
    seq = state.batch.prefix[state.row] + [state.outcome.bonus] + result.tokens
    assert d.ids == seq and d.draft(seq, 2, []).tokens == _alone(draft, seq, 2)


# ----- generation ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slow_pair():
    target = make_model(0)
    hf_ssd.enable(target)
    draft = noisy_copy(target, 0.004)
    return target, draft


CONFIGS = [
    dict(gamma=3, fanout_budget=2, pipeline_depth=2),
    dict(gamma=4, fanout_budget=1, pipeline_depth=3, cache_size=3),
    dict(gamma=2, fanout_budget=3, pipeline_depth=3, cache_size=4, eviction="lru"),
    dict(gamma=3, fanout="geometric", fanout_budget=2, pipeline_depth=2, cache_size=3),
    dict(gamma=5, fanout_budget=2, pipeline_depth=2, fallback="short", fallback_gamma=2),
]


def test_greedy_identity_with_depth(slow_pair):
    target, draft = slow_pair
    g = torch.Generator().manual_seed(3)
    refs = {}
    prompts = [torch.randint(3, 90, (1, int(torch.randint(3, 20, (1,), generator=g))), generator=g) for _ in range(4)]
    for i, p in enumerate(prompts):
        refs[i] = target.generate(p, max_new_tokens=40, do_sample=False)
    # A 50 ms verify (sleeping): time for the deeper levels. At 30 ms a loaded machine left the third level
    # undrafted in about one run in six.
    simulate_device(target, DeviceCost(0.05))
    totals = {"deep_hits": 0, "promoted": 0, "evictions": {}, "branches": {}}
    try:
        for kw in CONFIGS:
            config = SSDConfig(layout="thread", schedule="fixed", hit_rate_warning=0, **kw)
            for i, p in enumerate(prompts):
                out = target.generate(p, max_new_tokens=40, do_sample=False, assistant_model=draft, ssd_config=config)
                assert torch.equal(out, refs[i]), (kw, i)
                st = hf_ssd.last_stats(target)
                assert st.pipeline_depth == kw["pipeline_depth"]
                assert st.cache_hits == sum(st.hits_by_depth.values())
                totals["deep_hits"] += sum(n for d, n in st.hits_by_depth.items() if d > 1)
                totals["promoted"] += st.promoted
                ev = totals["evictions"].setdefault(config.eviction, 0)
                totals["evictions"][config.eviction] = ev + st.evictions
                for d, n in st.branches_by_depth.items():
                    totals["branches"][d] = totals["branches"].get(d, 0) + n
    finally:
        unsimulate(target)
    # The deeper levels really ran, served hits, and the small caches evicted under both policies.
    assert totals["branches"].get(2, 0) > 0 and totals["branches"].get(3, 0) > 0, totals
    assert totals["deep_hits"] > 0 and totals["promoted"] > 0, totals
    assert totals["evictions"]["probability"] > 0 and totals["evictions"]["lru"] > 0, totals


def test_depth_one_never_drafts_ahead(slow_pair):
    target, draft = slow_pair
    simulate_device(target, DeviceCost(0.03))
    try:
        config = SSDConfig(layout="thread", schedule="fixed", gamma=3, fanout_budget=2, hit_rate_warning=0)
        target.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=30, do_sample=False, assistant_model=draft,
                        ssd_config=config, _ssd_hooks={"loop": "assisted"})  # the path that serves depth > 1
    finally:
        unsimulate(target)
    st = hf_ssd.last_stats(target)
    assert set(st.branches_by_depth) == {1} and st.promoted == 0 and "depth" not in st.summary()


def test_stats_report_depth_and_calibration(slow_pair):
    target, draft = slow_pair
    simulate_device(target, DeviceCost(0.03))
    try:
        config = SSDConfig(layout="thread", schedule="fixed", gamma=3, fanout_budget=2, pipeline_depth=2,
                           cache_size=3, hit_rate_warning=0)
        target.generate(torch.tensor([[4, 5, 6, 7]]), max_new_tokens=40, do_sample=False, assistant_model=draft,
                        ssd_config=config)
    finally:
        unsimulate(target)
    st = hf_ssd.last_stats(target)
    rows = st.hit_calibration()
    assert sum(r["lookups"] for r in rows) == st.lookups > 0
    assert all(0.0 <= r["predicted"] <= 1.0 and 0.0 <= r["observed"] <= 1.0 for r in rows)
    assert 0.0 < st.predicted_hit_rate <= 1.0
    d = st.to_dict()
    assert d["hit_calibration"] == rows and d["evictions_by_depth"] == st.evictions_by_depth
    assert "depth 2: hits by depth" in st.summary()


SAMPLE_V, SAMPLE_L = 4, 6  # longer than test_sampling.py's 4 tokens: rounds 3+ are where deeper levels hit
SAMPLE_POSITIONS = [(i,) for i in range(SAMPLE_L)] + [(0, 1), (2, 3), (4, 5)]


def test_sampling_matches_target_with_depth():
    target, draft = sampling_pair(SAMPLE_V)
    joint = exact_joint(target, SAMPLE_L)
    config = SSDConfig(gamma=2, fanout_budget=8, pipeline_depth=3, cache_size=16, layout="thread", schedule="fixed",
                       hit_rate_warning=0)
    # A deep hit needs two hits in a row (about 30% each at budget 3 here), so a budget of 3 served 11-23 per run,
    # too close to the floor below; a budget of 8 and a 12 ms verify served 49-80 (on a loaded CPU too).
    simulate_device(target, DeviceCost(0.012))
    torch.manual_seed(4321)
    samples, deep = [], 0
    ids = torch.tensor([PROMPT])
    try:
        for _ in range(N):
            out = target.generate(ids, max_new_tokens=SAMPLE_L, assistant_model=draft, ssd_config=config, **GEN)
            samples.append(tuple(out[0, len(PROMPT):].tolist()))
            deep += sum(n for d, n in hf_ssd.last_stats(target).hits_by_depth.items() if d > 1)
    finally:
        unsimulate(target)
    assert_matches_target(samples, joint, "pipeline_depth=3", SAMPLE_POSITIONS)
    if deep < 20:  # a machine where the speculator rarely gets two rounds ahead (the 2-vCPU Xeon of 2026-12-03: 1-7)
        pytest.skip(f"only {deep} hits served from deeper levels: exact, but deep hits not exercised enough here")
