"""Knobs that act and statistics that tell the truth: `fallback_gamma` selects the fallback it sizes (never a
silent no-op), eviction acts where it can (pipeline_depth > 1) and never at depth 1, a draft whose forward is
wrapped by a pass-through (`*args, **kwargs`) is driven like the model itself, and `SSDStats.wall_time`
counts what the caller waited for, a first call's set-up included."""

from __future__ import annotations

import re
import time

import pytest
import torch
from conftest import make_model, noisy_copy

import hf_ssd
import hf_ssd.integration as integration
from hf_ssd import SSDConfig, SSDConfigError
from hf_ssd.drafting.kvcache import check_draft, forward_params

PROMPT = torch.tensor([[5, 6, 7, 8]])
QUIET = {"hit_rate_warning": 0.0}


# ----- fallback_gamma -----------------------------------------------------------------------------------------------
def test_fallback_gamma_alone_selects_the_short_fallback():
    config = SSDConfig(fallback_gamma=2)
    assert config.fallback == "short" and config.is_set("fallback")
    assert SSDConfig(fallback="short", fallback_gamma=1).fallback == "short"
    assert SSDConfig().fallback == "sd" and not SSDConfig().is_set("fallback")


@pytest.mark.parametrize("fallback", ["sd", "ar", "ngram"])
def test_fallback_gamma_with_another_fallback_is_refused(fallback):
    with pytest.raises(SSDConfigError, match="fallback_gamma is the draft length of fallback='short'"):
        SSDConfig(fallback=fallback, fallback_gamma=2)
    config = SSDConfig(fallback=fallback)
    config.fallback_gamma = 2  # set later: refused when generate validates it
    with pytest.raises(SSDConfigError, match="would ignore it"):
        config.validate()


@pytest.mark.parametrize("loop", ["assisted", "batch"])
def test_fallback_gamma_changes_what_a_miss_drafts(target, random_draft, loop):
    """A random draft misses nearly every round: each miss drafts `fallback_gamma` tokens (a 1-token and a
    3-token fallback propose different numbers of tokens), and the output stays the target's; on both paths of
    one prompt (`loop`: the one-prompt path, hf_ssd's own loop), whose stats count each miss's fallback."""
    want = target.generate(PROMPT, do_sample=False, max_new_tokens=16)
    proposed = {}
    for n in (1, 3):
        config = SSDConfig(gamma=4, fallback_gamma=n, schedule="fixed", layout="inline", fanout="geometric",
                           fanout_budget=1, **QUIET)
        out = target.generate(PROMPT, assistant_model=random_draft, do_sample=False, max_new_tokens=16,
                              ssd_config=config, _ssd_hooks={"loop": loop})
        assert torch.equal(out, want)
        stats = hf_ssd.last_stats(target)
        assert stats.fallbacks.get("short", 0) == stats.cache_misses > 0
        assert stats.cost_model["rounds_seen"] >= stats.rounds - 1  # the estimates as the call left them (its last
        # round may be measured after the call)
        proposed[n] = stats.proposed_tokens / stats.rounds
    assert proposed[1] < proposed[3]


# ----- eviction ----------------------------------------------------------------------------------------------------
def test_eviction_never_acts_at_depth_one_so_lru_there_is_refused(target, draft):
    """At depth 1 a round's outcomes are capped at cache_size, so the one-prompt path's cache (the one that can
    evict) never has to: an eviction policy there would be a knob that never acts, and "lru" without
    pipeline_depth > 1 is refused (tests/test_depth.py shows eviction acting at depth 2 and 3)."""
    for size in (1, 2, 3):
        config = SSDConfig(cache_size=size, fanout_budget=8, schedule="fixed", layout="inline", **QUIET)
        target.generate(PROMPT, assistant_model=draft, do_sample=False, max_new_tokens=16, ssd_config=config,
                        _ssd_hooks={"loop": "assisted"})
        stats = hf_ssd.last_stats(target)
        assert stats.draft_path != "batched" and stats.branches_drafted > 0 and stats.evictions == 0
    with pytest.raises(SSDConfigError, match=re.escape("SSDConfig.eviction='lru' acts only with pipeline_depth > 1")):
        SSDConfig(eviction="lru")
    assert SSDConfig(eviction="lru", pipeline_depth=2).eviction == "lru"


# ----- a draft with a wrapped forward ---------------------------------------------------------------------------------
def _wrap_forward(model):
    original = model.forward

    def forward(*args, **kwargs):  # a latency shim / profiler: no functools.wraps, the signature is lost
        return original(*args, **kwargs)

    model.forward = forward
    return model


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_draft_with_a_pass_through_forward_is_accepted(target, static):
    wrapped = _wrap_forward(noisy_copy(target, 0.01))
    params = forward_params(wrapped)
    assert {"attention_mask", "position_ids"} <= params and {"cache", "past_key_values"} & params
    check_draft(wrapped)
    want = target.generate(PROMPT, do_sample=False, max_new_tokens=16)
    out = target.generate(PROMPT, assistant_model=wrapped, do_sample=False, max_new_tokens=16,
                          ssd_config=SSDConfig(static_draft=static, **QUIET))
    assert torch.equal(out, want)
    assert hf_ssd.last_stats(target).draft_path == ("static" if static else "dynamic")


# ----- what the caller waited for -----------------------------------------------------------------------------------
def test_wall_time_counts_the_first_calls_set_up(monkeypatch):
    """A first call's set-up (the draft probe: its first forwards fault in the weights) is part of what the
    caller waits for: wall_time matches the caller's clock, and the set-up is reported on its own."""
    target = hf_ssd.enable(make_model(0))
    draft = noisy_copy(target, 0.01)
    real_probe = integration.probe_draft

    def slow_probe(model):
        time.sleep(0.6)
        real_probe(model)

    monkeypatch.setattr(integration, "probe_draft", slow_probe)
    start = time.perf_counter()
    target.generate(PROMPT, assistant_model=draft, do_sample=False, max_new_tokens=8, ssd_config=SSDConfig(**QUIET))
    caller = time.perf_counter() - start
    stats = hf_ssd.last_stats(target)
    assert stats.setup_time >= 0.6
    assert caller - 0.05 <= stats.wall_time <= caller
    assert "set-up before decoding" in stats.summary()
    assert stats.tokens_per_second == pytest.approx(stats.new_tokens / stats.wall_time)
