"""Greedy SSD is token-identical to the target alone: property-based over prompts, gamma, fan-out, cache size,
fallback and layout, including EOS inside cached drafts."""

from __future__ import annotations

import torch
from conftest import EOS, VOCAB, make_model, noisy_copy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_ssd

_MODELS: dict = {}


def models(attn: str = "eager"):
    """Target (enabled) plus drafts of varying quality, built once per attention implementation."""
    if attn not in _MODELS:
        target = make_model(0, attn=attn)
        hf_ssd.enable(target)
        drafts = {
            "same": noisy_copy(target, 0.0),
            "close": noisy_copy(target, 0.005),
            "noisy": noisy_copy(target, 0.01),
            "random": make_model(7, attn=attn),
        }
        for d in drafts.values():
            d.config._attn_implementation = attn
        _MODELS[attn] = (target, drafts)
    return _MODELS[attn]


configs = st.builds(
    hf_ssd.SSDConfig,
    gamma=st.integers(1, 6),
    fanout=st.sampled_from(["geometric", "calibrated"]),
    fanout_budget=st.integers(0, 10),
    max_outcomes=st.integers(0, 10),
    cache_size=st.integers(1, 12),
    fallback=st.sampled_from(["sd", "short", "ar", "ngram"]),
    layout=st.sampled_from(["thread", "inline", "auto"]),
    hit_rate_warning=st.just(0.0),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs,
    draft_name=st.sampled_from(["same", "close", "noisy", "random"]),
    prompt=st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=12),
    max_new_tokens=st.integers(1, 24),
)
def test_greedy_identical_to_target(config, draft_name, prompt, max_new_tokens):
    target, drafts = models()
    ids = torch.tensor([prompt])
    ref = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    out = target.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafts[draft_name], ssd_config=config
    )
    assert out.tolist() == ref.tolist()


@settings(max_examples=40, deadline=None)
@given(
    gamma=st.integers(1, 5),
    fallback=st.sampled_from(["sd", "ar", "ngram"]),
    prompt=st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=8),
)
def test_greedy_identical_with_sdpa_and_explicit_fanout(gamma, fallback, prompt):
    target, drafts = models("sdpa")
    config = hf_ssd.SSDConfig(gamma=gamma, fanout=[2] + [1] * gamma, fallback=fallback, hit_rate_warning=0)
    ids = torch.tensor([prompt])
    ref = target.generate(ids, max_new_tokens=16, do_sample=False)
    out = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=drafts["close"], ssd_config=config)
    assert out.tolist() == ref.tolist()


def test_eos_inside_cached_draft():
    """A target whose greedy path ends on EOS: the draft equals the target, so EOS arrives inside a hit."""
    target, drafts = models()
    found = 0
    for seed in range(300):
        prompt = torch.randint(2, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))
        ref = target.generate(prompt, max_new_tokens=40, do_sample=False)
        new = ref[0, prompt.shape[1] :].tolist()
        if EOS not in new or new.index(EOS) < 6:  # EOS must come after the first (uncached) round
            continue
        found += 1
        out = target.generate(
            prompt, max_new_tokens=40, do_sample=False, assistant_model=drafts["same"],
            ssd_config=hf_ssd.SSDConfig(gamma=3, layout="inline", hit_rate_warning=0),
        )
        assert out.tolist() == ref.tolist()
        assert hf_ssd.last_stats(target).cache_hits > 0
        if found == 5:
            break
    assert found >= 3, "test needs prompts whose greedy continuation hits EOS"


def test_repetition_penalty_greedy_identical():
    target, drafts = models()
    ids = torch.tensor([[5, 9, 5, 9, 5]])
    ref = target.generate(ids, max_new_tokens=20, do_sample=False, repetition_penalty=1.5)
    out = target.generate(
        ids, max_new_tokens=20, do_sample=False, repetition_penalty=1.5, assistant_model=drafts["close"],
        ssd_config=hf_ssd.SSDConfig(gamma=3, hit_rate_warning=0),
    )
    assert out.tolist() == ref.tolist()
