"""Knobs that act and statistics that tell the truth: `fallback_gamma` selects the fallback it sizes (never a
silent no-op), the one-prompt path's cache stays within cache_size, the knobs removed with pipeline depth say so, a
draft whose forward is
wrapped by a pass-through (`*args, **kwargs`) is driven like the model itself, and `SSDStats.wall_time`
counts what the caller waited for, a first call's set-up included."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import make_model, noisy_copy

import hf_ssd
import hf_ssd.integration as integration
from hf_ssd import SSDConfig, SSDConfigError
from hf_ssd.config import SSDConfigFieldError
from hf_ssd.drafting.kvcache import check_draft, forward_params
from hf_ssd.speculation.cache import SpeculationCache

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


# ----- the one-prompt path's cache, and the knobs removed with pipeline depth ---------------------------------------
def test_one_prompt_cache_stays_within_cache_size_and_its_hits_are_calibrated(target, draft, monkeypatch):
    """A round pre-drafts at most cache_size outcomes, so the one-prompt path's cache never has to drop one for
    another; its lookups are binned by predicted hit probability (`SSDStats.hit_calibration`)."""
    held = []
    put = SpeculationCache.put

    def spy(self, branch):
        ok = put(self, branch)
        held.append((self.capacity, len(self), ok))
        return ok

    monkeypatch.setattr(SpeculationCache, "put", spy)
    for size in (1, 2, 3):
        held.clear()
        config = SSDConfig(cache_size=size, fanout_budget=8, schedule="fixed", layout="inline", **QUIET)
        target.generate(PROMPT, assistant_model=draft, do_sample=False, max_new_tokens=16, ssd_config=config,
                        _ssd_hooks={"loop": "assisted"})
        stats = hf_ssd.last_stats(target)
        assert stats.draft_path != "batched" and stats.branches_drafted > 0 and held
        assert all(n <= cap == size and ok for cap, n, ok in held)
        rows = stats.hit_calibration()
        assert sum(r["lookups"] for r in rows) == stats.lookups > 0
        assert all(0.0 <= r["predicted"] <= 1.0 and 0.0 <= r["observed"] <= 1.0 for r in rows)
        assert stats.to_dict()["hit_calibration"] == rows


@pytest.mark.parametrize("name, value", [("pipeline_depth", 2), ("pipeline_depth", 1), ("eviction", "lru")])
def test_the_knobs_removed_with_pipeline_depth_say_why_and_what_to_do(name, value):
    """pipeline_depth > 1 never beat SSDConfig() (docs/performance.md): passing it or its eviction policy, at any
    value, is refused before any work with the reason and the fix, as a TypeError like any unknown keyword."""
    with pytest.raises(SSDConfigFieldError) as err:
        SSDConfig(**{name: value})
    assert isinstance(err.value, TypeError)
    message = str(err.value)
    assert message.startswith(f"SSDConfig.{name} was removed in hf_ssd 0.2.0")
    assert "0.90-0.96x" in message and "Remove the argument" in message


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


def test_a_call_that_never_drafted_shows_no_rates_it_did_not_measure(target, draft):
    """The summary's acceptance and hit rate say "n/a" where nothing was drafted or looked up (a new pair's
    warm-up runs the target alone: 0% there read as a draft that failed), and percentages once they exist."""
    config = SSDConfig(warmup_budget=0.03, **QUIET)  # the default warm-up (conftest turns it off): a new pair's
    # short call runs the target alone
    fresh = hf_ssd.enable(make_model(0))
    fresh.generate(PROMPT, assistant_model=noisy_copy(fresh, 0.01), do_sample=False, max_new_tokens=8,
                   ssd_config=config)
    stats = hf_ssd.last_stats(fresh)
    assert stats.proposed_tokens == 0 and stats.lookups == 0, stats.summary()
    assert "acceptance n/a (nothing drafted)" in stats.summary() and "hit rate n/a (no cache lookups)" in stats.summary()
    target.generate(PROMPT, assistant_model=draft, do_sample=False, max_new_tokens=16,
                    ssd_config=SSDConfig(schedule="fixed", gamma=3, **QUIET))
    stats = hf_ssd.last_stats(target)
    assert stats.proposed_tokens > 0 and stats.lookups > 0
    summary = stats.summary()
    assert f"acceptance {stats.acceptance_rate:.1%}" in summary and f"hit rate {stats.hit_rate:.1%}" in summary
    assert "n/a" not in summary
