"""The last candidate rides in the first tree step (generator `_last_row`, `Drafter.tree_steps(last=...)`).

After a hit the trunk holds every candidate but the last (a branch's last token is drafted, not fed). A job then
feeds that token in a row of its first batched step instead of a record forward of its own: the rows of outcomes
k < g draft one step earlier, the row itself goes on as the branch of (g, its first drafted token), and the other
k = g outcomes, which fed c_g beside it, take their own bonus from the second step. These tests pin down that
this happens, stays exact, and hits.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, noisy_copy

import hf_ssd
from hf_ssd.drafting.drafter import Drafter
from hf_ssd.models.simulated import DeviceCost, simulate_device, unsimulate
from hf_ssd.speculation.outcomes import Outcome

PROMPTS = [[3, 4, 5], [7, 8, 9, 10], [11, 2, 40, 41, 42], [20, 21]]
ASSISTED = {"loop": "assisted"}  # the path under test


@pytest.fixture(scope="module")
def pair():
    target = make_model(21)
    hf_ssd.enable(target)
    return target, noisy_copy(target, 0.004, seed=3)


def _run(target, draft, ids, **config):
    """Thread layout (inline jobs run to the end and keep the record forward) with a verify slow enough (a
    simulated 20 ms device) that every job finishes before its outcome: the same branches every run."""
    cfg = hf_ssd.SSDConfig(layout="thread", schedule="fixed", hit_rate_warning=0, record_timeline=True, **config)
    simulate_device(target, DeviceCost(0.02))
    try:
        out = target.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              assistant_model=draft, ssd_config=cfg, _ssd_hooks=ASSISTED)
    finally:
        unsimulate(target)
    return out[0].tolist(), hf_ssd.last_stats(target)


def _all_kept_then_hit(stats) -> int:
    """Rounds whose verification accepted every candidate and whose next round hit the cache."""
    tl = stats.timeline
    return sum(1 for a, b in zip(tl, tl[1:]) if a["accepted"] == a["n_candidates"] > 0 and b["hit"])


@pytest.mark.parametrize("gamma,budget", [(2, 2), (3, 4), (4, 6), (3, 1)])
def test_deferred_jobs_are_exact_and_hit_all_kept_outcomes(pair, monkeypatch, gamma, budget):
    target, draft = pair
    deferred = []
    holds = Drafter.holds_but_last
    monkeypatch.setattr(Drafter, "holds_but_last", lambda self, c, d: deferred.append(holds(self, c, d)) or deferred[-1])
    kept_hits = 0
    for ids in PROMPTS:
        ref = target.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None)
        out, stats = _run(target, draft, ids, gamma=gamma, fanout_budget=budget)
        assert out == ref[0].tolist()
        kept_hits += _all_kept_then_hit(stats)
    assert any(deferred), "no job took the deferred path"
    if budget >= 2:  # budget 1 may bet on a k < g outcome instead
        assert kept_hits > 0, "no round that kept every candidate hit: the (g, bonus) branches are not filed"


def test_a_cut_job_gives_k_below_g_rows_a_step_more(pair):
    """Cut after two steps (the outcome arriving), rows of k < g hold two tokens, the row that fed c_g one (as
    the branch of (g, its first token)), and so does a (g, bonus) row that fed c_g beside it in the first step;
    each is the draft's own continuation of its prefix and bonus. A row of the k = g share for which `extra`
    has no outcome drafts nothing."""
    _, draft = pair
    drafter = Drafter(draft, None, False, top_k=8)
    context = [5, 6, 7, 8]
    candidates = drafter.draft(context, 3, [0] * 4).tokens
    assert drafter.holds_but_last(context, candidates)  # c_3 drafted, not fed
    tops = [drafter.top[len(context) - 1 + j] for j in range(3)]
    below = [Outcome(k, int(next(t for t in tops[k][1].tolist() if t != candidates[k]))) for k in range(3)]
    rows = below + [Outcome(2, candidates[-1])] * 3  # the k = g share: three rows feeding c_3
    joined = []

    def extra(top, first):
        other = int(next(t for t in top[1].tolist() if t != first))
        joined.append(other)
        return 0.5, [Outcome(3, other, 0.1)]

    steps = []
    tree = drafter.start_tree(len(context), rows)
    drafted = drafter.tree_steps(tree, rows, 3, [0] * 4, lambda: len(steps) >= 2, steps.append,
                                 last=(len(rows) - 3, extra, 3))
    assert len(drafted) == 6 and len(joined) == 1
    assert sum(not r.tokens for _, r in drafted) == 1  # the third k = g row: no outcome, no branch
    got = {(s.outcome.accepted, s.outcome.bonus): (s.batch.prefix[s.row], r.tokens) for s, r in drafted if r.tokens}
    assert len(got) == 5
    for k, o in enumerate(below):
        prefix, tokens = got[(k, o.bonus)]
        assert prefix == context + candidates[:k] and len(tokens) == 2
    full = context + candidates

    def greedy(prefix, n):
        out = draft.generate(torch.tensor([prefix]), max_new_tokens=n, do_sample=False, eos_token_id=None)
        return out[0, len(prefix):].tolist()

    first = greedy(full, 1)[0]  # the row that fed c_3 drafted the draft's own choice: now its bonus
    assert got[(3, first)][0] == full and len(got[(3, first)][1]) == 1
    assert got[(3, joined[0])][0] == full and len(got[(3, joined[0])][1]) == 1
    for (_, bonus), (prefix, tokens) in got.items():  # batched rows attend to the right keys and values
        assert greedy(prefix + [bonus], len(tokens)) == tokens


def test_every_branch_is_the_drafts_own_continuation(pair):
    """Each filed branch, (g, bonus) ones included, holds what the draft alone decodes after its prefix and bonus:
    the row that fed c_g and the rows that joined after it attend to the right keys and values."""
    import hf_ssd.loop.assisted as generator

    target, draft = pair
    filed = []
    insert = generator.SSDCandidateGenerator._insert

    def spy(self, branch):
        state = branch.state
        filed.append((branch.accepted, state.batch.prefix[state.row] + [branch.bonus], list(branch.tokens)))
        return insert(self, branch)

    mp = pytest.MonkeyPatch()
    mp.setattr(generator.SSDCandidateGenerator, "_insert", spy)
    try:
        _run(target, draft, PROMPTS[1], gamma=3, fanout_budget=6)
    finally:
        mp.undo()
    kinds = set()
    for accepted, prefix, tokens in filed:
        ref = draft.generate(torch.tensor([prefix]), max_new_tokens=len(tokens), do_sample=False, eos_token_id=None)
        assert ref[0, len(prefix):].tolist() == tokens
        kinds.add(accepted)
    assert 3 in kinds and min(kinds) < 3  # rows of k = g (gamma 3) and of k < g were checked


def test_sampled_branches_carry_the_draft_distribution_of_every_token(pair):
    """When sampling, each filed branch, (g, bonus) ones included, holds one draft distribution per token, the
    one its token was drawn from: speculative sampling reads it as q, so a row left over from the fed last
    candidate (or a shifted one) would change the output distribution."""
    import hf_ssd.loop.assisted as generator

    target, draft = pair
    filed = []
    insert = generator.SSDCandidateGenerator._insert

    def spy(self, branch):
        state = branch.state
        filed.append((branch.accepted, state.batch.prefix[state.row] + [branch.bonus], list(branch.tokens),
                      branch.logits.clone()))
        return insert(self, branch)

    cfg = hf_ssd.SSDConfig(layout="thread", schedule="fixed", hit_rate_warning=0, gamma=3, fanout_budget=6)
    mp = pytest.MonkeyPatch()
    mp.setattr(generator.SSDCandidateGenerator, "_insert", spy)
    simulate_device(target, DeviceCost(0.02))
    try:
        torch.manual_seed(0)
        # No warpers (top_k=0, temperature 1): q is the draft's plain softmax, computable here.
        target.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=24, do_sample=True, top_k=0, temperature=1.0,
                        eos_token_id=None, assistant_model=draft, ssd_config=cfg, _ssd_hooks=ASSISTED)
    finally:
        unsimulate(target)
        mp.undo()
    assert 3 in {k for k, *_ in filed}  # rows of k = g were checked
    for _, prefix, tokens, logq in filed:
        assert logq.shape[0] == len(tokens)
        with torch.no_grad():
            logits = draft(torch.tensor([prefix + tokens])).logits[0, len(prefix) - 1 : len(prefix) - 1 + len(tokens)]
        want = torch.log_softmax(logits.double(), dim=-1)
        assert torch.allclose(logq[:, : want.shape[-1]].double(), want, atol=1e-6)

