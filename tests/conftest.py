"""Shared fixtures: tiny models built from configs (no downloads), in float64 so that verifying k tokens in one
forward and decoding them one by one give the same argmax (no near-tie flips from float32 rounding)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_ssd

VOCAB = 96
EOS = 1

# Tuning profiles off for the suite (hf_ssd/scheduling/profile.py): no test reads one from the user's cache or one an earlier
# test's `hf-ssd tune` wrote, and none is written there; tests/test_profile.py turns them on in a temporary dir.
os.environ["HF_SSD_NO_PROFILE"] = "1"

# The warm-up (SSDConfig.warmup_budget, docs/scheduling.md) keeps a short call on a new pair to the target alone,
# which would leave most of the suite's short calls testing AR only: a config built without the field learns at
# once here, so the exactness tests exercise drafting. The warm-up's own tests (test_schedule.py) set it.
_config_init = hf_ssd.SSDConfig.__init__


def _learning_at_once(self, *args, **kwargs):
    if len(args) < [f.name for f in hf_ssd.SSDConfig.__dataclass_fields__.values()].index("warmup_budget") + 1:
        kwargs.setdefault("warmup_budget", None)
    _config_init(self, *args, **kwargs)


hf_ssd.SSDConfig.__init__ = _learning_at_once

# Tiny models gain nothing from intra-op threads, and OpenMP spin-waits make them slow on a busy 2-core box.
torch.set_num_threads(1)


def tiny_config(vocab_size: int = VOCAB, layers: int = 2, hidden: int = 64, eos: int = EOS) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=eos,
        pad_token_id=0,
        initializer_range=0.2,  # peaked logits: greedy paths are well separated
    )


def make_model(seed: int = 0, attn: str = "eager", **kw) -> LlamaForCausalLM:
    """float64 tiny Llama; eager attention by default (float64 SDPA with masks is slow on CPU)."""
    torch.manual_seed(seed)
    config = tiny_config(**kw)
    config._attn_implementation = attn
    model = LlamaForCausalLM(config).double().eval()
    model.generation_config.pad_token_id = 0
    return model


def noisy_copy(model, noise: float, seed: int = 1) -> LlamaForCausalLM:
    """A draft that is the target with Gaussian noise on its weights: agreement controlled by `noise`."""
    draft = type(model)(model.config).double().eval()
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * noise)
    draft.generation_config.pad_token_id = 0
    return draft


@pytest.fixture(scope="session")
def target():
    model = make_model(0)
    hf_ssd.enable(model)
    return model


@pytest.fixture(scope="session")
def draft(target):
    return noisy_copy(target, 0.01)  # about 45% acceptance: both hits and misses happen


@pytest.fixture(scope="session")
def random_draft():
    return make_model(123)


def slow_cases(cases, slow) -> list:
    """`cases` for `pytest.mark.parametrize`, those named in `slow` marked slow: a feature's chi-square tests
    (20-45 s each) keep one or two cases in the default suite, whose time the guide holds near 15 minutes; the
    rest, whose mechanism another kept case or the batched sampling tests (tests/test_batch.py) also cover, run
    with --runslow or HF_SSD_SLOW=1. A tuple case is one value per argument name."""
    unknown = set(slow) - set(cases)
    assert not unknown, f"no such cases: {sorted(unknown)}"
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.slow) if c in slow else c
            for c in cases]


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow tests (full soak, real pair)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("HF_SSD_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or HF_SSD_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
    if not torch.cuda.is_available():
        skip_cuda = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip_cuda)
