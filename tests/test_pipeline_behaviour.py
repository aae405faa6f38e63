"""Behaviour of the speculator inside generate: real overlap, hit rate, stats, warnings."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from conftest import make_model, noisy_copy

import hf_ssd
from hf_ssd.loop import batch as batch_loop


def test_speculator_drafts_while_target_verifies(target, draft):
    """Observe draft forwards on the speculator thread *during* the target's verify forwards.

    The target's forward pre-hook waits (up to 3 s) until a draft forward runs on the speculator thread, so
    the observation does not depend on timing: it fails only if no background draft work happens during a
    verification.
    """
    state = {"calls": 0}
    verifying = threading.Event()
    seen = threading.Event()
    overlapped = []

    def target_pre(module, args, kwargs):
        state["calls"] += 1
        if state["calls"] == 1:
            return  # prefill: nothing to verify yet, nothing speculated yet
        verifying.set()
        # The context length of the round it checks: the target's cache holds all of it but the last token.
        overlapped.append((int(kwargs["position_ids"][0, 0]) + 1, seen.wait(timeout=3)))
        seen.clear()

    def target_post(module, args, kwargs, output):
        verifying.clear()

    def draft_pre(module, args, kwargs):
        if threading.current_thread().name == "hf_ssd-speculator":
            # Hold background draft work until a verification is running, so that a fast speculator cannot
            # finish before the target starts; then record that it ran during the verification.
            if verifying.wait(timeout=3):
                seen.set()

    handles = [
        target.register_forward_pre_hook(target_pre, with_kwargs=True),
        target.register_forward_hook(target_post, with_kwargs=True),
        draft.register_forward_pre_hook(draft_pre, with_kwargs=True),
    ]
    try:
        ids = torch.tensor([[5, 6, 7, 8]])
        out = target.generate(
            ids, max_new_tokens=20, do_sample=False, eos_token_id=None, assistant_model=draft,
            ssd_config=hf_ssd.SSDConfig(gamma=3, fanout_budget=1, layout="thread", hit_rate_warning=0),
        )
    finally:
        for h in handles:
            h.remove()
    assert out.shape[1] > 4
    assert len(overlapped) >= 3
    # Every verification overlapped with draft work on the speculator thread, except near the end: an outcome
    # whose next round could not fit in the length budget is not pre-drafted (with a budget of 1 the one
    # predicted outcome may be such), and after a hit or a plain draft the trunk already holds the candidates.
    # A round of context c can need a next round for any outcome when c + gamma + 2 < max_length.
    max_length = ids.shape[1] + 20
    gamma = 3
    early = [(context, ok) for context, ok in overlapped if context + gamma + 2 < max_length]
    assert len(early) >= 3
    assert all(ok for _, ok in early), overlapped


def test_inline_layout_never_overlaps(target, draft):
    ids = torch.tensor([[5, 6, 7, 8]])
    target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft,
                    ssd_config=hf_ssd.SSDConfig(layout="inline", hit_rate_warning=0))
    stats = hf_ssd.last_stats(target)
    assert stats.overlap_time == 0.0 and stats.bubble_ratio == 1.0


def test_draft_equal_to_target_hits_almost_always():
    target = make_model(11)
    hf_ssd.enable(target)
    same = noisy_copy(target, 0.0)
    ids = torch.tensor([[3, 4, 5]])
    ref = target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
    out = target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, assistant_model=same,
                          ssd_config=hf_ssd.SSDConfig(gamma=4, fanout_budget=4, layout="inline"))
    stats = hf_ssd.last_stats(target)
    assert out.tolist() == ref.tolist()
    assert stats.acceptance_rate > 0.95
    assert stats.hit_rate >= 0.9 and stats.lookups >= 5


def test_random_draft_is_still_exact_and_warns_about_hit_rate(caplog, random_draft):
    target = make_model(12)
    hf_ssd.enable(target)
    ids = torch.tensor([[3, 4, 5]])
    ref = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
    with caplog.at_level(logging.WARNING, logger="hf_ssd"):
        out = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None,
                              assistant_model=random_draft, ssd_config=hf_ssd.SSDConfig(gamma=3, layout="inline",
                                                                                         fanout_budget=1))
    assert out.tolist() == ref.tolist()
    stats = hf_ssd.last_stats(target)
    assert stats.hit_rate < 0.6
    assert "hit rate" in caplog.text


@pytest.mark.parametrize("schedule", ["fixed", "auto"])
def test_stats_are_consistent_and_on_dict_output(target, draft, schedule):
    ids = torch.tensor([[9, 8, 7]])
    out = target.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, assistant_model=draft,
                          return_dict_in_generate=True,
                          ssd_config=hf_ssd.SSDConfig(hit_rate_warning=0, schedule=schedule))
    stats = out.ssd_stats
    assert stats is hf_ssd.last_stats(target)
    assert stats.new_tokens == out.sequences.shape[1] - 3 == 16
    # Every SSD round after the first looks the cache up, except a last one with no room for candidates (the
    # auto schedule may also run plain SD or AR rounds, which have no lookup).
    # hf_ssd's loop runs the target's prompt prefill as a round of its own ("prefill"), whose job pre-drafts the
    # first SSD round.
    ssd_rounds = sum(e["rounds"] for name, e in stats.options.items() if name.startswith("ssd"))
    prefill = stats.options.get("prefill", {}).get("rounds", 0)
    assert prefill <= 1 and sum(e["rounds"] for e in stats.options.values()) == stats.rounds
    assert ssd_rounds - 2 <= stats.lookups <= ssd_rounds - (1 if ssd_rounds == stats.rounds else 0)
    if schedule == "fixed":
        assert ssd_rounds == stats.rounds - prefill
    assert stats.new_tokens == stats.accepted_tokens + stats.rounds
    assert 0.0 <= stats.bubble_ratio <= 1.0 and stats.wall_time > 0
    assert stats.cache_misses == sum(stats.fallbacks.values())
    assert "hit rate" in stats.summary()
    d = stats.to_dict()
    assert d["hit_rate"] == stats.hit_rate and "timeline" not in d


@pytest.mark.parametrize("path", ["loop", "assisted"])
def test_config_object_identity_is_kept(target, draft, monkeypatch, path):
    """The caller's SSDConfig object itself reaches the round, on either path of one prompt."""
    config = hf_ssd.SSDConfig(hit_rate_warning=0)
    seen = []
    original, decode = target._get_candidate_generator, batch_loop.decode

    def spy(*args, **kwargs):
        gen = original(*args, **kwargs)
        seen.append(gen.config)
        return gen

    def decode_spy(*args, ssd_config, **kwargs):
        seen.append(ssd_config)
        return decode(*args, ssd_config=ssd_config, **kwargs)

    monkeypatch.setattr(batch_loop, "decode", decode_spy)
    target._get_candidate_generator = spy
    try:
        target.generate(torch.tensor([[4, 5]]), max_new_tokens=4, assistant_model=draft, ssd_config=config,
                        _ssd_hooks={"loop": "batch" if path == "loop" else "assisted"})
    finally:
        target._get_candidate_generator = original
    assert len(seen) == 1 and seen[0] is config
