"""Batched calls (B > 1, hf_ssd/loop/): every row exact.

Greedy: every row identical to the target's own batched `generate` on the same (left-padded) batch and to the
row run alone, for B in {2, 3, 8, 16}, mixed prompt lengths, rows ending early at EOS, AR and SD rounds at
several gamma (the scheduler's choice, and fixed), confidence-stopped SD (each row its own length), families
with sliding windows, and the ragged caches' compaction. Sampling: per row, chi-square tests against the exact
distribution (tests/test_sampling.py), rows at different acceptance. Users: pipelines with batch_size, clear errors for what batches do not serve.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import pytest
import torch
import transformers as tf
from conftest import make_model, noisy_copy
from test_edges import text_of, tiny_tokenizer
from test_families import build
from test_sampling import GEN, L, N, assert_matches_target, exact_joint, sampling_pair

import hf_ssd
import hf_ssd.loop.batch as loop
import hf_ssd.loop.ragged as ragged
from hf_ssd import SSDConfig, SSDUsageError
from hf_ssd.models.simulated import DeviceCost, simulate_device, unsimulate
from hf_ssd.scheduling.schedule import Option

NEW = 20
QUIET = {"hit_rate_warning": 0.0}



def only(kind: str):
    """An `_ssd_hooks` option filter: the scheduler may pick only options of this kind."""
    return {"options": lambda options: [o for o in options if o.kind == kind]}


# name -> (config, hooks): the scheduler's choice; plain SD at fixed gammas; overlapped SSD (inline: the job runs
# to its end, so hits do not depend on timing; thread: it races the verify) at 1, 2 and 4 branches per row.
CONFIGS = {
    "auto": (SSDConfig(**QUIET), {"plain": False}),  # the loop's own choice (the plain hand-off: test_plain_*)
    "sd_g1": (SSDConfig(gamma=1, **QUIET), only("sd")),
    "sd_g3": (SSDConfig(gamma=3, **QUIET), only("sd")),
    "sd_g6": (SSDConfig(gamma=6, **QUIET), only("sd")),
    # Confidence-stopped SD (up to 16 tokens, each row stopping on its own draft's confidence).
    "sd_conf": (SSDConfig(**QUIET), {"options": lambda options: [o for o in options if o.stop]}),
    "ssd_g3_b1": (SSDConfig(gamma=3, schedule="fixed", layout="inline", **QUIET), None),
    "ssd_g4_b4": (SSDConfig(gamma=4, fanout_budget=4, schedule="fixed", layout="inline", **QUIET), None),
    "ssd_g2_b2_thread": (SSDConfig(gamma=2, fanout_budget=2, schedule="fixed", layout="thread", **QUIET), None),
    "ssd_g3_b4_geometric": (SSDConfig(gamma=3, fanout_budget=4, fanout="geometric", schedule="fixed",
                                      layout="inline", **QUIET), None),
    # The user's bonuses per k (k = 0..3); with schedule="auto" a fan-out list leaves SSD at that gamma only.
    "ssd_g3_list": (SSDConfig(gamma=3, fanout=[2, 1, 0, 1], layout="inline", **QUIET), None),
    # Each row's 3 likeliest outcomes of the 8 its geometric split names (outcome truncation).
    "ssd_g3_b8_max3": (SSDConfig(gamma=3, fanout_budget=8, max_outcomes=3, schedule="fixed", layout="inline",
                                 **QUIET), None),
    # The fan-out list and outcome truncation together, with the job racing the verify.
    "ssd_g3_list_max3_thread": (SSDConfig(gamma=3, fanout=[2, 1, 1, 1], max_outcomes=3, schedule="fixed",
                                          layout="thread", **QUIET), None),
    # A miss looks its candidates up in the row's own context (prompt lookup) instead of drafting them.
    "ssd_g3_ngram": (SSDConfig(gamma=3, fanout_budget=2, fallback="ngram", ngram_size=2, schedule="fixed",
                               layout="inline", **QUIET), None),
}


@pytest.fixture(scope="module")
def pair():
    """SDPA target (its own padded batches are exact: eager attention turns fully padded queries into NaN states)
    and two drafts: one close (long accepted runs), one noisy (many rejections, so rows diverge)."""
    target = hf_ssd.enable(make_model(0, attn="sdpa"))
    target.generation_config.eos_token_id = None  # rows end at NEW tokens unless a test names an EOS
    return target, noisy_copy(target, 0.002), noisy_copy(target, 0.02)


def padded_batch(lengths: list[int], seed: int, vocab: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(2, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def lengths_for(b: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randint(2, 10, (b,), generator=g).tolist()


def assert_rows_exact(target, draft, ids, mask, name, batched_reference: bool = True, **kw):
    """Identical to the target's own batched generate, and each row to the row alone. (`batched_reference`
    False: eager attention, whose own padded batches compute NaN states for padding and so garbage for padded
    rows; hf_ssd prefills each row alone and stays exact there.)"""
    config, hooks = CONFIGS[name]
    if ids.shape[0] == 1:  # one prompt runs the assisted loop unless sent through the batch loop
        hooks = {**(hooks or {}), "loop": "batch"}
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=NEW,
                          ssd_config=config, _ssd_hooks=hooks, **kw)
    if batched_reference:
        want = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, **kw)
        assert out.shape == want.shape and torch.equal(out, want), (out, want)
    width = ids.shape[1]
    pad = target.generation_config.pad_token_id
    for i in range(ids.shape[0]):
        prompt = ids[i : i + 1, width - int(mask[i].sum()):]
        alone = target.generate(prompt, do_sample=False, max_new_tokens=NEW, **kw)[0, prompt.shape[1]:]
        row = out[i, width:]
        assert torch.equal(row[: alone.numel()], alone), i
        assert bool((row[alone.numel():] == pad).all()), i  # padded after its end
    return hf_ssd.last_stats(target)


@pytest.mark.parametrize("b", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_rows_identical_to_target(pair, b, name):
    """b = 1: a batch of one through the batch loop (the `loop` hook), which every batch size is to run."""
    target, close, noisy = pair
    hits = misses = 0
    for seed, draft in enumerate((close, noisy)):
        ids, mask = padded_batch(lengths_for(b, seed), seed)
        stats = assert_rows_exact(target, draft, ids, mask, name)
        assert stats.batch_size == b and len(stats.rows) == b
        assert stats.new_tokens == sum(r["new_tokens"] for r in stats.rows) == b * NEW
        if name != "auto":
            assert stats.proposed_tokens > 0 and 0 < stats.accepted_tokens <= stats.proposed_tokens
            # Rejections exercised: by the noisy draft (one row may keep all of the close draft's candidates).
            assert draft is close or stats.accepted_tokens < stats.proposed_tokens
        if name.startswith("ssd") and "thread" not in name:
            hits, misses = hits + stats.cache_hits, misses + stats.cache_misses
    if name.startswith("ssd") and "thread" not in name:
        assert hits > 0 and misses > 0, (hits, misses)


def test_rows_ending_early_at_eos(pair):
    """An EOS token common in the rows' continuations: rows stop at different rounds (one mid-round, within its
    accepted candidates), leave the batch, and are padded as transformers pads them."""
    target, close, _ = pair
    ids, mask = padded_batch(lengths_for(8, 3), 3)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)[:, ids.shape[1]:]
    counts = torch.bincount(plain.flatten(), minlength=96)
    eos = int(counts.argmax())
    for name in ("sd_g3", "sd_g6", "ssd_g3_b1", "ssd_g4_b4", "auto"):
        stats = assert_rows_exact(target, close, ids, mask, name, eos_token_id=eos)
        ends = [r["new_tokens"] for r in stats.rows]
        assert min(ends) < NEW and len(set(ends)) > 1, ends


class _StopAt(tf.StoppingCriteria):
    """A row ends at its first new `token` (after the padded prompt's `width` columns): a criterion of the
    caller's own, so the loop cannot reduce it to the length and EOS rule."""

    def __init__(self, token: int, width: int):
        self.token, self.width = token, width

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.width:] == self.token).any(dim=-1)


def test_rows_ending_at_a_callers_stopping_criterion(pair):
    """A stopping criterion of the caller's own ends rows where it would end them in the target's batched
    generate (one token at a time, mid-round within accepted candidates too); with it, EOS and the length still
    end the others."""
    target, close, _ = pair
    ids, mask = padded_batch(lengths_for(8, 4), 4)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)[:, ids.shape[1]:]
    counts = torch.bincount(plain.flatten(), minlength=96)
    token, eos = (int(t) for t in counts.argsort(descending=True)[:2])
    criteria = tf.StoppingCriteriaList([_StopAt(token, ids.shape[1])])
    for name in ("sd_g3", "ssd_g4_b4", "auto"):
        stats = assert_rows_exact(target, close, ids, mask, name, stopping_criteria=criteria, eos_token_id=eos)
        ends = {r["index"]: r["new_tokens"] for r in stats.rows}
        mine = [i for i, row in enumerate(plain.tolist()) if token in row and (eos not in row or
                                                                              row.index(token) < row.index(eos))]
        assert mine and all(ends[i] == plain[i].tolist().index(token) + 1 for i in mine), (mine, ends)


def test_compaction_keeps_rows_exact(pair, monkeypatch):
    """Compacting the ragged caches (dropping masked columns) every round changes nothing a row computes."""
    monkeypatch.setattr(ragged, "COMPACT_MIN", 0)
    monkeypatch.setattr(ragged, "COMPACT_WASTE", 0.0)
    calls = []
    real = ragged.RaggedCache.maybe_compact

    def counting(self):
        before = self.columns
        real(self)
        calls.append(before - self.columns)

    monkeypatch.setattr(ragged.RaggedCache, "maybe_compact", counting)
    target, _, noisy = pair
    ids, mask = padded_batch(lengths_for(8, 5), 5)
    assert_rows_exact(target, noisy, ids, mask, "sd_g3")
    assert_rows_exact(target, noisy, ids, mask, "ssd_g4_b4")
    assert sum(calls) > 0, "nothing was compacted"


@pytest.mark.parametrize(("family", "attn"), [("mistral+sw", "sdpa"), ("qwen2+sw", "sdpa"), ("gemma2", "eager"),
                                             ("gemma3_text", "eager"), ("qwen3", "sdpa"), ("mistral+sw", "eager")])
def test_families_batched(family, attn):
    """Sliding windows (W = 8, far past it: each row's columns must stay contiguous), hybrid layers, eager
    attention, other families; SD at gamma 3 with a noisy draft, so rows reject at different columns."""
    target = hf_ssd.enable(build(family, attn=attn))
    draft = noisy_copy(target, 0.01)
    ids, mask = padded_batch([6, 3, 5], 7, vocab=90)
    for name in ("sd_g3", "ssd_g3_b1"):
        assert_rows_exact(target, draft, ids, mask, name, batched_reference=attn == "sdpa")


@pytest.mark.parametrize("name", ["sd_g2", "sd_conf", "ssd_g2_b2", "ssd_g2_ngram", "ssd_g2_saguaro"])
def test_sampling_rows_match_target_distribution(name, monkeypatch):
    """Two prompts (different acceptance), each twice in a batch of 4: every row's samples follow the target's
    exact distribution (false-fail rate < 1e-4 per prompt, as in tests/test_sampling.py). ssd_g2_ngram: missed
    rows propose their n-gram lookup (unigrams: the tiny vocabulary repeats), verified against a point mass;
    ssd_g2_saguaro: the draft's likeliest tokens at each position scaled by C (Saguaro sampling)."""
    target, draft = sampling_pair()
    prompts = [[2, 3], [4, 1]]
    joints = []
    for p in prompts:
        import test_sampling

        saved = test_sampling.PROMPT
        test_sampling.PROMPT = p
        try:
            joints.append(exact_joint(target))
        finally:
            test_sampling.PROMPT = saved
    ids = torch.tensor([prompts[0], prompts[1], prompts[0], prompts[1]])
    config, hooks = {
        "sd_g2": (SSDConfig(gamma=2, **QUIET), only("sd")),
        "sd_conf": (SSDConfig(**QUIET), {"options": lambda options: [o for o in options if o.stop]}),
        "ssd_g2_b2": (SSDConfig(gamma=2, fanout_budget=2, schedule="fixed", layout="inline", **QUIET), None),
        "ssd_g2_ngram": (SSDConfig(gamma=2, fanout_budget=1, fallback="ngram", ngram_size=1, schedule="fixed",
                                   layout="inline", **QUIET), None),
        "ssd_g2_saguaro": (SSDConfig(gamma=2, fanout_budget=2, saguaro_c=0.3, schedule="fixed", layout="inline",
                                     **QUIET), None),
    }[name]
    looked_up, lookup = [], loop.ngram_lookup
    monkeypatch.setattr(loop, "ngram_lookup", lambda *a: looked_up.append(lookup(*a)) or looked_up[-1])
    torch.manual_seed(4321)
    samples: list[list[tuple]] = [[], []]
    proposed = accepted = hits = 0
    for _ in range(N // 2):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=L, assistant_model=draft,
                              ssd_config=config, _ssd_hooks=hooks, **GEN)
        for i in range(4):
            samples[i % 2].append(tuple(out[i, 2:].tolist()))
        stats = hf_ssd.last_stats(target)
        proposed, accepted = proposed + stats.proposed_tokens, accepted + stats.accepted_tokens
        hits += stats.cache_hits
    assert 0 < accepted < proposed  # both paths: accepted candidates and rejections (residual draws)
    assert (hits > 0) == name.startswith("ssd")  # SSD: candidates from pre-drafted branches too
    assert any(looked_up) == name.endswith("ngram")
    for p, s, joint in zip(prompts, samples, joints):
        assert_matches_target(s, joint, f"prompt {p}")


def test_pipeline_with_batch_size_matches_plain_pipeline(pair):
    from test_edges import tiny_tokenizer

    target, close, _ = pair
    tok = tiny_tokenizer()
    tok.padding_side = "left"
    pipe = tf.pipeline("text-generation", model=target, tokenizer=tok, assistant_model=close)
    plain = tf.pipeline("text-generation", model=target, tokenizer=tok)
    prompts = ["abc", "hello there", "x", "zzzz yy", "q r s t u"]
    want = plain(prompts, batch_size=4, max_new_tokens=12, do_sample=False)
    got = pipe(prompts, batch_size=4, max_new_tokens=12, do_sample=False, ssd_config=SSDConfig(**QUIET),
               _ssd_hooks={"plain": False})  # the loop, not a first call's plain decoding
    assert got == want
    batch4 = [m for k, m in hf_ssd.scheduling.costs.estimates_of(target, close) if k[2] == "batch4:thread"]
    assert batch4 and batch4[0].rounds_seen > 0 and batch4[0].plain_step.count == 0  # it ran the loop


def test_batched_stats_say_what_ran(pair):
    target, close, _ = pair
    ids, mask = padded_batch([4, 6], 9)
    config, hooks = CONFIGS["sd_g3"]
    out = target.generate(ids, attention_mask=mask, assistant_model=close, do_sample=False, max_new_tokens=NEW,
                          ssd_config=config, _ssd_hooks=hooks, return_dict_in_generate=True)
    stats = out.ssd_stats
    assert stats is hf_ssd.last_stats(target) and stats.layout == "thread"  # on CPU cores (layout "auto")
    assert set(stats.options) == {"prefill", "sd(g=3)"}  # the prompts' prefill (draft and target), then SD
    assert stats.lookups == 0  # no speculation ran
    assert stats.wall_time > 0 and stats.tokens_per_second > 0


@pytest.mark.parametrize("layout", ["thread", "inline"])
def test_a_batchs_stats_split_its_time_and_record_its_timeline(pair, layout, tmp_path):
    """A batch's stats hold its busy intervals: the verify's time, and the job's pre-drafting overlapping it on
    its thread (a bubble ratio under 1; inline, the job runs before the verify: no overlap); with
    record_timeline, one event per round, which `hf_ssd.plot_timeline` draws. Every round is in them, the last
    one too (a round is measured by the next round's job, the last at the end)."""
    target, close, _ = pair
    ids, mask = padded_batch([4, 6, 5], 11)
    config = SSDConfig(gamma=3, fanout_budget=2, schedule="fixed", layout=layout, record_timeline=True, **QUIET)
    forwards = []
    handle = target.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        stats = target.generate(ids, attention_mask=mask, assistant_model=close, do_sample=False,
                                max_new_tokens=NEW, ssd_config=config, return_dict_in_generate=True).ssd_stats
    finally:
        handle.remove()
    events = stats.timeline
    assert len(events) == stats.rounds == len(forwards) and events[0]["option"] == "prefill"
    assert all(e["t_request"] <= e["t_return"] <= e["t_verified"] for e in events)
    assert sum(e["accepted"] for e in events) == stats.accepted_tokens
    assert sum(e["n_candidates"] for e in events) == stats.proposed_tokens
    # An event's hit: every row's candidates from a branch. Inline, the job drafts to its end before the verify;
    # on its thread it races the verify (a tiny model's, a few ms): whether it wins is timing.
    assert not all(e["hit"] for e in events[1:])
    assert any(e["hit"] for e in events) or layout == "thread"
    assert 0 < stats.verify_time < stats.wall_time and stats.speculate_time > 0
    if layout == "thread":
        assert stats.overlap_time > 0 and stats.bubble_ratio < 1
    else:
        assert stats.overlap_time == 0 and stats.bubble_ratio == 1
    hf_ssd.plot_timeline(stats, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0
    quiet = SSDConfig(gamma=3, fanout_budget=2, schedule="fixed", layout=layout, **QUIET)
    target.generate(ids, attention_mask=mask, assistant_model=close, max_new_tokens=NEW, ssd_config=quiet)
    assert hf_ssd.last_stats(target).timeline == [] and hf_ssd.last_stats(target).verify_time > 0


@pytest.mark.parametrize(("kw", "phrase"), [
    ({"streamer": tf.generation.streamers.BaseStreamer()}, "A streamer takes one sequence"),
    ({"output_hidden_states": True, "return_dict_in_generate": True}, "logits only; remove output_hidden_states"),
    ({"num_return_sequences": 2}, "num_return_sequences=1"),
])
def test_batched_refusals(pair, kw, phrase):
    target, close, _ = pair
    ids, mask = padded_batch([4, 6], 9)
    with pytest.raises(SSDUsageError, match=phrase):
        target.generate(ids, attention_mask=mask, assistant_model=close, max_new_tokens=4, ssd_config=SSDConfig(),
                        **kw)


def test_a_right_padded_batch_is_refused_before_any_work(pair):
    """transformers continues a right-padded row from its padding column's query, the row alone from its last
    token: no output equals both, so such a batch gets an error naming the fix, before the target runs."""
    target, close, _ = pair
    ids, mask = padded_batch([4, 6], 9)
    right_ids, right_mask = torch.zeros_like(ids), torch.zeros_like(mask)
    for i, n in enumerate(mask.sum(1).tolist()):
        right_ids[i, :n], right_mask[i, :n] = ids[i, ids.shape[1] - n:], 1
    calls = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(SSDUsageError, match=r"Rows \[0\] of this batch end in masked.*padding_side = 'left'"):
            target.generate(right_ids, attention_mask=right_mask, assistant_model=close, max_new_tokens=4,
                            ssd_config=SSDConfig(**QUIET))
        with pytest.raises(SSDUsageError, match="right-padded"):  # the mask inferred from the pad token (0)
            target.generate(right_ids, assistant_model=close, max_new_tokens=4, ssd_config=SSDConfig(**QUIET))
    finally:
        handle.remove()
    assert not calls


@pytest.mark.parametrize("name", ["sd_g3", "ssd_g4_b4"])
def test_a_masked_column_inside_a_prompt_is_skipped_as_transformers_skips_it(pair, name):
    target, _, noisy = pair
    for seed in range(3):
        ids, mask = padded_batch([6, 8, 7], seed)
        width = ids.shape[1]
        mask[1, width - 5] = 0  # inside row 1 (attended columns before and after it)
        mask[2, width - 2] = 0
        config, hooks = CONFIGS[name]
        out = target.generate(ids, attention_mask=mask, assistant_model=noisy, do_sample=False, max_new_tokens=NEW,
                              ssd_config=config, _ssd_hooks=hooks)
        want = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
        assert torch.equal(out, want), seed
        for i in range(3):  # and each row alone, with its mask
            alone = target.generate(ids[i : i + 1], attention_mask=mask[i : i + 1], do_sample=False,
                                    max_new_tokens=NEW)
            assert torch.equal(out[i], alone[0]), (seed, i)


@pytest.mark.parametrize("name", ["auto", "sd_g3", "ssd_g4_b4", "ssd_g2_b2_thread"])
def test_one_prompts_attentions_and_hidden_states_are_the_targets_own(name):
    """One prompt in hf_ssd's loop with output_attentions and output_hidden_states: per step, the tensors of the
    target's own greedy generate (the first step's over the whole prompt, then one query over the keys so far),
    though its verify forwards read several candidates and keep rejected ones' columns masked in the cache."""
    target = hf_ssd.enable(make_model(0, attn="eager"))  # SDPA returns no attention weights
    target.generation_config.eos_token_id = None
    config, hooks = CONFIGS[name]
    kw = {"do_sample": False, "max_new_tokens": NEW, "return_dict_in_generate": True, "output_attentions": True,
          "output_hidden_states": True}
    rejected = 0
    for seed, draft in enumerate((noisy_copy(target, 0.002), noisy_copy(target, 0.02))):
        ids = padded_batch([5 + 3 * seed], seed)[0]
        want = target.generate(ids, **kw)
        out = target.generate(ids, assistant_model=draft, ssd_config=config, _ssd_hooks=hooks, **kw)
        assert torch.equal(out.sequences, want.sequences) and out.ssd_stats.draft_path == "batched"
        rejected += out.ssd_stats.proposed_tokens - out.ssd_stats.accepted_tokens
        for name_, got, ref in (("attentions", out.attentions, want.attentions),
                                ("hidden_states", out.hidden_states, want.hidden_states)):
            assert len(got) == len(ref) == NEW, name_
            for step, (layers, ref_layers) in enumerate(zip(got, ref)):
                assert len(layers) == len(ref_layers) > 0
                for x, y in zip(layers, ref_layers):
                    assert x.shape == y.shape, (name_, step, x.shape, y.shape)
                    # Equal to float32 rounding: eager attention takes its softmax in float32, and a verify's
                    # forward reads several queries where the target's own reads one.
                    torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=f"{name_} at step {step}")
    assert name == "auto" or rejected > 0  # candidates were rejected: their masked columns were left out


def _ends_the_first_row_early(target, ids, mask, **kw) -> int:
    """An EOS token: the first row's 5th greedy token (it ends by then; the others where they meet it)."""
    return int(target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, **kw)[0, ids.shape[1] + 4])


@pytest.mark.parametrize("b", [1, 3, 8])
@pytest.mark.parametrize("name", ["sd_g3", "ssd_g4_b4", "auto", "plain"])
def test_scores_and_logits_are_the_targets_batched_ones(pair, monkeypatch, b, name):
    """return_dict_in_generate with output_scores and output_logits: at every step of every row, the processed
    scores (here a context-dependent processor, repetition_penalty) and raw logits of the target's own batched
    generate; a row that ended at EOS before the longest one gets scores certain of the pad token after its end.
    "plain": the plain batched decoding hand-off (plain.py)."""
    target, close, noisy = pair
    if name == "plain" and b == 1:
        pytest.skip("one prompt never hands off to plain decoding: its warm-up and trial keep it AR in the loop")
    if name == "plain":
        monkeypatch.setattr(loop.BatchPlan, "plain", lambda self, rows, new_tokens: True)
    config, hooks = CONFIGS["auto" if name == "plain" else name]
    hooks = {**(hooks or {}), "loop": "batch", **({"plain": True} if name == "plain" else {})}
    ids, mask = padded_batch(lengths_for(b, 7), 7)
    eos = _ends_the_first_row_early(target, ids, mask, repetition_penalty=1.3)
    kw = {"do_sample": False, "max_new_tokens": NEW, "return_dict_in_generate": True, "output_scores": True,
          "output_logits": True, "repetition_penalty": 1.3, "eos_token_id": eos}
    want = target.generate(ids, attention_mask=mask, **kw)
    ended_early = 0
    for draft in (close, noisy):
        out = target.generate(ids, attention_mask=mask, assistant_model=draft, ssd_config=config, _ssd_hooks=hooks,
                              **kw)
        assert torch.equal(out.sequences, want.sequences)
        assert out.ssd_stats.draft_path == ("plain batched" if name == "plain" else "batched")
        assert len(out.scores) == len(out.logits) == len(want.scores) > 0
        ends = [r["new_tokens"] for r in sorted(out.ssd_stats.rows, key=lambda r: r["index"])]
        assert max(ends) == len(want.scores)
        for t, (s, lg, ws, wl) in enumerate(zip(out.scores, out.logits, want.scores, want.logits)):
            assert s.shape == ws.shape == (b, 96) and s.dtype == lg.dtype == torch.float32
            for i in range(b):
                if t < ends[i]:
                    torch.testing.assert_close(s[i], ws[i], rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(lg[i], wl[i], rtol=1e-5, atol=1e-5)
                elif name != "plain":  # the loop's rows after their end (plain decoding computes them on)
                    assert torch.log_softmax(s[i], -1)[0] == 0 and int(lg[i].argmax()) == 0
        ended_early += sum(e < max(ends) for e in ends)
    assert b == 1 or ended_early > 0, ends  # the pad-certain steps were checked


@pytest.mark.parametrize("name", ["sd_g3", "ssd_g4_b4"])
def test_a_prefix_constraint_that_reads_the_row_index_holds_per_row(pair, name):
    """`prefix_allowed_tokens_fn` gets each row's index in the caller's batch (here it allows each row its own
    residue class of tokens): identical to the target's own batched generate, and every new token allowed."""
    target, close, _ = pair
    ids, mask = padded_batch(lengths_for(3, 9), 9)
    config, hooks = CONFIGS[name]
    kw = {"do_sample": False, "max_new_tokens": NEW,
          "prefix_allowed_tokens_fn": lambda batch_id, sent: [t for t in range(2, 96) if t % 3 == batch_id]}
    out = target.generate(ids, attention_mask=mask, assistant_model=close, ssd_config=config, _ssd_hooks=hooks,
                          **kw)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, **kw))
    assert all(t % 3 == i for i, row in enumerate(out[:, ids.shape[1]:].tolist()) for t in row)


class _Recording:
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        assert self.ended == 0, "put after end"
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("name", ["sd_g3", "ssd_g4_b4", "auto"])
def test_one_prompt_through_the_batch_loop_streams_exactly_the_returned_tokens(pair, name):
    """A streamer on the batch loop (one row): the prompt, then each round's new tokens (within a round too, up
    to where EOS ends the row), then one end(). (One prompt never hands off to plain decoding.)"""
    target, close, noisy = pair
    config, hooks = CONFIGS[name]
    hooks = {**(hooks or {}), "loop": "batch"}
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    eos = int(target.generate(prompt, do_sample=False, max_new_tokens=11)[0, -1])
    for draft in (close, noisy):
        streamer = _Recording()
        out = target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=NEW, eos_token_id=eos,
                              ssd_config=config, _ssd_hooks=hooks, streamer=streamer)
        assert torch.equal(out, target.generate(prompt, do_sample=False, max_new_tokens=NEW, eos_token_id=eos))
        assert streamer.puts[0] == prompt[0].tolist()
        assert [t for chunk in streamer.puts for t in chunk] == out[0].tolist()
        assert streamer.ended == 1
        assert len(streamer.puts) - 1 == hf_ssd.last_stats(target).rounds  # a round's tokens as one chunk


@pytest.mark.parametrize("b", [1, 3])
def test_sampled_scores_are_the_targets_processed_scores_of_each_kept_token(pair, b):
    """Sampling (temperature and top-k): each step's scores are the target's processed scores at that row's
    prefix (one target forward over the returned row), and the token kept is one they allow."""
    target, _, noisy = pair
    ids, mask = padded_batch(lengths_for(b, 8), 8)
    warp = tf.LogitsProcessorList([tf.TemperatureLogitsWarper(0.7), tf.TopKLogitsWarper(5)])
    torch.manual_seed(3)
    out = target.generate(ids, attention_mask=mask, assistant_model=noisy, do_sample=True, temperature=0.7, top_k=5,
                          max_new_tokens=NEW, return_dict_in_generate=True, output_scores=True,
                          ssd_config=SSDConfig(gamma=3, **QUIET), _ssd_hooks={"plain": False, "loop": "batch"})
    assert out.ssd_stats.accepted_tokens < out.ssd_stats.proposed_tokens  # rejections: residual draws too
    width = ids.shape[1]
    for i in range(b):
        row = out.sequences[i, width - int(mask[i].sum()):]
        logits = target(row[None]).logits[0].float()
        n = row.numel() - int(mask[i].sum())
        for t in range(n):
            at = row.numel() - n + t  # the kept token's index in the row
            want = warp(row[None, :at], logits[at - 1][None].clone())[0]
            torch.testing.assert_close(out.scores[t][i], want, rtol=1e-5, atol=1e-5)
            assert torch.isfinite(out.scores[t][i, row[at]])


def test_speculation_with_an_identical_draft_hits_nearly_always(pair):
    """An exact copy of the target as draft: every candidate is accepted and the predicted outcome (all
    accepted, the draft's own next token) is the real one, so nearly every lookup hits. Fails when a branch's
    draft state (positions, masks, the tokens it fed) is not the row's."""
    target, _, _ = pair
    same = noisy_copy(target, 0.0)
    ids, mask = padded_batch(lengths_for(6, 8), 8)
    for budget in (1, 3):
        config = SSDConfig(gamma=3, fanout_budget=budget, schedule="fixed", layout="inline", **QUIET)
        out = target.generate(ids, attention_mask=mask, assistant_model=same, do_sample=False, max_new_tokens=NEW,
                              ssd_config=config)
        assert torch.equal(out, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW))
        stats = hf_ssd.last_stats(target)
        assert stats.acceptance_rate == 1.0
        assert stats.cache_hits >= 0.8 * stats.lookups > 0, (stats.cache_hits, stats.lookups)


def test_the_prefill_rounds_job_pre_drafts_the_first_decoding_round(pair, monkeypatch):
    """The prompt prefill yields each row's first token; a job running behind it pre-drafts the round after, so
    that round is a hit for every row (with an identical draft, whose top token is the target's). Before, the
    first decoding round had no branch: every row drafted on the critical path. A 5-token call is the prefill and
    one 4-token round (gamma 3), so every lookup is the prefill job's; rows that end are no lookups."""
    target, _, _ = pair
    same = noisy_copy(target, 0.0)
    ids, mask = padded_batch(lengths_for(6, 9), 9)
    config = SSDConfig(gamma=3, fanout_budget=2, schedule="fixed", layout="inline", **QUIET)
    drafted_now = []
    propose = loop.BatchDrafter.propose
    monkeypatch.setattr(loop.BatchDrafter, "propose",
                        lambda self, rows, n: drafted_now.append(n) or propose(self, rows, n))
    out = target.generate(ids, attention_mask=mask, assistant_model=same, do_sample=False, max_new_tokens=5,
                          ssd_config=config)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=5))
    stats = hf_ssd.last_stats(target)
    assert (stats.cache_hits, stats.cache_misses) == (6, 0)
    assert stats.rounds == 2 and drafted_now == []  # nothing drafted on the critical path


@pytest.mark.parametrize("right", [True, False])
def test_a_missed_row_verifies_its_ngram_lookup(pair, monkeypatch, right):
    """fallback="ngram": a row without a branch proposes what the lookup returns for its own context, and the
    verify keeps exactly what the target would have generated. A lookup that knows each row's answer (`right`)
    has all its candidates kept; one that proposes wrong tokens has the round keep the target's own, exact."""
    target, _, noisy = pair
    ids, mask = padded_batch(lengths_for(5, 4), 4)
    want = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    width = ids.shape[1]
    answers = [want[i, width - int(mask[i].sum()):].tolist() for i in range(ids.shape[0])]

    def lookup(context, n, size):
        assert size == 2
        answer = next(a for a in answers if a[: len(context)] == context)
        follow = answer[len(context): len(context) + n]
        return follow if right else [(t + 1) % 96 for t in follow]

    monkeypatch.setattr(loop, "ngram_lookup", lookup)
    kept = []
    accept = loop._accept
    monkeypatch.setattr(loop, "_accept", lambda rnd, *a: kept.append(rnd) or accept(rnd, *a))
    config = SSDConfig(gamma=3, fanout_budget=1, fallback="ngram", ngram_size=2, schedule="fixed", layout="inline",
                       **QUIET)
    out = target.generate(ids, attention_mask=mask, assistant_model=noisy, do_sample=False, max_new_tokens=NEW,
                          ssd_config=config)
    assert torch.equal(out, want)
    looked = [(len(c), k) for rnd in kept for c, k, lu in zip(rnd.candidates, rnd.accepted, rnd.looked_up) if lu]
    assert looked and all(n > 0 for n, _ in looked)
    if right:
        assert all(k == n for n, k in looked)
    else:
        assert all(k == 0 for _, k in looked)
    missed = [lu for rnd in kept if rnd.option.kind == "ssd"
              for hit, lu, n in zip(rnd.hits, rnd.looked_up, rnd.limits) if not hit and n > 0]
    assert missed and all(missed)  # every miss of an SSD round with room left looked up; none drafted


def test_saguaro_scales_each_rows_held_bonuses_in_the_q_it_draws_from():
    """`BatchDrafter.draw`: row i's `cached[i]` likeliest tokens keep C of their mass, then q is renormalised; the
    token is drawn from that q. Without Saguaro (or nothing held, or greedy) q is the draft's own distribution."""
    from hf_ssd.drafting.batch import BatchDrafter

    drafter = BatchDrafter.__new__(BatchDrafter)
    drafter.do_sample, drafter.generator, drafter.saguaro_c = True, torch.Generator().manual_seed(0), 0.25
    probs = torch.softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(1)), -1)
    tokens, q = drafter.draw(probs, [0, 1, 3])
    for i, held in enumerate([0, 1, 3]):
        top = probs[i].topk(held).indices
        want = probs[i].clone()
        want[top] *= 0.25
        torch.testing.assert_close(q[i], want / want.sum())
    assert q.shape == probs.shape and tokens.shape == (3,)
    draws = torch.stack([drafter.draw(probs, [3, 3, 3])[0] for _ in range(4000)])  # drawn from q, not probs
    top = probs[2].topk(3).indices
    share = torch.isin(draws[:, 2], top).float().mean()
    want = float(q[2][top].sum())  # 3-sigma band of 4000 draws: a false fail about 3 times in 1000
    assert abs(share - want) < 3 * (want * (1 - want) / 4000) ** 0.5, (share, want, float(probs[2][top].sum()))
    for saguaro, held in ((None, [2, 2, 2]), (0.25, [0, 0, 0])):
        drafter.saguaro_c = saguaro
        assert drafter.draw(probs, held)[1] is probs


def test_a_sampled_batch_with_saguaro_draws_from_scaled_q_where_a_job_holds_bonuses(pair, monkeypatch):
    """The loop hands the drafter, on the critical path and in the job, the bonuses its SSD option holds per
    position (the geometric split of its budget; a fanout list as given); SD rounds and calls without saguaro_c
    hand none, and greedy calls draw plainly."""
    from hf_ssd.drafting.batch import BatchDrafter

    target, _, noisy = pair
    ids, mask = padded_batch(lengths_for(4, 5), 5)
    seen = []
    draw = BatchDrafter.draw
    monkeypatch.setattr(BatchDrafter, "draw", lambda self, probs, cached: seen.append(
        (self.saguaro_c, max(cached, default=0))) or draw(self, probs, cached))
    for kw, held in (({"saguaro_c": 0.5}, True), ({"saguaro_c": 0.5, "fanout": [0, 0, 0]}, False), ({}, False)):
        seen.clear()
        torch.manual_seed(0)
        config = SSDConfig(gamma=2, fanout_budget=2, schedule="fixed", layout="inline", **kw, **QUIET)
        target.generate(ids, attention_mask=mask, assistant_model=noisy, do_sample=True, max_new_tokens=8,
                        ssd_config=config)
        assert seen and any(n > 0 for _, n in seen) == held, (kw, seen)
    seen.clear()
    target.generate(ids, attention_mask=mask, assistant_model=noisy, do_sample=False, max_new_tokens=8,
                    ssd_config=SSDConfig(gamma=2, fanout_budget=2, saguaro_c=0.5, schedule="fixed", **QUIET))
    assert seen and all(s is None for s, _ in seen)


@pytest.mark.parametrize(("kw", "phrase"), [
    ({"static_draft": False}, "static_draft=False: this setting serves one prompt at a time"),
    ({"static_draft": False, "cuda_graphs": False}, "static_draft=False, cuda_graphs=False: these settings serve one"),
    ({"cuda_graphs": False}, "cuda_graphs=False: this setting serves one prompt"),
])
def test_one_prompt_settings_refused_for_batches(pair, kw, phrase):
    target, close, _ = pair
    ids, mask = padded_batch([4, 6], 9)
    with pytest.raises(SSDUsageError, match=phrase):
        target.generate(ids, attention_mask=mask, assistant_model=close, max_new_tokens=4,
                        ssd_config=SSDConfig(**kw))
    target.generate(ids[:1], assistant_model=close, max_new_tokens=4, ssd_config=SSDConfig(**kw, **QUIET))


def test_stop_strings_end_each_row_where_the_target_ends_it(pair):
    """transformers builds a `custom_generate` callable's stopping criteria without the caller's tokenizer; the
    stop strings still reach the loop, which checks each new token as the target's own loop does."""
    target, close, _ = pair
    ids, mask = padded_batch([4, 7, 5], 3)
    # An EOS id that never comes: transformers pads a row after its stop only where it has one.
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=1)
    free = target.generate(ids, **kw)
    stop = text_of([int(free[0, ids.shape[1] + NEW // 2])])  # row 0 stops half-way at the latest
    kw.update(stop_strings=[stop], tokenizer=tiny_tokenizer())
    want = target.generate(ids, **kw)
    assert int((want[0, ids.shape[1]:] == target.generation_config.pad_token_id).sum()) > 0  # row 0 did stop early
    for config, hooks in (CONFIGS["ssd_g3_b1"], CONFIGS["auto"]):
        out = target.generate(ids, assistant_model=close, ssd_config=config, _ssd_hooks=hooks, **kw)
        assert torch.equal(out, want)
    # The stop strings in a generation config passed (left as the caller gave it) rather than as an argument.
    given = tf.GenerationConfig(stop_strings=kw.pop("stop_strings"), max_new_tokens=kw.pop("max_new_tokens"),
                                do_sample=False, eos_token_id=1, pad_token_id=0)
    out = target.generate(ids, assistant_model=close, ssd_config=CONFIGS["ssd_g3_b1"][0], generation_config=given, **kw)
    assert torch.equal(out, want) and given.stop_strings == [stop]


def test_fan_out_wider_than_the_vocabulary():
    """A 6-token vocabulary has fewer top tokens than a job's late branches rank (it raised IndexError)."""
    target, draft = sampling_pair()
    ids = torch.tensor([[2, 3], [4, 5]])
    config = SSDConfig(gamma=2, fanout_budget=16, schedule="fixed", layout="inline", **QUIET)
    for do_sample in (False, True):
        out = target.generate(ids, assistant_model=draft, do_sample=do_sample, max_new_tokens=8, ssd_config=config)
        assert out.shape == (2, 10) and int(out.max()) < 6
        if not do_sample:
            assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=8))
    assert hf_ssd.last_stats(target).cache_hits > 0


def test_a_batch_that_seldom_hits_warns(pair, caplog):
    """The hit-rate warning of one prompt's calls, for a batch's lookups too; not below the threshold."""
    target, close, _ = pair
    random_draft = make_model(77, attn="sdpa")  # unrelated weights: almost every lookup misses
    ids, mask = padded_batch([4, 6], 4)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    for draft, warned in ((random_draft, True), (close, False)):
        caplog.clear()
        config = SSDConfig(gamma=3, fanout_budget=2, schedule="fixed", layout="inline", hit_rate_warning=0.6)
        with caplog.at_level(logging.WARNING, logger="hf_ssd"):
            out = target.generate(ids, assistant_model=draft, ssd_config=config, **kw)
        assert torch.equal(out, target.generate(ids, **kw))
        stats = hf_ssd.last_stats(target)
        assert stats.lookups >= 4 and (stats.hit_rate < 0.6) == warned
        assert ("hit rate" in caplog.text) == warned, caplog.text


def test_cpu_threads_set_both_sides_and_are_restored(pair):
    """cpu_threads (thread layout): the verify on the caller's thread and the job on the speculator's (which takes
    the setting in force when it starts) run with that many torch threads each; the caller's is back after."""
    target, close, _ = pair
    before = torch.get_num_threads()
    seen = []

    def record(module, args):
        seen.append((module is target, threading.current_thread().name, torch.get_num_threads()))

    handles = [m.register_forward_pre_hook(record) for m in (target, close)]
    ids, mask = padded_batch([4, 6], 2)
    config = SSDConfig(gamma=3, fanout_budget=2, schedule="fixed", layout="thread", cpu_threads=1, **QUIET)
    try:
        torch.set_num_threads(2)
        out = target.generate(ids, attention_mask=mask, assistant_model=close, do_sample=False, max_new_tokens=NEW,
                              ssd_config=config)
        assert torch.get_num_threads() == 2
    finally:
        for h in handles:
            h.remove()
        torch.set_num_threads(before)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW))
    assert {n for is_target, _, n in seen if is_target} == {1}
    assert {n for _, name, n in seen if name == "hf_ssd-speculator"} == {1}  # the job ran, at 1 thread


def no_ssd(options):
    return [o for o in options if o.kind != "ssd"]


@pytest.fixture
def compute_bound_pair():
    """A simulated device where a verify costs in proportion to its candidates (compute-bound, as these CPU
    cores at large B) and drafting is slow: AR rounds are the fastest, and the model learns it (SSD left out:
    on an off-core simulated device its drafting is hidden)."""
    target = hf_ssd.enable(make_model(0, attn="sdpa"))
    target.generation_config.eos_token_id = None
    draft = noisy_copy(target, 0.02)
    simulate_device(target, DeviceCost(base_s=0.002, per_token_s=0.01))
    simulate_device(draft, DeviceCost(base_s=0.01))
    return target, draft


def run(target, draft, b: int, seed: int, **kw):
    ids, mask = padded_batch(lengths_for(b, seed), seed)
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=NEW,
                          ssd_config=SSDConfig(**QUIET), _ssd_hooks={"options": no_ssd}, **kw)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, **kw))
    return hf_ssd.last_stats(target)


def test_plain_batched_decoding_where_drafting_cannot_pay(compute_bound_pair, monkeypatch):
    """The first call at a batch size runs the target's own batched decoding and measures its steps, the second
    the loop and its speedup over them. One call is too short for that whole-call verdict, but where the
    per-round model, from the loop's rounds, rates no option above plain's step, later calls decode plainly at
    once; the loop's next run (every PLAIN_REFRESH-th call) completes the verdict, which then keeps that size
    (and larger unmeasured sizes) plain, identical to the target."""
    monkeypatch.setattr(loop, "PLAIN_REFRESH", 2)
    target, draft = compute_bound_pair
    first = run(target, draft, 4, 0)
    assert first.draft_path == "plain batched" and first.proposed_tokens == 0  # nothing measured: plain first
    costs = [m for k, m in hf_ssd.scheduling.costs.estimates_of(target, draft) if k[2] == "batch4:thread"][0]
    second = run(target, draft, 4, 1)  # then the loop, measured against it
    assert second.draft_path == "batched" and second.proposed_tokens > 0
    assert costs.loop_speedup.count == 0 and 0 < costs.loop_pending[2] < loop.VERDICT_MIN_STEPS  # not judged yet
    paths = [run(target, draft, 4, seed).draft_path for seed in range(2, 5)]
    assert paths == ["plain batched", "plain batched", "batched"], paths  # the model's verdict, then a refresh
    assert costs.loop_speedup.count == 1 and costs.loop_speedup.value < 1.0 and costs.loop_pending == (0, 0, 0)
    # each loop call's draft prefill (and its catch-ups after AR rounds); each plain call's steps
    assert costs.draft_prefill.count >= 2 and costs.plain_step.count == 3 * (NEW - 1)
    paths = [run(target, draft, 4, seed).draft_path for seed in range(5, 8)]
    assert paths == ["plain batched", "plain batched", "batched"], paths
    bigger = run(target, draft, 8, 6)  # a new size: plain first
    assert bigger.draft_path == "plain batched" and bigger.new_tokens == 8 * NEW
    assert set(bigger.options) == {"prefill", "plain batched"} and bigger.options["plain batched"]["rounds"] == NEW - 1
    costs = [m for k, m in hf_ssd.scheduling.costs.estimates_of(target, draft) if k[2] == "batch8:thread"][0]
    assert costs.rounds_seen == 0 and costs.plain_step.count == NEW - 1  # no loop rounds at 8
    assert 0.01 < costs.plain_step.value < 0.02  # 12 ms per simulated step
    # Its second call would run the loop to measure it, but the verdict at 4 holds at 8 (more rows only make a
    # verify more compute-bound): plain again, and the loop is never measured at 8.
    assert run(target, draft, 8, 7).draft_path == "plain batched" and costs.loop_speedup.count == 0

    # Sampling: the same seed gives the target's own draws (the hand-off keeps the caller's processors and RNG).
    sample = {"do_sample": True, "temperature": 0.7, "top_k": 20}
    ids, mask = padded_batch(lengths_for(4, 6), 6)
    paths = []
    for seed in range(6):  # sampling has estimates of its own: plain, the loop until judged, then plain
        torch.manual_seed(seed)
        out = target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=NEW,
                              ssd_config=SSDConfig(**QUIET), _ssd_hooks={"options": no_ssd}, **sample)
        paths.append(hf_ssd.last_stats(target).draft_path)
        if paths[-1] == "plain batched":
            torch.manual_seed(seed)
            assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=NEW, **sample))
            if len(paths) > 1:
                break
    assert paths[0] == paths[-1] == "plain batched" and 3 <= len(paths) <= 5, paths
    assert set(paths[1:-1]) == {"batched"}, paths


def fresh_plan() -> loop.BatchPlan:
    """A batch plan over a new tiny pair: estimates of its own, as a program's first batched calls have."""
    target = hf_ssd.enable(make_model(0, attn="sdpa"))
    return loop.BatchPlan(target, noisy_copy(target, 0.02), SSDConfig(), False, "thread", {}, top_k=17)


def test_measured_rounds_slower_than_a_plain_step_condemn_the_loop_before_its_verdict():
    """Before the whole-call verdict, the loop's measured rounds decide plain when none of its drafting options
    ran faster than plain's measured step (tokens a row per second), whatever the per-round model predicts
    (it is optimistic on CPU cores); a faster measured option leaves the call to the loop, unless the draft's
    prompt prefill (measured) would eat its gain over the call's new tokens."""
    from hf_ssd.scheduling.schedule import Prediction

    plan = fresh_plan()
    costs = plan.scheduler(4).costs
    costs.add_plain_step(0.01)  # plain: 100 tokens a row per second
    costs.add_round()
    optimistic = Prediction(tokens=4.0, seconds=0.01)  # the model's view: 400 a second
    costs.add_round_outcome(Option("sd", 3), 2, 0.05, optimistic)  # measured: 40 a second
    costs.add_round_outcome(Option("ar"), 1, 0.01, optimistic)  # the loop's AR rounds: plain's step
    assert plan._condemned_early(4, 400, 64)
    costs.add_round_outcome(Option("ssd", 3, 4), 3, 0.01, optimistic)  # measured: 300 a second, in one round
    assert not plan._condemned_early(4, 400, 64)
    # One round is shrunk towards plain's rate by three rounds of its length at it: 6 tokens in 0.04 s.
    assert costs.measured_rate(Option("ssd", 3, 4)) == pytest.approx(300)
    assert costs.measured_rate(Option("ssd", 3, 4), toward=100) == pytest.approx(150)
    # 63 steps: plain 0.63 s, the loop 0.42 s at 150 a second after the draft's prefill (1.25 ms a token).
    costs.add_draft_prefill(400, 0.5)
    assert plan._condemned_early(4, 400, 64)
    assert plan._condemned_early(4, 200, 64)  # 0.25 + 0.42 s (at the one round's 300 a second: 0.46 s)
    assert not plan._condemned_early(4, 100, 64)  # 0.125 + 0.42 s: the loop wins
    assert plan._condemned_early(4, 100, 16)  # 15 steps: plain 0.15 s, the loop 0.1 s after 0.125 s


def test_an_early_plain_verdict_is_tried_again_sooner_than_a_judged_one():
    """Plain calls measure no loop rounds, so an early verdict (a few rounds slower than a plain step, e.g. on a
    busy machine) would hold until PLAIN_REFRESH; the loop runs again after EARLY_REFRESH plain calls, and a
    judged verdict (a whole loop call slower than plain) keeps plain for PLAIN_REFRESH calls."""
    from hf_ssd.scheduling.schedule import Prediction

    plan = fresh_plan()
    costs = plan.scheduler(4).costs
    costs.add_plain_step(0.01)
    costs.add_round()
    costs.add_round_outcome(Option("sd", 3), 2, 0.05, Prediction(tokens=4.0, seconds=0.01))  # 40 a second
    rows = loop._rows(torch.ones(4, 8, dtype=torch.long), None)
    early = [plan.plain(rows, 64) for _ in range(2 * (loop.EARLY_REFRESH + 1))]
    assert early == ([True] * loop.EARLY_REFRESH + [False]) * 2
    costs.add_loop_call(0.5, 1.0, 50, loop.VERDICT_MIN_STEPS)  # a whole call judged: the loop at 0.5x plain
    judged = [plain for plain in (plan.plain(rows, 64) for _ in range(loop.PLAIN_REFRESH + 1))]
    assert judged == [True] * loop.PLAIN_REFRESH + [False]


@pytest.mark.parametrize(("ar_s", "condemned"), [(None, False), (0.01, False), (0.02, False), (0.004, True)])
def test_the_loops_own_ar_rounds_stand_for_plain_decoding_where_they_ran_faster(ar_s, condemned):
    """The early verdict compares the loop's rounds with plain decoding's step, or with the loop's own AR rounds
    (the target alone over the same rows, measured in the same calls) where those ran faster: a plain call
    measured on a slowed machine must not let the loop through. AR rounds slower than plain's step change
    nothing. Here SD's rounds ran 130 tokens a row per second once shrunk towards plain's 100; AR rounds of 4 ms
    (198 a second once shrunk; SD's shrunk towards that, 204) leave SD within EARLY_MARGIN of them."""
    from hf_ssd.scheduling.schedule import Prediction

    plan = fresh_plan()
    costs = plan.scheduler(4).costs
    costs.add_plain_step(0.01)  # plain: 100 tokens a row per second
    costs.add_round()
    guess = Prediction(tokens=4.0, seconds=0.01)
    costs.add_round_outcome(Option("sd", 3), 11, 0.05, guess)  # 130 a second, shrunk towards plain's 100
    for _ in range(0 if ar_s is None else 8):  # 8 AR rounds weigh about as much as their shrinking prior
        costs.add_round_outcome(Option("ar"), 1, ar_s, guess)
    step = loop._plain_step(costs)
    assert step == pytest.approx(0.01 if ar_s is None or ar_s >= 0.01 else 1 / costs.measured_rate(
        Option("ar"), toward=100))
    assert plan._condemned_early(4, 100, 64) is condemned


@pytest.mark.parametrize("tokens, condemned", [(5.6, True), (11, False)])
def test_an_early_verdict_wants_the_loop_faster_than_plain_by_a_margin(tokens, condemned):
    """Before the whole-call verdict the loop's measured rounds must beat plain's step by EARLY_MARGIN: rounds
    measured 3% faster than plain (5.6 tokens a row in 0.05 s, shrunk to 103 a second) condemn the loop; 30%
    faster (11 tokens: 130 a second) do not."""
    from hf_ssd.scheduling.schedule import Prediction

    plan = fresh_plan()
    costs = plan.scheduler(4).costs
    costs.add_plain_step(0.01)  # plain: 100 tokens a row per second
    costs.add_round()
    costs.add_round_outcome(Option("sd", 3), tokens, 0.05, Prediction(tokens=4.0, seconds=0.01))
    assert costs.measured_rate(Option("sd", 3), toward=100) == pytest.approx((tokens + 15) / 0.2)
    assert plan._condemned_early(4, 100, 64) is condemned


@pytest.mark.parametrize(("straggle", "condemned"), [(None, False), (1.1, False), (1.3, True)])
def test_an_early_verdict_scales_the_loops_rounds_by_the_calls_straggle(straggle, condemned):
    """A call lasts until its slowest row ends, while a round's rate is a mean over its rows: the early verdict
    divides the measured rate by the straggle loop calls measured at the size (here for calls as long as this
    one's). Rounds 30% faster than plain (130 tokens a row per second once shrunk) stand at a straggle of 1.1 (118
    a second, past EARLY_MARGIN) and fall at 1.3 (100 a second)."""
    from hf_ssd.scheduling.schedule import Prediction

    plan = fresh_plan()
    costs = plan.scheduler(4).costs
    costs.add_plain_step(0.01)  # plain: 100 tokens a row per second
    costs.add_round()
    costs.add_round_outcome(Option("sd", 3), 11, 0.05, Prediction(tokens=4.0, seconds=0.01))
    if straggle is not None:
        costs.add_straggle(straggle, 63)  # measured in a call of 64 tokens, as the one judged
        assert costs.straggle_at(63) == pytest.approx(straggle)
    assert plan._condemned_early(4, 100, 64) is condemned


def test_a_calls_straggle_is_its_time_over_its_rounds_rate_for_its_longest_row():
    """Straggle: a call's time after the prefill over the time its rounds' rate (tokens a row per second, a mean
    over each round's live rows) gives its longest row. Rows of 17 and 9 tokens (16 after the prefill) whose
    rounds gave 12 tokens a row in 0.6 s (20 a second: 0.8 s for 16), in a call of 1.0 s: 1.25."""
    costs = hf_ssd.scheduling.costs.CostModel(on_gpu=False, top_k=9, initial_acceptance=0.6)
    rows = [loop.Row(index=i, ids=[], real=[], new=n) for i, n in enumerate((17, 9))]
    loop._measure_call(costs, rows, 1.0, 0.0, (12.0, 0.6))
    assert costs.straggle.count == 1 and costs.straggle_at(16) == pytest.approx(1.25)
    # Where rows gain tokens at random, the slowest lags by about sqrt(n) rounds: the excess shrinks as sqrt(n).
    assert costs.straggle_at(64) == pytest.approx(1.125) and costs.straggle_at(4) == pytest.approx(1.5)


@pytest.mark.parametrize("name", ["ar", "sd"])
def test_a_loop_call_sums_its_rounds_tokens_a_row(pair, monkeypatch, name):
    """What a loop call's straggle rests on: its decode rounds of its own size (3 or 4 rows live of 4), each
    round's tokens over its live rows, summed, and their seconds. AR rounds give every row a token a round: the
    longest row's tokens after the prefill exactly. Plain SD with a noisy draft: rows accept differently, and the
    sum is over the rounds before the batch shrank to 2 rows. (SD at one gamma: among several the scheduler's
    timed choice would make the rows' finishing rounds, and so whether 2 rows ever ran alone, vary by run.)"""
    target, _, _ = pair
    calls, rounds = [], []
    measure_call, measure = loop._measure_call, loop._measure

    def spy_call(costs, rows, seconds, explored_s, rated=(0.0, 0.0)):
        calls.append((max(r.new for r in rows) - 1, rated))
        return measure_call(costs, rows, seconds, explored_s, rated)

    def spy_round(scheduler, stats, rnd, live, tops, tokens, first, *args):
        rounds.append((tokens / len(live), len(live), first))
        return measure(scheduler, stats, rnd, live, tops, tokens, first, *args)

    monkeypatch.setattr(loop, "_measure_call", spy_call)
    monkeypatch.setattr(loop, "_measure", spy_round)
    draft = noisy_copy(target, 0.02)  # estimates of its own
    ids, mask = padded_batch([5, 9, 7, 4], 21)
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=NEW,
                          ssd_config=SSDConfig(gamma=4, **QUIET), _ssd_hooks={"plain": False, "options": lambda os: [
                              o for o in os if o == {"ar": Option("ar"), "sd": Option("sd", 4)}[name]]})
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    [(longest, (tokens, seconds))] = calls
    assert longest == NEW - 1 and seconds > 0
    assert tokens == pytest.approx(sum(t for t, live, first in rounds if live > 2 and not first))
    if name == "ar":
        assert tokens == pytest.approx(longest)
    else:
        assert any(live <= 2 for _, live, _ in rounds)  # the batch shrank: rows straggled
    assert plan_costs(target, draft, 4).straggle.count == 1


def test_what_says_nothing_steady_about_an_option_is_not_measured_as_it(pair, monkeypatch):
    """The estimates that rate an option leave out (`Round.typical`): a round whose candidates the length left
    cut (a call's last rounds), the set-up and lookups of a job that allocated its buffers (a call's first job:
    fresh memory's page faults, once) and the round that job served; and no row with one token left counts as a
    hit or a miss. Inline jobs run to their end: which rounds hit does not depend on timing."""
    target, _, _ = pair
    draft = noisy_copy(target, 0.02)  # estimates of its own
    cls = hf_ssd.scheduling.costs.CostModel
    rounds, recorded, setups, lookups = [], [], [], []
    now = {}
    measure, outcome, record, looked = loop._measure, cls.add_round_outcome, cls.add_record, cls.add_lookups

    def spy_round(scheduler, stats, rnd, live, tops, tokens, first, *args):
        now["rnd"] = rnd
        rounds.append((rnd, [len(r.ids) for r in live], [r.done for r in live]))
        return measure(scheduler, stats, rnd, live, tops, tokens, first, *args)

    def spy(log, inner, value):
        def f(self, *a):
            log.append(value(*a))
            return inner(self, *a)
        return f

    monkeypatch.setattr(loop, "_measure", spy_round)
    monkeypatch.setattr(cls, "add_round_outcome", spy(recorded, outcome, lambda *a: now["rnd"]))
    monkeypatch.setattr(cls, "add_record", spy(setups, record, lambda *a: now["rnd"]))
    monkeypatch.setattr(cls, "add_lookups", spy(lookups, looked, lambda budget, found: (now["rnd"], len(found))))
    ids, mask = padded_batch([5, 9, 7], 22)
    config = SSDConfig(gamma=3, fanout_budget=2, schedule="fixed", layout="inline", **QUIET)
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=NEW,
                          ssd_config=config, _ssd_hooks={"plain": False})
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    max_length = ids.shape[1] + NEW
    jobs = [rnd for rnd, _, _ in rounds if rnd.tree is not None]  # a job drafted for the next round
    assert jobs[0].tree.grown and not any(rnd.tree.grown for rnd in jobs[1:])
    assert setups == [rnd for rnd in jobs[1:] if rnd.tree.setup_s is not None]  # not a job without branches
    assert [rnd for rnd, _ in lookups] == jobs[1:]
    for rnd, n in lookups:  # rows that go on for two tokens at least, after the round
        _, lengths, done = next(x for x in rounds if x[0] is rnd)
        assert n == sum(not d and length + 1 < max_length for length, d in zip(lengths, done))
    assert any(n < len(rnd.candidates) for rnd, n in lookups)  # a row near its end: neither hit nor miss
    served = [rnd for rnd, _, _ in rounds if rnd.fresh_branches]
    capped = [rnd for rnd, _, _ in rounds if rnd.capped]
    assert len(served) == 1 and capped and capped[-1] is rounds[-1][0]
    for rnd in capped:  # a row got the few candidates the length left allowed
        assert any(cut and len(c) == n < 3 for cut, c, n in zip(rnd.cut, rnd.candidates, rnd.limits))
    assert recorded == [rnd for rnd, _, _ in rounds if not rnd.prefill and rnd not in served + capped]


def test_a_rounds_catch_up_is_priced_apart_not_in_its_options_rate(pair, monkeypatch):
    """The draft's read of what it lags (here one prompt's, before its first drafting round), slowed by 0.3 s: it
    goes to the draft's prefill estimate, and the round that paid it rates its option by its own work only (in
    the rate, a one-time read priced the option's later rounds as dear as itself)."""
    target, _, _ = pair
    draft = noisy_copy(target, 0.002)  # estimates of its own
    slow = 0.3
    cls, drafter_cls = hf_ssd.scheduling.costs.CostModel, hf_ssd.drafting.batch.BatchDrafter
    catch_up, outcome, measure = drafter_cls.catch_up, cls.add_round_outcome, loop._measure
    rounds, recorded = [], {}

    def slowed(self, *a):
        time.sleep(slow)
        return catch_up(self, *a)

    def spy_round(scheduler, stats, rnd, live, *a):
        rounds.append(rnd)
        return measure(scheduler, stats, rnd, live, *a)

    def spy_outcome(self, option, tokens, seconds, predicted):
        recorded[id(rounds[-1])] = seconds
        return outcome(self, option, tokens, seconds, predicted)

    monkeypatch.setattr(drafter_cls, "catch_up", slowed)
    monkeypatch.setattr(loop, "_measure", spy_round)
    monkeypatch.setattr(cls, "add_round_outcome", spy_outcome)
    ids, mask = padded_batch([12], 23)
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=NEW,
                          ssd_config=SSDConfig(gamma=3, **QUIET), _ssd_hooks=only("sd"))
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    [paid] = [rnd for rnd in rounds if rnd.catch_up_s > 0]
    assert paid.catch_up_s >= slow and id(paid) in recorded
    assert recorded[id(paid)] < slow / 2
    [costs] = [m for k, m in hf_ssd.scheduling.costs.estimates_of(target, draft) if k[2] == loop.estimates_key(1, "thread")]
    assert costs.draft_prefill.count == 1


def plan_costs(target, draft, size: int):
    """The pair's batch estimates at this size (thread layout, greedy)."""
    found = [m for k, m in hf_ssd.scheduling.costs.estimates_of(target, draft) if k[2] == f"batch{size}:thread"]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize(("best", "predicted", "rounds", "condemned"), [
    (150.0, 100.0, 1, False),  # the model's best, scaled by 0.95 (how the measured fared): 142 a second
    (120.0, 100.0, 1, True),  # 114 a second: within EARLY_OVERRULE of plain's 100
    # The model predicted 2.5 times what the measured options ran (80 a second). Shrunk alike towards plain's 100,
    # one round each fared 95 / 125: the best, 152 a second, wins; twelve rounds each, 86 / 171: 101 a second.
    (200.0, 200.0, 1, False),
    (200.0, 200.0, 12, True),
    (300.0, 100.0, 1, True),  # the model's best is plain SD at another gamma: a family measured slower
])
def test_rounds_measured_slower_are_overruled_where_the_models_best_option_clearly_wins(monkeypatch, best, predicted,
                                                                                        rounds, condemned):
    """Measured rounds slower than plain (here plain SD and the narrowest SSD, what a first call runs) condemn the
    loop early unless the option the model rates best is of a family not measured and, scaled by how the measured
    options fared against its predictions, beats plain's step by EARLY_OVERRULE (an idle accelerator's small
    batch: the wide fan-outs the first call never ran win). How they fared compares each shrunk measurement with
    its prediction shrunk alike: a round or two say little about the model either."""
    from hf_ssd.scheduling.schedule import Prediction

    plan, costs, measured = rounds_slower_than_plain()
    for o in measured:  # 95 a second once shrunk towards plain's 100 (4 tokens in 0.05 s, then 3 rounds of 0.05 s)
        assert costs.measured_rate(o, toward=100) == pytest.approx(95)
        for _ in range(rounds - 1):
            costs.add_round_outcome(o, 4, 0.05, Prediction(tokens=4.0, seconds=0.01))
    model_rates(monkeypatch, measured, Option("sd", 5) if best == 300.0 else Option("ssd", 4, 16), best, predicted)
    assert plan._condemned_early(4, 100, 64) is condemned


def rounds_slower_than_plain():
    """(plan, its 4-row costs, the options measured): plain's step measured at 10 ms (100 tokens a row per
    second), plain SD and the narrowest SSD each one round at 95 a second once shrunk towards plain's rate."""
    from hf_ssd.scheduling.schedule import Prediction

    plan = fresh_plan()
    costs = plan.scheduler(4).costs
    costs.add_plain_step(0.01)
    costs.add_round()
    measured = [Option("sd", 3), Option("ssd", 3, 1)]
    for o in measured:
        costs.add_round_outcome(o, 4, 0.05, Prediction(tokens=4.0, seconds=0.01))
    return plan, costs, measured


def model_rates(monkeypatch, measured, best_option, best: float, predicted: float) -> None:
    """The per-round model's view, fixed: `best_option` best at `best` tokens a row per second, each measured
    option at `predicted`, every other option unknown."""
    from hf_ssd.scheduling.schedule import Prediction, Scheduler

    monkeypatch.setattr(Scheduler, "best", lambda self, predictions=None: (best_option, Prediction(best, 1.0)))
    monkeypatch.setattr(Scheduler, "predict", lambda self, o, *a: Prediction(predicted, 1.0) if o in measured
                        else None)


@pytest.mark.parametrize(("overlapped_s", "condemned"), [(None, False), (0.0105, False), (0.013, True)])
def test_the_overrule_wants_a_verify_that_the_jobs_measured_left_unslowed(monkeypatch, overlapped_s, condemned):
    """The overrule trusts the model's wider fan-outs only where the hardware is idle for the job: the verify
    beside the jobs measured ran about as fast as alone (1.05x here, an accelerator). Where it ran 1.3x slower
    (CPU cores shared by both), a wider job would slow it more than the model assumes: the verdict stands."""

    plan, costs, measured = rounds_slower_than_plain()
    costs.add_verify(3, 0.01, None)  # plain SD's verify of 3 candidates
    if overlapped_s is not None:
        costs.add_verify(3, overlapped_s, 1)  # the same beside a job of one branch a row
    assert costs.interference() == (None if overlapped_s is None else pytest.approx(overlapped_s / 0.01))
    model_rates(monkeypatch, measured, Option("ssd", 4, 16), 150.0, 100.0)
    assert plan._condemned_early(4, 100, 64) is condemned


def test_a_larger_batch_keeps_the_plain_verdict_of_the_nearest_smaller_size():
    """A size whose own rounds would leave the call to the loop runs plain when the largest smaller size with a
    verdict chose plain (there an early one: its rounds condemned the loop), and refreshes that as rarely as a
    judged verdict; where the smaller size chose the loop, the size's own rounds decide."""
    from hf_ssd.scheduling.schedule import Prediction

    plan = fresh_plan()
    small, large = plan.scheduler(8).costs, plan.scheduler(16).costs
    fast = Prediction(tokens=4.0, seconds=0.01)
    for costs, tokens in ((small, 2), (large, 30)):  # 8 rows: 40 a row per second; 16 rows: 300 a second
        costs.add_plain_step(0.01)
        costs.add_round()
        costs.add_round_outcome(Option("sd", 3), tokens, 0.05 if costs is small else 0.1, fast)
    rows8 = loop._rows(torch.ones(8, 8, dtype=torch.long), None)
    rows16 = loop._rows(torch.ones(16, 8, dtype=torch.long), None)
    assert not plan._condemned_early(16, 128, 64)  # alone, 16 rows would run the loop
    assert plan.plain(rows8, 64) and small.plain_verdict is True  # 8 rows: condemned early
    calls = [plan.plain(rows16, 64) for _ in range(loop.PLAIN_REFRESH + 1)]
    assert calls == [True] * loop.PLAIN_REFRESH + [False]
    small.plain_verdict = False  # the smaller size chose the loop: the size's own rounds decide
    assert not plan.plain(rows16, 64)


@pytest.mark.parametrize(("speedup", "plain"), [(1.3, False), (0.9, True)])
def test_a_larger_batch_follows_the_smaller_sizes_measured_speedup_not_its_verdict_on_the_call(speedup, plain):
    """A smaller size's judged verdict counts for a larger size through its loop's measured speedup over plain
    decoding: a short call that the smaller size runs plain (the draft's prefill not repaid in 16 tokens) does
    not keep the larger size from measuring the loop where the smaller size's loop decodes faster; where it
    decodes slower, the larger size runs plain."""
    plan = fresh_plan()
    small, large = plan.scheduler(4).costs, plan.scheduler(8).costs
    for costs in (small, large):
        costs.add_plain_step(0.01)  # each size's first call, plain, measured
    small.add_draft_prefill(400, 0.5)  # 1.25 ms a prompt token
    small.add_loop_call(speedup * 0.5, 0.5, 50, loop.VERDICT_MIN_STEPS)  # judged: `speedup` x plain
    rows4 = loop._rows(torch.ones(4, 100, dtype=torch.long), None)
    rows8 = loop._rows(torch.ones(8, 100, dtype=torch.long), None)
    assert plan.plain(rows4, 16)  # 15 steps: 0.15 s of plain against the draft's 0.5 s prefill
    assert plan.plain(rows8, 16) is plain  # no loop rounds at 8 rows yet: the loop runs, measured


def test_plain_decoding_is_not_chosen_where_drafting_pays():
    """The opposite device: a verify costs the same at any number of candidates (memory-bound) and drafting is
    cheap, so SD beats AR: after the first call (plain decoding, measured), every call runs the loop."""
    target = hf_ssd.enable(make_model(0, attn="sdpa"))
    target.generation_config.eos_token_id = None
    draft = noisy_copy(target, 0.002)
    # Simulated times well above the tiny models' real compute on a busy machine: at 20 and 2 ms, with both cores
    # busy, the draft's steps overran theirs and later calls chose plain decoding (2 runs of 3; 0 of 4 at these).
    simulate_device(target, DeviceCost(base_s=0.05))
    simulate_device(draft, DeviceCost(base_s=0.005))
    paths = []
    for seed in range(5):
        stats = run(target, draft, 4, seed)
        paths.append(stats.draft_path)
        assert (stats.proposed_tokens > 0) == (stats.draft_path == "batched")
    assert paths == ["plain batched"] + ["batched"] * 4, paths
    costs = [m for k, m in hf_ssd.scheduling.costs.estimates_of(target, draft) if k[2] == "batch4:thread"][0]
    assert costs.loop_speedup.value > 1.5


def test_the_loops_verdict_leaves_out_explored_rounds_and_waits_for_enough_steps():
    """A loop call's speedup over plain decoding counts only its chosen rounds (the explored rounds' time, and
    their share of the output in plain's steps, are left out), and short calls add up until they hold
    VERDICT_MIN_STEPS steps."""
    costs = hf_ssd.scheduling.costs.CostModel(on_gpu=False, top_k=9, initial_acceptance=0.6)
    costs.plain_step.update(0.04)

    def row(new, explored):
        return loop.Row(index=0, ids=[], real=[], new=new, explored_new=explored)

    # 2 rows of 17 and 9 tokens: 24 after the prefill's 2, of which 6 came from explored rounds, so the chosen
    # rounds made 3/4 of plain's 16 steps (0.48 s of plain) in the 0.6 s left of 0.8 s, 0.2 s of it explored.
    loop._measure_call(costs, [row(17, 4), row(9, 2)], 0.8, 0.2)
    assert costs.loop_speedup.count == 0 and costs.loop_pending == pytest.approx((0.48, 0.6, 12))  # too few steps
    loop._measure_call(costs, [row(17, 0), row(17, 0)], 0.5, 0.0)  # 16 more steps, all chosen: judged
    assert costs.loop_speedup.count == 1 and costs.loop_pending == (0, 0, 0)
    assert costs.loop_speedup.value == pytest.approx((0.48 + 0.64) / (0.6 + 0.5))
    loop._measure_call(costs, [row(17, 16), row(17, 16)], 0.5, 0.5)  # nothing chosen: no evidence
    assert costs.loop_speedup.count == 1 and costs.loop_pending == (0, 0, 0)


def _draft_greedy(draft, context: list[int], n: int) -> tuple[list[int], list[float]]:
    """The draft's greedy continuation of `context` and the probability of each of its tokens, each from a full
    forward without a cache."""
    out, probs = list(context), []
    with torch.no_grad():
        for _ in range(n):
            p = torch.softmax(draft(input_ids=torch.tensor([out])).logits[0, -1].float(), -1)
            out.append(int(p.argmax()))
            probs.append(float(p.max()))
    return out[len(context):], probs


def _job_setup(pair, lengths, seed, gamma, do_sample=False):
    """Rows of a padded batch after the draft's prefill and a proposal of `gamma` candidates (2 rows without)."""
    from hf_ssd.drafting.batch import BatchDrafter

    target, _, noisy = pair
    ids, mask = padded_batch(lengths, seed)
    rows = loop._rows(ids, mask)
    drafter = BatchDrafter(noisy, target.config.vocab_size, do_sample, None, pad=0, top_k=17,
                           generator=torch.Generator().manual_seed(seed))
    drafter.prefill(rows)
    for r in rows:  # a first new token each, as the target's prefill yields
        r.real.append(int(r.real[-1]) % 50 + 3)
        r.ids.append(r.real[-1])
    n = [gamma if i % 3 else 0 for i in range(len(rows))]
    candidates, _ = drafter.propose(rows, n)
    for r, k in zip(rows, n):
        if not k:
            r.tops = []
    return noisy, drafter, rows, candidates


@pytest.mark.parametrize("fanout", ["geometric", "calibrated", "list"])
@pytest.mark.parametrize("seed", range(3))
def test_every_branch_holds_the_drafts_own_continuation_of_its_outcome(pair, seed, fanout):
    """A job's branch for outcome (k, bonus) must hold what the draft alone drafts after the row's tokens, its
    first k candidates and the bonus, both for branches fed their bonus in the first step and for late ones (the
    row's last outcome: its bonus ranked in the first step, fed in the second), with every fan-out. The draft's
    own rows stay as the round left them. Fails on a wrong position, mask or tag in a branch's copy. A fan-out
    list gives each row exactly its bonuses per k (its first g + 1 entries for a row of g candidates)."""
    from hf_ssd.speculation.batch import Tree, speculate
    from hf_ssd.speculation.predictor import AcceptanceCalibration

    gamma = 3
    draft, drafter, rows, candidates = _job_setup(pair, lengths_for(6, seed), seed, gamma)
    before = (drafter.kv.mask.clone(), drafter.kv.tag.clone(), [(r.draft_fed, r.draft_feed, r.tagged) for r in rows])
    tree = Tree()
    calibrated = {"calibration": AcceptanceCalibration(), "priors": [[0.3, 0.2, 0.1, 0.4][: len(c) + 1]
                                                                      if c else [1.0] for c in candidates]}
    listed = [3, 0, 2, 2]
    speculate(drafter, rows, candidates, gamma, 16, 0.6, lambda row, o: True, tree, lambda: False,
              **(calibrated if fanout == "calibrated" else {"fanout": listed} if fanout == "list" else {}))
    if fanout == "list":
        for i, c in enumerate(candidates):
            per_k = collections.Counter(b.outcome.accepted for b in tree.branches if b.row == i)
            assert per_k == collections.Counter({k: n for k, n in enumerate(listed[: len(c) + 1]) if n}), (i, c)
    assert torch.equal(drafter.kv.mask, before[0]) and torch.equal(drafter.kv.tag, before[1])
    assert [(r.draft_fed, r.draft_feed, r.tagged) for r in rows] == before[2]
    late = [b for b in tree.branches if b.rank is not None]
    assert late and len(late) < len(tree.branches)
    assert {b.row for b in late} >= {i for i, c in enumerate(candidates) if not c}  # rows without candidates
    for b in map(tree.take, range(len(tree.branches))):
        c = candidates[b.row]
        assert len(b.tokens) == gamma, (b.rank, len(b.tokens))
        context = rows[b.row].real + c[: b.outcome.accepted] + [b.outcome.bonus]
        tokens, probs = _draft_greedy(draft, context, gamma)
        assert b.tokens == tokens, (b.row, b.outcome, b.rank)
        assert [float(t[0][0]) for t in b.tops] == pytest.approx(probs, abs=1e-5), (b.row, b.outcome, b.rank)
    for i, c in enumerate(candidates):  # the late branches ranked the bonus after the row's last candidate
        ranked = [b.outcome.bonus for b in late if b.row == i]
        if ranked:
            assert ranked == rows[i].tops[len(c)][1][: len(ranked)].tolist()
            tokens, probs = _draft_greedy(draft, rows[i].real + c, 1)
            assert ranked[0] == tokens[0] and float(rows[i].tops[len(c)][0][0]) == pytest.approx(probs[0], abs=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_the_prefill_rounds_job_ranks_the_first_token_from_the_draft_prefill(pair, seed):
    """The draft's prompt prefill reads every row's whole prompt and keeps the draft's top tokens after it, from
    which the prefill round's job ranks the first token (the bonus) without a step of its own: no late branch,
    each branch of outcome (0, bonus) holding gamma tokens of the draft's own continuation of the prompt and the
    bonus. Fails if the prefill leaves a token unread, keeps the wrong tops, or a branch drafts at a wrong place."""
    from hf_ssd.drafting.batch import BatchDrafter
    from hf_ssd.speculation.batch import Tree, speculate

    target, _, draft = pair
    gamma = 3
    ids, mask = padded_batch(lengths_for(5, seed), seed)
    rows = loop._rows(ids, mask)
    drafter = BatchDrafter(draft, target.config.vocab_size, False, None, pad=0, top_k=17)
    assert drafter.prefill(rows) == sum(len(r.real) for r in rows)
    for r in rows:
        assert r.draft_fed == len(r.real) and len(r.tops) == 1
        assert int(r.tops[0][1][0]) == _draft_greedy(draft, r.real, 1)[0][0]
    tree = Tree()
    speculate(drafter, rows, [[] for _ in rows], gamma, 4, 0.6, lambda row, o: True, tree, lambda: False)
    assert tree.branches and all(b.rank is None for b in tree.branches)
    for b in map(tree.take, range(len(tree.branches))):
        assert b.outcome.accepted == 0
        assert b.tokens == _draft_greedy(draft, rows[b.row].real + [b.outcome.bonus], gamma)[0], (b.row, b.outcome)


def test_a_job_reuses_the_last_jobs_buffers_and_drafts_the_drafts_own_branches(pair):
    """Jobs copy rows into buffers kept from one job to the next (`RaggedCache.branch`): a job whose buffers hold
    another batch's copies (longer rows) must still draft the draft's own continuation of every outcome, into
    that memory, and leave the draft's rows alone. Fails if a reused buffer keeps a stale column, or if the
    buffers are allocated anew for every job."""
    from hf_ssd.speculation.batch import Tree, speculate

    gamma = 3
    spare, first = None, None
    for lengths, seed in ((lengths_for(6, 3), 3), (lengths_for(5, 7), 7)):
        draft, drafter, rows, candidates = _job_setup(pair, lengths, seed, gamma)
        drafter.spare = spare if spare is not None else drafter.spare
        mask = drafter.kv.mask.clone()
        tree = Tree()
        speculate(drafter, rows, candidates, gamma, 8, 0.6, lambda row, o: True, tree, lambda: False)
        spare = drafter.spare
        first = first or {i: tuple(t.data_ptr() for t in bufs) for i, bufs in spare.layers.items()}
    assert first and {i: tuple(t.data_ptr() for t in bufs) for i, bufs in spare.layers.items()} == first
    assert torch.equal(drafter.kv.mask, mask)
    for b in map(tree.take, range(len(tree.branches))):
        context = rows[b.row].real + candidates[b.row][: b.outcome.accepted] + [b.outcome.bonus]
        assert b.tokens == _draft_greedy(draft, context, gamma)[0], (b.row, b.outcome, b.rank)


@pytest.mark.parametrize("seed", range(3))
def test_a_jobs_copy_of_a_row_it_copied_before_takes_the_new_columns_and_equals_a_full_copy(pair, seed, monkeypatch):
    """`RaggedCache.branch` copies into a buffer row that holds the same row's earlier copy (same lineage) only
    the columns added since. Over two jobs, with an adoption and a draft forward between them, some buffer rows
    keeping their row and some changing it, and then a compaction (a new lineage), every copy must equal a full
    copy of its row, and the second job must have reused copies. Fails if a reused copy misses a column or keeps
    one of its own branch's, or if a compaction's moved columns are taken for the old ones."""
    _, drafter, rows, _ = _job_setup(pair, lengths_for(5, seed), seed, 3)
    kv, spare = drafter.kv, ragged.JobBuffers()
    gen = torch.Generator().manual_seed(seed)

    def step(cache, n):  # one token a row at its next position: what a job's step or a fallback draft appends
        ids = torch.randint(3, 50, (n, 1), generator=gen)
        cache.forward(ids, torch.ones(n, 1, dtype=torch.long), cache.mask.sum(1, keepdim=True), keep_last=1)

    def check(copies, cache, picks):
        width = cache.columns
        for mine, theirs in zip(copies.cache.layers, cache.cache.layers):
            for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                assert torch.equal(a[:, :, :width], b.index_select(0, torch.tensor(picks))), picks
        assert torch.equal(copies.mask, cache.mask.index_select(0, torch.tensor(picks)))

    n = len(rows)
    picks = [r for r in range(n) for _ in range(3)]
    first = kv.branch(picks, room=4, spare=spare)
    check(first, kv, picks)
    step(first, len(picks))  # each copy drafts its own token into its buffer row
    kv = kv.gather([(first, 3 * r + (r % 3)) for r in range(n)])  # row r adopts one of its copies
    step(kv, n)
    held = list(spare.slots)
    picks = [r for r in range(n) for _ in range(3 if r % 2 else 2)]  # odd rows keep buffer rows, later ones move
    second = kv.branch(picks, room=4, spare=spare)
    check(second, kv, picks)
    reused = [s for s, r in enumerate(picks) if held[s] is not None and held[s][0] == kv.lineage[r]]
    assert reused and len(reused) < len(picks)
    step(second, len(picks))
    monkeypatch.setattr(ragged, "COMPACT_MIN", 0)
    kv.mask[:, : kv.columns // 2] = 0  # masked columns to drop: the compaction moves the rest
    kv.maybe_compact()
    assert kv.lineage is None
    third = kv.branch(picks, room=4, spare=spare)
    check(third, kv, picks)


def test_a_jobs_copies_go_where_the_last_job_left_copies_of_their_rows(pair):
    """`RaggedCache.slot_order` puts each copy in a buffer row that holds a copy of its row from the last job, so that
    `branch` copies only the new columns. Here the first row gains a copy and the last loses one: every copy but the
    first row's new one keeps a buffer row of its own row. In the given order every later row's copies would move
    one buffer row on. Fails if the order is not a permutation, or if it ignores the buffer rows' lineages."""
    _, drafter, rows, _ = _job_setup(pair, lengths_for(5, 1), 1, 3)
    kv, spare = drafter.kv, ragged.JobBuffers()
    n = len(rows)
    kv.branch([r for r in range(n) for _ in range(3)], room=4, spare=spare)
    picks = [r for r in range(n) for _ in range(4 if r == 0 else 2 if r == n - 1 else 3)]
    order = kv.slot_order(picks, spare)
    assert sorted(order) == list(range(len(picks)))
    kept = sum(spare.slots[s][0] == kv.lineage[picks[i]] for s, i in enumerate(order))
    assert kept == len(picks) - 1
    assert sum(spare.slots[s][0] == kv.lineage[r] for s, r in enumerate(picks)) < kept


def test_a_row_gathered_twice_gives_its_second_copy_a_lineage_of_its_own(pair):
    """Rows of one lineage agree on their common columns (`RaggedCache.lineage`), which two copies of one row stop
    doing once each appends its own. `gather` taking a row twice must give the second copy a new lineage, or a job
    buffer row holding the first copy's columns would be taken for the second's. Fails if the lineage is shared."""
    _, drafter, rows, _ = _job_setup(pair, lengths_for(3, 2), 2, 3)
    kv = drafter.kv
    both = kv.gather([(kv, 0), (kv, 0), (kv, 1)])
    assert both.lineage[0] == kv.lineage[0] and both.lineage[2] == kv.lineage[1]
    assert both.lineage[1] not in kv.lineage


def test_an_adoption_is_copied_at_the_caches_next_use_with_the_rows_that_stayed(pair):
    """Rows adopting branches (`BatchDrafter.adopt`) are copied only when the draft's cache is next used; rows
    that leave before that (`select`) are not copied. The cache then holds exactly what copying at once, then
    dropping the rows, holds. Fails if a pending adoption ignores a row's leaving or is never copied."""
    from hf_ssd.speculation.batch import Tree, speculate

    _, drafter, rows, candidates = _job_setup(pair, lengths_for(6, 5), 5, 3)
    tree = Tree()
    speculate(drafter, rows, candidates, 3, 4, 0.6, lambda row, o: True, tree, lambda: False)
    taken = {b.row: i for i, b in enumerate(tree.branches)}  # a branch for every row that has one
    sources = [(tree.cache, taken[r]) if r in taken and r % 2 else (drafter.kv, r) for r in range(len(rows))]
    want = drafter.kv.gather(sources)
    want.select([0, 3, 5])
    drafter.adopt(sources)
    drafter.select([0, 3, 5])
    assert drafter._adopting is not None  # nothing copied yet
    got = drafter.kv
    assert drafter._adopting is None
    assert torch.equal(got.mask, want.mask) and torch.equal(got.tag, want.tag)
    for a, b in zip(got.cache.layers, want.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_roomy_layer_writes_in_place_and_grows_past_its_room():
    """A job copy's layer (`_RoomyLayer`) must hold exactly what a `DynamicLayer` given the same updates holds,
    writing into its buffer while there is room and concatenating past it."""
    from transformers.cache_utils import DynamicLayer

    from hf_ssd.loop.ragged import _RoomyLayer

    g = torch.Generator().manual_seed(0)
    start = torch.randn(3, 2, 4, 8, generator=g)
    buffers = [torch.zeros(3, 2, 6, 8) for _ in range(2)]
    for b in buffers:
        b[:, :, :4] = start
    roomy, plain = _RoomyLayer(*buffers, 4), DynamicLayer()
    plain.update(start, start)
    for width in (1, 1, 2):  # the last update does not fit in the room of 2
        new = torch.randn(3, 2, width, 8, generator=g)
        keys, values = roomy.update(new, -new)
        want_keys, want_values = plain.update(new, -new)
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
        assert roomy.get_seq_length() == plain.get_seq_length()
        if width == 1:
            assert keys.data_ptr() == buffers[0].data_ptr()  # written in place


@pytest.mark.parametrize("seed", range(3))
def test_a_confidence_stop_ends_each_rows_candidates_after_its_first_unsure_token(pair, seed):
    """sd(g, c) in a batch: each row's candidates are the draft's own greedy continuation, cut after the first
    token whose top probability is under c (that one kept), whatever the other rows do; a row that stopped while
    others drafted on keeps the draft's distribution after its last candidate. Fails if a row stops on another
    row's confidence, or never stops."""
    from hf_ssd.drafting.batch import BatchDrafter

    target, _, noisy = pair
    ids, mask = padded_batch(lengths_for(6, seed), seed)
    rows = loop._rows(ids, mask)
    drafter = BatchDrafter(noisy, target.config.vocab_size, False, None, pad=0, top_k=4)
    drafter.prefill(rows)
    for r in rows:  # a first new token each, as the target's prefill yields
        r.real.append(int(r.real[-1]) % 50 + 3)
        r.ids.append(r.real[-1])
    n = [6, 6, 0, 6, 3, 6]
    alone = [_draft_greedy(noisy, r.real, k) for r, k in zip(rows, n)]

    def cut(probs: list[float], k: int, stop: float) -> int:
        return next((j + 1 for j, q in enumerate(probs[:k]) if q < stop), k)

    # The threshold at which the rows' lengths differ most, midway between two of the rows' own confidences (no
    # confidence sits near it, so cached and uncached forwards' last bits cannot move a cut).
    qs = sorted({q for _, probs in alone for q in probs})
    stop = max(((a + b) / 2 for a, b in zip(qs, qs[1:])),
               key=lambda c: len({cut(p, k, c) for (_, p), k in zip(alone, n) if k}))
    lengths = [cut(p, k, stop) for (_, p), k in zip(alone, n)]
    assert len({m for m, k in zip(lengths, n) if k}) >= 2, lengths  # rows stop at different places
    candidates, _ = drafter.propose(rows, n, stop=stop)
    drafted = max(lengths)
    for i, (row, (tokens, probs), m) in enumerate(zip(rows, alone, lengths)):
        assert candidates[i] == tokens[:m], (i, candidates[i], tokens, probs, stop)
        if not n[i]:
            continue
        assert len(row.tops) == m + 1 and row.tagged == drafted - 1
        if m < drafted:  # the batch drafted past this row's stop: the next token's distribution is known
            nxt = _draft_greedy(noisy, row.real + tokens[:m], 1)[1][0]
            assert float(row.tops[m][0][0]) == pytest.approx(nxt, abs=1e-5)
        else:
            assert row.tops[m] is None


def test_a_calibrated_job_spends_a_rows_branches_where_its_draft_is_unsure():
    """fanout="calibrated" in a batch: each row's budget goes to its likeliest outcomes by the draft's confidence
    (a sure first candidate gets no branch for its rejection), where the geometric split gives every k some; a
    bonus the draft has not ranked yet (after the last candidate) keeps its share as late branches."""
    from types import SimpleNamespace

    from hf_ssd.speculation.batch import _outcomes
    from hf_ssd.speculation.predictor import AcceptanceCalibration, drafted_probs, hedged_length_probs

    def top(pairs):
        return torch.tensor([p for p, _ in pairs]), torch.tensor([t for _, t in pairs])

    cal = AcceptanceCalibration()
    for _ in range(50):  # the draft's sure tokens are kept, its unsure ones rejected
        cal.observe([0.98, 0.4], 1)
    c = [7, 8]
    tops = [top([(0.98, 7), (0.01, 3), (0.01, 4)]), top([(0.4, 8), (0.35, 5), (0.25, 6)]),
            top([(0.6, 11), (0.3, 12), (0.1, 13)])]
    pk = hedged_length_probs(cal, drafted_probs(c, tops), [1 / 3] * 3)
    calibrated, late = _outcomes(SimpleNamespace(tops=tops), c, 2, 0.6, pk)
    geometric, _ = _outcomes(SimpleNamespace(tops=tops), c, 2, 0.6, None)
    assert late == 0 and len(calibrated) == len(geometric) == 2
    assert [(o.accepted, o.bonus) for o in calibrated] == [(1, 5), (1, 6)]
    assert 0 not in {o.accepted for o in calibrated} and 0 in {o.accepted for o in geometric}
    unranked, late = _outcomes(SimpleNamespace(tops=tops[:2]), c, 3, 0.6, pk)  # nothing read after candidate 2
    assert all(o.accepted < 2 for o in unranked) and late == 3 - len(unranked)
    assert _outcomes(SimpleNamespace(tops=[]), [], 4, 0.6, [1.0]) == ([], 4)  # no candidates: all late


@pytest.mark.parametrize("known", [True, False])
def test_max_outcomes_keeps_each_rows_likeliest_outcomes_late_ones_included(known):
    """`max_outcomes` in a batch: a row's job keeps the likeliest that many of the outcomes its fan-out names,
    by P(k) P(bonus | k); where the draft has not read past the last candidate, the k = g share competes with
    the probabilities of the position before it (the late branches that share becomes). Unset, all of them."""
    from types import SimpleNamespace

    from hf_ssd.speculation.batch import _outcomes
    from hf_ssd.speculation.fanout import geometric_fanout
    from hf_ssd.speculation.outcomes import bonus_probs, length_probs

    def top(pairs):
        return torch.tensor([p for p, _ in pairs]), torch.tensor([t for _, t in pairs])

    c = [7, 8]
    tops = [top([(0.5, 7), (0.3, 3), (0.2, 4)]), top([(0.6, 8), (0.3, 5), (0.1, 6)]),
            top([(0.7, 11), (0.2, 12), (0.1, 13)])]
    row = SimpleNamespace(tops=tops if known else tops[:2])
    every, late_all = _outcomes(row, c, 6, 0.6, None)
    assert len(every) + late_all == 6
    pk = length_probs([0.6] * 2)
    after = tops[2] if known else tops[1]  # the k = g share is sized from the position before when unread
    fan = geometric_fanout(6, 0.6, 2)
    scored = sorted((pk[k] * p, k) for k in range(3)
                    for p, _ in bonus_probs(tops[k] if k < 2 else after, c[k] if k < 2 else None)[: fan[k]])[::-1]
    for limit in (1, 3, 5):
        kept, late = _outcomes(row, c, 6, 0.6, None, limit=limit)
        assert len(kept) + late == limit
        want = sorted(k for _, k in scored[:limit])
        got = sorted([o.accepted for o in kept] + [2] * late)
        assert got == want, (limit, got, want)
        assert {(o.accepted, o.bonus) for o in kept} <= {(o.accepted, o.bonus) for o in every}


@pytest.mark.parametrize("fanout", [None, "calibrated"])
def test_batched_calls_teach_the_drafts_calibration_when_calibrated(pair, monkeypatch, fanout):
    """With fanout="calibrated" set, the rounds of a batch observe P(accept | the draft's confidence) into the
    draft's calibration (shared with single-prompt calls), which the jobs' ranking reads: each row's drafted
    probabilities and its accepted count. Left unset, a batch splits per k and neither reads nor teaches it."""
    from hf_ssd.speculation.predictor import calibration_for

    target, _, noisy = pair
    cal = calibration_for(noisy, False)
    seen, read = [], []
    observe, p_accept = cal.observe, cal.p_accept
    monkeypatch.setattr(cal, "observe", lambda qs, k: (seen.append((list(qs), k)), observe(qs, k)))
    monkeypatch.setattr(cal, "p_accept", lambda q: (read.append(q), p_accept(q))[1])
    ids, mask = padded_batch([4, 6, 5], 3)
    config = SSDConfig(gamma=3, schedule="fixed", layout="inline", **QUIET, **({"fanout": fanout} if fanout else {}))
    out = target.generate(ids, attention_mask=mask, assistant_model=noisy, do_sample=False, max_new_tokens=NEW,
                          ssd_config=config)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW))
    if fanout is None:
        assert seen == [] and read == []
        return
    assert len(seen) >= 3 * 4 and read  # rows x rounds (20 tokens at most 4 a round)
    assert all(1 <= len(qs) <= 3 and 0 <= k <= len(qs) and all(0 <= q <= 1 for q in qs) for qs, k in seen)
    assert any(k < len(qs) for qs, k in seen) and any(k == len(qs) for qs, k in seen)


@pytest.mark.parametrize("seed", range(2))
def test_every_sampled_branch_keeps_the_distribution_each_token_was_drawn_from(pair, seed):
    """Sampling: a taken branch's q at each of its tokens is the draft's distribution there (what speculative
    sampling divides by), for late branches too. Fails when a branch's q belongs to another copy or step."""
    from hf_ssd.speculation.batch import Tree, speculate

    gamma = 3
    draft, drafter, rows, candidates = _job_setup(pair, lengths_for(6, seed), seed, gamma, do_sample=True)
    tree = Tree()
    speculate(drafter, rows, candidates, gamma, 8, 0.6, lambda row, o: True, tree, lambda: False)
    assert any(b.rank is not None for b in tree.branches)
    for b in map(tree.take, range(len(tree.branches))):
        context = rows[b.row].real + candidates[b.row][: b.outcome.accepted] + [b.outcome.bonus]
        assert len(b.q) == len(b.tokens) == gamma
        with torch.no_grad():
            for j, q in enumerate(b.q):
                want = torch.softmax(draft(input_ids=torch.tensor([context + b.tokens[:j]])).logits[0, -1].float(), -1)
                assert torch.allclose(q[: want.shape[0]].float(), want, atol=1e-5), (b.row, b.outcome, b.rank, j)


def test_a_job_stops_stepping_once_its_next_step_would_end_past_the_verify():
    """A deadline already passed: the job drafts its first step only (the caller would otherwise wait for the
    further steps); without a deadline it drafts all of them."""
    from hf_ssd.speculation.batch import Tree, speculate

    target = hf_ssd.enable(make_model(0, attn="sdpa"))
    pair_ = (target, None, noisy_copy(target, 0.02))
    for deadline, want in ((0.0, 1), (None, 4)):
        _, drafter, rows, candidates = _job_setup(pair_, [5, 7, 4], 1, 2)
        tree = Tree()
        speculate(drafter, rows, candidates, 4, 4, 0.6, lambda row, o: True, tree, lambda: False, deadline)
        assert len(tree.steps) == (1 if deadline is not None else 5)
        assert max(len(tree.take(i).tokens) for i in range(len(tree.branches))) == want


@pytest.mark.parametrize("worth", [2, 3])
def test_a_job_takes_a_late_step_only_where_its_grace_allows(worth):
    """Past its deadline a job starts a step only if it ends within `grace(tokens its branches hold)`: here the
    grace allows steps while the branches hold fewer than `worth` tokens, so the job stops at exactly `worth`
    steps. Fails if the job asks the grace of another step, or ignores it."""
    from hf_ssd.speculation.batch import Tree, speculate

    target = hf_ssd.enable(make_model(0, attn="sdpa"))
    _, drafter, rows, candidates = _job_setup((target, None, noisy_copy(target, 0.02)), [5, 7, 4], 1, 2)
    tree, asked = Tree(), []

    def grace(tokens):
        asked.append(tokens)
        return float("inf") if tokens < worth else float("-inf")

    speculate(drafter, rows, candidates, 4, 4, 0.6, lambda row, o: True, tree, lambda: False, 0.0, grace=grace)
    assert len(tree.steps) == worth and asked == list(range(1, worth + 1))


def test_a_batch_divides_the_job_branches_among_its_rows():
    """Per-row fan-out budgets within BATCH_BRANCHES for the whole batch: one prompt's wide ones (32, 64) at
    B = 1 and 2, 32 at B = 4, 16 per row at B = 8, 8 at B = 16; an explicit fanout_budget stays as set."""
    target = hf_ssd.enable(make_model(0, attn="sdpa"))
    draft = noisy_copy(target, 0.02)

    def budgets(config, rows):
        plan = loop.BatchPlan(target, draft, config, False, "thread", {}, top_k=17)
        return {o.budget for o in plan.scheduler(rows).options if o.kind == "ssd"}

    assert budgets(SSDConfig(), 1) == budgets(SSDConfig(), 2) == {1, 2, 4, 8, 16, 32, 64}
    assert budgets(SSDConfig(), 4) == {1, 2, 4, 8, 16, 32}
    assert budgets(SSDConfig(), 8) == {1, 2, 4, 8, 16}
    assert budgets(SSDConfig(), 16) == {1, 2, 4, 8}
    assert max(budgets(SSDConfig(), 16)) * 16 <= loop.BATCH_BRANCHES
    assert budgets(SSDConfig(fanout_budget=16), 16) == {16}
    assert budgets(SSDConfig(cache_size=8), 1) == {1, 2, 4, 8}  # a row's speculation holds cache_size entries


def test_a_shrinking_batchs_job_shares_the_batchs_branches_among_its_live_rows(pair, monkeypatch):
    """Once rows have ended, the job gives the live rows the branches the whole batch had (budget x rows at the
    call's start, divided by the live rows): the last rows decide when the call ends. The scheduler's model
    predicts their hits with those branches. An explicit fanout_budget stays as set; `cache_size` caps a row's
    share. Exact either way."""
    target, _, noisy = pair
    ids, mask = padded_batch(lengths_for(4, 11), 11)
    seen = []
    speculate = loop.speculate

    def spy(drafter, rows, candidates, gamma, budget, *args, **kwargs):
        seen.append((len(rows), budget))
        return speculate(drafter, rows, candidates, gamma, budget, *args, **kwargs)

    monkeypatch.setattr(loop, "speculate", spy)
    modelled = []  # the budgets the scheduler's model predicts hits with (the job's own prediction is uncalibrated)
    hit_rate = loop.Scheduler.hit_rate
    monkeypatch.setattr(loop.Scheduler, "hit_rate", lambda self, budget, gamma, alpha, calibrated=True: (
        modelled.append(budget) if calibrated else None) or hit_rate(self, budget, gamma, alpha, calibrated))
    want = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    hooks = {"plain": False, "options": lambda options: [o for o in options if o.name == "ssd(b=2,g=3)"]}
    for config, share in ((SSDConfig(layout="inline", **QUIET), True),
                          (SSDConfig(gamma=3, fanout_budget=2, layout="inline", **QUIET), False),
                          (SSDConfig(cache_size=3, layout="inline", **QUIET), "capped")):
        seen.clear()
        out = target.generate(ids, attention_mask=mask, assistant_model=noisy, do_sample=False, max_new_tokens=NEW,
                              ssd_config=config, _ssd_hooks=hooks)
        assert torch.equal(out, want)
        assert {live for live, _ in seen} > {4}, seen  # rows ended at different rounds
        room = 3 if share == "capped" else 8  # cache_size=3: a row's job holds at most 3 branches
        jobs = {live: min(2 * 4 // live, room) if share else 2 for live, _ in seen}
        assert share != "capped" or any(2 * 4 // live > room for live in jobs), seen  # the cap bound
        assert all(budget == jobs[live] for live, budget in seen), seen
        # The model predicts the live rows' hits with the branches their job will have.
        assert set(modelled) == ({jobs[live] for live, _ in seen if live < 4} | {2} if share else {2}), modelled
        modelled.clear()


def test_every_round_is_measured_at_its_live_rows_size(pair, monkeypatch):
    """A batch's tail rounds (fewer rows live: a cheaper verify on CPU cores, more tokens a row per second) go to
    the estimates of the live rows' own size, not the call's, whichever size decides them: counted at the call's
    size they made drafting look faster than a plain step there."""
    from hf_ssd.scheduling.costs import reset_estimates

    target, _, noisy = pair
    reset_estimates(target)
    ids, mask = padded_batch(lengths_for(4, 11), 11)
    seen = []  # per round: (live rows, the estimates its costs went to)
    measure = loop._measure
    monkeypatch.setattr(loop, "_measure", lambda scheduler, stats, rnd, live, *a: (
        seen.append((len(live), scheduler.costs)), measure(scheduler, stats, rnd, live, *a)))
    target.generate(ids, attention_mask=mask, assistant_model=noisy, do_sample=False, max_new_tokens=NEW,
                    ssd_config=SSDConfig(**QUIET), _ssd_hooks={"plain": False, **only("sd")})
    sizes = {loop._size(live) for live, _ in seen}
    assert sizes > {4}, seen  # rows ended at different rounds
    by_size = {size: {id(c) for live, c in seen if loop._size(live) == size} for size in sizes}
    assert all(len(ids) == 1 for ids in by_size.values()) and len(set().union(*by_size.values())) == len(sizes)
    for size in sizes:
        costs = next(c for live, c in seen if loop._size(live) == size)
        assert costs.rounds_seen == sum(loop._size(live) == size for live, _ in seen), size
    reset_estimates(target)


def test_a_jobs_first_step_is_not_measured_as_a_step_of_its_width(pair, monkeypatch):
    """The job's first step feeds the late branches' unread tokens (and after a change of width meets fresh
    buffers): only its later steps go to the step-time estimates (a few slow first steps had rated 16 branches
    a row 40% slower than they ran)."""
    import hf_ssd.scheduling.costs as hc

    target, _, noisy = pair
    ids, mask = padded_batch(lengths_for(4, 5), 5)
    trees, recorded = [], []
    speculate = loop.speculate

    def spy(drafter, rows, candidates, gamma, budget, alpha, allowed, tree, *args, **kwargs):
        trees.append(tree)
        return speculate(drafter, rows, candidates, gamma, budget, alpha, allowed, tree, *args, **kwargs)

    monkeypatch.setattr(loop, "speculate", spy)
    add = hc.CostModel.add_tree_step
    monkeypatch.setattr(hc.CostModel, "add_tree_step", lambda self, w, s: (recorded.append(s), add(self, w, s)))
    target.generate(ids, attention_mask=mask, assistant_model=noisy, do_sample=False, max_new_tokens=NEW,
                    ssd_config=SSDConfig(gamma=4, fanout_budget=2, schedule="fixed", layout="inline", **QUIET))
    stepped = [[s for _, s in t.steps] for t in trees if t.steps]
    assert any(len(s) > 1 for s in stepped), stepped
    assert recorded == [x for s in stepped for x in (s[1:] if len(s) > 1 else s)]


def test_a_batch_rounds_acceptance_decays_once_a_round_and_counts_the_position_after_a_kept_draft():
    """A round of 8 rows decays the acceptance counts once (per row, 8 rows left about 2.5 rounds of memory, and
    the deep positions read as the prior); `next_kept` counts the position after a wholly accepted draft."""
    from hf_ssd.scheduling.costs import CostModel

    c = CostModel(on_gpu=False, top_k=4, initial_acceptance=0.5)
    for _ in range(5):
        c.add_verified([(3, 3, None)] * 8)
    assert c.positions[1] == pytest.approx(8 * sum(0.95**r for r in range(5)))
    assert c.positions[4] == 0 and c.position_acceptance(3) > 0.95
    c.add_verified([(3, 3, True), (3, 3, False), (2, 3, True), (1, 3, None)])
    assert c.positions[4] == 2 and c.positions_accepted[4] == 1  # (2, 3, True): position 4 unknown
    assert c.positions[3] == pytest.approx(0.95 * 8 * sum(0.95**r for r in range(5)) + 3)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("do_sample", [False, True])
def test_greedy_rounds_measure_the_position_after_their_gamma(pair, rows, do_sample):
    """Greedy: a row that kept every candidate also shows whether the draft's next token would have been kept
    (the bonus is its first choice there), so the position after the running gamma is measured and a longer
    gamma can be predicted from data; one prompt (the generator) and a batch (the loop) alike. Sampling shows no
    such verdict: nothing is counted there."""
    from hf_ssd.scheduling.costs import estimates_of, reset_estimates

    target, _, _ = pair
    same = noisy_copy(target, 0.0)  # every candidate, and the draft's next token, kept
    reset_estimates(target)
    ids, mask = padded_batch(lengths_for(rows, 3), 3)
    target.generate(ids, attention_mask=mask, assistant_model=same, do_sample=do_sample, max_new_tokens=NEW,
                    ssd_config=SSDConfig(gamma=3, fanout_budget=2, schedule="fixed", layout="inline", **QUIET))
    [costs] = [c for key, c in estimates_of(target, same) if key[2] == ("batch4:inline" if rows > 1 else "inline")]
    assert costs.positions[3] > 0
    if do_sample:
        assert costs.positions[4] == 0
    else:
        assert costs.positions[4] > 2 and costs.positions_accepted[4] == pytest.approx(costs.positions[4])
    reset_estimates(target)


def test_a_batch_of_one_row_predicts_ssd_without_a_measured_draft():
    """A batch's miss may draft nothing (the row takes its one token), at one row too: a batch size that only
    tails measure, with no draft on the critical path yet, still predicts its SSD options (once such a size was
    informed it saw only AR and chose it for every last row). One prompt's generator keeps its fallback."""
    from hf_ssd.scheduling.costs import CostModel
    from hf_ssd.scheduling.schedule import Scheduler

    config = SSDConfig(**QUIET)
    options, default = loop.batch_options(config, 1, {})
    costs = CostModel(False, 17, 0.7)
    costs.add_verify(0, 0.04, None)
    costs.add_verify(4, 0.041, 16)
    costs.add_tree_step(16, 0.01)
    ssd = Option("ssd", 4, 16)
    batch = Scheduler(config, costs, options, default, inline=False, rows=1)
    assert batch.model(ssd) is not None and batch.miss_fallback(ssd) == 0
    assert Scheduler(config, costs, options, default, inline=False).model(ssd) is None  # draft(n) unknown


def test_a_shrinking_batch_decides_with_its_own_size_until_the_smaller_one_is_informed():
    """A batch's last rows run on the call's batch size's estimates until the live rows' size holds
    INFORMED_ROUNDS rounds (a size only tails measure would explore from the priors)."""
    from hf_ssd.scheduling.costs import reset_estimates

    target = hf_ssd.enable(make_model(0, attn="sdpa"))
    draft = noisy_copy(target, 0.02)
    reset_estimates(target)
    plan = loop.BatchPlan(target, draft, SSDConfig(), False, "thread", {}, top_k=17)
    call = plan.scheduler(8)
    assert plan.scheduler_for(1, 8) is call and plan.scheduler_for(7, 8) is call
    small = loop.BatchPlan(target, draft, SSDConfig(), False, "thread", {}, top_k=17).scheduler(1).costs
    small.rounds_seen = loop.INFORMED_ROUNDS  # as if earlier calls' tails had measured one row
    assert plan.scheduler_for(1, 8).costs is small
    assert plan.scheduler_for(2, 8) is call


def test_a_jobs_set_up_counts_from_the_jobs_start(pair, monkeypatch):
    """The set-up the cost model counts before a job's first step (`Tree.setup_s`, `CostModel.record`) runs on the
    job's deadline's clock: from the job's start, its measuring and deciding included (1-4 ms a round on the
    simulated device, B = 8). Counted from the outcome ranking on, the model fitted more steps into a verify than
    the deadline lets run. Here each job's deciding takes 0.1 s longer, beside a 0.3-s verify. Fails if the set-up
    leaves it out."""
    import time

    target, close, _ = pair
    ids, mask = padded_batch([5, 7], 6)
    seen = []
    decide, speculate = loop._decide, loop.speculate

    def slow_decide(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # a job's deciding
            time.sleep(0.1)
        return decide(*args, **kwargs)

    def spy(drafter, rows, candidates, *args, **kwargs):
        speculate(drafter, rows, candidates, *args, **kwargs)
        seen.append(args[4].setup_s)  # args[4]: the job's tree

    monkeypatch.setattr(loop, "_decide", slow_decide)
    monkeypatch.setattr(loop, "speculate", spy)
    simulate_device(target, DeviceCost(0.3))
    try:
        target.generate(ids, attention_mask=mask, assistant_model=close, do_sample=False, max_new_tokens=8,
                        ssd_config=SSDConfig(gamma=3, fanout_budget=2, schedule="fixed", **QUIET))
    finally:
        unsimulate(target)
    timed = [s for s in seen if s is not None]
    assert timed and all(s >= 0.1 for s in timed), seen


def test_the_prefill_rounds_job_is_timed_by_the_prefills_predicted_time(pair, monkeypatch):
    """The prefill round's job stops a step that would end past the target's prompt prefill, as a verify's job
    does: its deadline is the prefill's predicted time (`CostModel.prefill`, measured by earlier calls at this
    batch size); untimed, the caller waited for a step begun just before the prefill ended. Inline (the job runs
    before the prefill, on the critical path) there is no deadline. Fails if the prefill job goes untimed."""
    import time

    from hf_ssd.scheduling.costs import estimates_of, reset_estimates

    target, close, _ = pair
    reset_estimates(target)
    ids, mask = padded_batch([5, 7], 4)
    calls = []
    speculate = loop.speculate

    def spy(drafter, rows, candidates, *args, **kwargs):  # args[6]: the deadline
        costs = [c for key, c in estimates_of(target, close) if key[2] == "batch2:thread"]
        predicted = costs[0].prefill.predict(sum(len(r.real) for r in rows)) if costs else None
        calls.append((args[6], time.perf_counter(), predicted, any(candidates)))
        return speculate(drafter, rows, candidates, *args, **kwargs)

    monkeypatch.setattr(loop, "speculate", spy)
    firsts = []
    for layout in ("thread", "thread", "inline"):
        before = len(calls)
        target.generate(ids, attention_mask=mask, assistant_model=close, do_sample=False, max_new_tokens=6,
                        ssd_config=SSDConfig(gamma=3, fanout_budget=2, schedule="fixed", layout=layout, **QUIET))
        firsts.append(calls[before])
    assert not any(has_candidates for *_, has_candidates in firsts)  # each call's first job: the prefill's
    deadline, called, predicted, _ = firsts[1]  # the second call: the first one measured a prefill
    assert predicted is not None and deadline is not None
    # The job's start (before `speculate` is called) + the prediction; the job's deciding before it takes
    # milliseconds, longer than the tiny pair's prefill on a busy machine.
    assert -0.5 < deadline - called <= predicted
    assert firsts[2][0] is None
    reset_estimates(target)
