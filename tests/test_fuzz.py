"""Property-based fuzzing (hypothesis) of SSDConfig x prompts x generation settings on the tiny models.

Properties: greedy SSD output equals the target alone; seeded sampling never crashes and returns a valid
sequence with consistent stats; arbitrary config values either build a valid config or raise SSDConfigError;
unsupported generate settings raise SSDUsageError and supported ones stay exact. No other exception type may
escape. The number of cases run is printed at the end of the module (about 60 s in all on CI; scale with
HF_SSD_FUZZ_SCALE, e.g. 10 for a longer local run).
"""

from __future__ import annotations

import collections
import logging
import math
import os

import pytest
import torch
import transformers
from conftest import EOS, VOCAB, noisy_copy
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hf_ssd import LayoutError, SSDConfig, SSDConfigError, SSDUsageError, last_stats
from hf_ssd.config import DRAFT_MATMULS, FALLBACKS, LAYOUTS, SCHEDULES, VERIFY_MATMULS

DOCUMENTED = (SSDConfigError, SSDUsageError, LayoutError)
SCALE = float(os.environ.get("HF_SSD_FUZZ_SCALE", "1"))
CASES: collections.Counter = collections.Counter()


def fuzz_settings(examples: int):
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@pytest.fixture(scope="module", autouse=True)
def report_case_counts(request):
    logging.getLogger("hf_ssd").setLevel(logging.ERROR)  # low hit rates are expected with random drafts
    yield
    logging.getLogger("hf_ssd").setLevel(logging.NOTSET)
    line = "fuzz cases run: " + ", ".join(f"{k}={v}" for k, v in sorted(CASES.items()))
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if capture is not None:
        with capture.global_and_fixture_disabled():  # shown even under output capture, as capsys.disabled()
            print(f"\n{line}")
    else:
        print(line)


class Models:
    """The target and drafts from identical to unrelated (so hits, partial hits and misses all occur), with a
    short repr for hypothesis' falsifying-example reports."""

    def __init__(self, target, random_draft):
        self.target = target
        self.drafts = {"twin": noisy_copy(target, 0.0), "close": noisy_copy(target, 0.01),
                       "noisy": noisy_copy(target, 0.05), "random": random_draft}

    def __repr__(self):
        return "Models(tiny target, drafts twin/close/noisy/random)"


@pytest.fixture(scope="module")
def models(target, random_draft):
    return Models(target, random_draft)


# ----- strategies ----------------------------------------------------------------------------------------------


@st.composite
def ssd_configs(draw) -> SSDConfig:
    gamma = draw(st.integers(1, 8))
    fallback = draw(st.sampled_from(FALLBACKS))
    static = draw(st.none() | st.booleans())
    fanout = draw(st.one_of(
        st.sampled_from(["geometric", "calibrated"]), st.lists(st.integers(0, 4), min_size=gamma + 1, max_size=gamma + 1),
    ))
    return SSDConfig(
        gamma=gamma,
        fanout=fanout,
        fanout_budget=draw(st.none() | st.integers(0, 16)),  # None: the scheduler picks budgets, SD or AR
        max_outcomes=draw(st.integers(0, 16)),
        cache_size=draw(st.integers(1, 16)),
        fallback=fallback,
        fallback_gamma=draw(st.none() | st.integers(1, gamma)) if fallback == "short" else None,  # else refused
        ngram_size=draw(st.integers(1, 4)),
        saguaro_c=draw(st.none() | st.floats(0.0, 0.99)),
        initial_acceptance=draw(st.floats(0.0, 1.0)),
        warmup_budget=draw(st.none() | st.just(0.03)),  # None: drafting from round 2 on; 0.03: a short call is AR
        layout=draw(st.sampled_from(["auto", "thread", "inline"])),
        cpu_threads=draw(st.none() | st.just(1)),
        hit_rate_warning=0.0,
        record_timeline=draw(st.booleans()),
        static_draft=static,  # on CPU: None is the dynamic path, True the static one
        schedule=draw(st.sampled_from(SCHEDULES)),
        draft_matmul=draw(st.sampled_from(DRAFT_MATMULS)),  # "transposed"/"half": the draft's products, float64 draft
        # "transposed": the target's verify on the float64 target; a static_draft setting (transformers' assisted
        # loop) refuses it
        verify_matmul=draw(st.sampled_from(VERIFY_MATMULS if static is None else ("auto", "stock"))),
    )


# The pad id 0 may appear anywhere but first: a prompt that starts with padding has a fully masked first row,
# which gives NaN logits in the target alone already (nothing SSD could be exact against).
prompts = st.tuples(st.integers(1, VOCAB - 1), st.lists(st.integers(0, VOCAB - 1), max_size=23)).map(
    lambda ids: torch.tensor([[ids[0], *ids[1]]])
)


@st.composite
def greedy_settings(draw) -> dict:
    kw = {"max_new_tokens": draw(st.integers(1, 16)), "do_sample": False}
    if draw(st.booleans()):
        kw["eos_token_id"] = draw(st.integers(2, VOCAB - 1))  # an EOS the models do emit now and then
    if draw(st.booleans()):
        kw["repetition_penalty"] = draw(st.floats(1.0, 2.0))
    if draw(st.booleans()):
        kw["no_repeat_ngram_size"] = draw(st.integers(2, 3))
    if draw(st.booleans()):
        kw["min_new_tokens"] = draw(st.integers(0, kw["max_new_tokens"]))
    return kw


@st.composite
def sampling_settings(draw) -> dict:
    kw = {"max_new_tokens": draw(st.integers(1, 16)), "do_sample": True,
          "temperature": draw(st.floats(0.3, 2.0))}
    if draw(st.booleans()):
        kw["top_k"] = draw(st.integers(1, 50))
    if draw(st.booleans()):
        kw["top_p"] = draw(st.floats(0.5, 1.0))
    if draw(st.booleans()):
        kw["eos_token_id"] = draw(st.integers(2, VOCAB - 1))
    return kw


# transformers < 5.24 (seen on 5.17): its own assisted decoding returns a prompt that ends with the EOS token
# unchanged in some cases (e.g. max_new_tokens=1), where plain generate continues it; SSD runs inside that
# loop and inherits it. Upstream quirk, not an SSD path: skip such prompts there.
_EOS_ONLY_PROMPT_QUIRK = tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24)


def _generate(target, draft, prompt, config, kw):
    if _EOS_ONLY_PROMPT_QUIRK:
        assume(int(prompt[0, -1]) != kw.get("eos_token_id", EOS))
    try:
        return target.generate(prompt, assistant_model=draft, ssd_config=config, **kw)
    except DOCUMENTED:
        CASES["generate_rejected"] += 1
        raise


# ----- properties -----------------------------------------------------------------------------------------------


@fuzz_settings(400)
@given(config=ssd_configs(), prompt=prompts, kw=greedy_settings(), which=st.sampled_from(["twin", "close", "noisy",
                                                                                          "random"]))
def test_greedy_is_exact(models, config, prompt, kw, which):
    CASES["greedy"] += 1
    target, drafts = models.target, models.drafts
    ref = target.generate(prompt, **kw)
    out = _generate(target, drafts[which], prompt, config, kw)
    assert torch.equal(out, ref), f"SSD differs from the target alone: {out.tolist()} vs {ref.tolist()}"
    stats = last_stats(target)
    assert stats.new_tokens == out.shape[1] - prompt.shape[1]
    assert stats.lookups <= max(stats.rounds - 1, 0)


@fuzz_settings(250)
@given(config=ssd_configs(), prompt=prompts, kw=sampling_settings(), seed=st.integers(0, 2**31 - 1),
       which=st.sampled_from(["twin", "close", "random"]))
def test_sampling_is_valid(models, config, prompt, kw, seed, which):
    CASES["sampling"] += 1
    target, drafts = models.target, models.drafts
    torch.manual_seed(seed)
    out = _generate(target, drafts[which], prompt, config, kw)
    n = prompt.shape[1]
    assert out.shape[0] == 1 and n < out.shape[1] <= n + kw["max_new_tokens"]
    assert torch.equal(out[:, :n], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < VOCAB
    eos = {kw.get("eos_token_id", EOS)}
    new = out[0, n:].tolist()
    assert not any(t in eos for t in new[:-1]), "generation went on after EOS"
    stats = last_stats(target)
    assert stats.new_tokens == len(new)
    assert 0.0 <= stats.hit_rate <= 1.0 and 0.0 <= stats.acceptance_rate <= 1.0
    assert stats.accepted_tokens <= stats.proposed_tokens
    if config.record_timeline:
        assert len(stats.timeline) == stats.rounds


anything = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 100), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["geometric", "lru", "probability", "sd", "ngram", "thread", "auto"]),
    st.lists(st.integers(-1, 5), max_size=10), st.lists(st.floats(-1, 5), max_size=3),
)
fraction = st.floats(0.0, 1.0)
VALID = {  # values each field accepts on its own (with the other fields at their defaults)
    "gamma": st.integers(1, 64),
    "fanout": st.sampled_from(["geometric", "calibrated"]) | st.lists(st.integers(0, 9), min_size=5, max_size=5),
    "fanout_budget": st.integers(0, 4096),
    "max_outcomes": st.integers(0, 4096),
    "cache_size": st.integers(1, 10**6),
    "fallback": st.sampled_from(FALLBACKS),
    "fallback_gamma": st.none() | st.integers(1, 4),
    "ngram_size": st.integers(1, 32),
    "saguaro_c": st.none() | st.floats(0.0, 0.999),
    "initial_acceptance": fraction,
    "warmup_budget": st.none() | st.floats(1e-6, 1.0),
    "layout": st.sampled_from(LAYOUTS),
    "cpu_threads": st.none() | st.integers(1, 1024),
    "hit_rate_warning": fraction,
    "record_timeline": st.booleans(),
    "static_draft": st.none() | st.booleans(),
    "cuda_graphs": st.none() | st.booleans(),
    "schedule": st.sampled_from(SCHEDULES),
    "draft_matmul": st.sampled_from(DRAFT_MATMULS),
    "verify_matmul": st.sampled_from(VERIFY_MATMULS),
}
assert set(VALID) == set(SSDConfig.__dataclass_fields__)


@st.composite
def config_fields(draw) -> dict:
    names = draw(st.lists(st.sampled_from(sorted(VALID)), max_size=5, unique=True))
    # Mostly valid values, so that both outcomes (built / rejected) are common.
    return {name: draw(VALID[name] if draw(st.integers(0, 3)) else anything) for name in names}


@fuzz_settings(500)
@given(fields=config_fields())
def test_config_values_build_or_raise_ssd_config_error(fields):
    CASES["config_values"] += 1
    try:
        config = SSDConfig(**fields)
    except SSDConfigError:
        CASES["config_rejected"] += 1
        return
    config.validate()  # a config that built is valid, and stays valid when checked again
    assert isinstance(config.gamma, int) and 1 <= config.gamma <= 64
    assert config.fanout in ("geometric", "calibrated") or (len(config.fanout) == config.gamma + 1
                                            and all(isinstance(f, int) and f >= 0 for f in config.fanout))
    assert 1 <= config.effective_fallback_gamma <= config.gamma
    assert config.saguaro_c is None or 0.0 <= config.saguaro_c < 1.0
    for name in ("initial_acceptance", "hit_rate_warning"):
        assert not math.isnan(getattr(config, name))
    assert config.warmup_budget is None or 0.0 < config.warmup_budget <= 1.0


@fuzz_settings(60)
@given(
    num_beams=st.sampled_from([1, 1, 1, 1, 2]),
    num_return_sequences=st.sampled_from([1, 1, 1, 1, 2]),
    penalty_alpha=st.sampled_from([None, None, None, None, 0.5]),
    prompt_lookup=st.sampled_from([None, None, None, None, 2]),
    batch=st.sampled_from([1, 1, 1, 1, 2]),
    with_draft=st.sampled_from([True, True, True, True, False]),
    prompt=prompts,
)
def test_generate_settings_are_served_or_rejected(models, num_beams, num_return_sequences, penalty_alpha,
                                                  prompt_lookup, batch, with_draft, prompt):
    CASES["usage"] += 1
    target, drafts = models.target, models.drafts
    kw = {"max_new_tokens": 6, "do_sample": num_return_sequences > 1, "num_beams": num_beams,
          "num_return_sequences": num_return_sequences}
    if penalty_alpha is not None:
        kw.update(penalty_alpha=penalty_alpha, top_k=4)
    if prompt_lookup is not None:
        kw["prompt_lookup_num_tokens"] = prompt_lookup
    if with_draft:
        kw["assistant_model"] = drafts["close"]
    # batches are served (by hf_ssd's batched loop); the other settings are refused at any batch size
    # A batch must be left-padded: rows ending in the pad token (0, the mask inferred from it) are right-padded.
    right_padded = batch > 1 and int(prompt[0, -1]) == 0
    unsupported = (num_beams > 1 or num_return_sequences > 1 or penalty_alpha is not None
                   or prompt_lookup is not None or not with_draft or right_padded)
    inputs = prompt.repeat(batch, 1)
    if unsupported:
        with pytest.raises(SSDUsageError):
            target.generate(inputs, ssd_config=SSDConfig(hit_rate_warning=0.0), **kw)
        CASES["usage_rejected"] += 1
        return
    CASES["usage_served"] += 1
    out = target.generate(inputs, ssd_config=SSDConfig(hit_rate_warning=0.0), **kw)
    kw.pop("assistant_model")
    assert torch.equal(out, target.generate(inputs, **kw))
