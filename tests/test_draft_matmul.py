"""SSDConfig.draft_matmul: the draft's CPU linear layers computed as (W @ x^T)^T during a call (hf_ssd/drafting/matmul.py).

- The product equals `F.linear` (float64: to rounding) for every row count, shape and bias.
- Only the draft's own plain `nn.Linear` layers are patched, only during the call (also when it fails), never a
  layer the target shares, and "auto" picks float32 CPU layers only.
- With the patch forced on the float64 tiny pairs: greedy output identical to the target alone (several
  prompts and configs) and sampled output with the target's exact distribution (chi-square as in
  test_sampling.py: a correct implementation fails with probability < 1e-4).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_model, noisy_copy
from test_sampling import GEN, PROMPT, L, N, assert_matches_target, exact_joint, sampling_pair

import hf_ssd
from hf_ssd.drafting import matmul

QUIET = {"hit_rate_warning": 0.0}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 2), (4, 1), (1, 8), (3, 3), (1, 12)])
def test_transposed_product_equals_linear(shape, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=bias).double()
    x = torch.randn(*shape, 24, dtype=torch.float64)
    got = matmul._transposed_forward(layer, x)
    assert got.shape == (*shape, 40) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-12, atol=1e-12)


class Head(torch.nn.Linear):  # a subclass (as quantized layers are): keeps its own forward
    pass


def test_only_the_drafts_own_plain_layers_are_patched_and_only_during_the_call():
    target = make_model(0)
    draft = noisy_copy(target, 0.01)
    own = draft.lm_head
    draft.lm_head = target.lm_head  # a layer shared with the target: never patched
    custom = draft.model.layers[0].mlp.down_proj
    custom.forward = custom.forward  # an instance-level forward set by someone: put back afterwards
    before = custom.__dict__["forward"]
    with matmul.draft_matmul(draft, "transposed", target) as n:
        patched = [m for m in draft.modules() if "forward" in m.__dict__ and m is not custom]
        assert n == len(patched) + 1 > 0
        assert target.lm_head.__dict__.get("forward") is None
        with matmul.draft_matmul(draft, "transposed", target):  # a concurrent call shares the patch
            pass
        assert "forward" in draft.model.layers[0].self_attn.q_proj.__dict__
    assert custom.__dict__["forward"] == before
    assert not [m for m in draft.modules() if "forward" in m.__dict__ and m is not custom]
    draft.lm_head = own
    # "auto": float32 CPU layers only; subclasses never; "stock": nothing.
    assert not matmul.wanted("auto", torch.nn.Linear(4, 4).double())
    assert matmul.wanted("auto", torch.nn.Linear(4, 4))
    assert matmul.wanted("transposed", torch.nn.Linear(4, 4).double())
    assert not matmul.wanted("transposed", Head(4, 4))
    assert not matmul.wanted("stock", torch.nn.Linear(4, 4))


def test_auto_patches_only_where_the_transposed_product_timed_faster(monkeypatch):
    """"auto" times both products once per process on the draft's own layers (CPUs differ: on a 2-vCPU AMD EPYC
    the transposed product is 3-4x faster for 1-4 rows, on another 2x slower) and patches only if it won."""
    draft = make_model(0).float()
    monkeypatch.setattr(matmul, "TIMED_MIN_PARAMS", 0)  # time even the tiny model's layers
    timed = []
    for verdict, patched in (("linear", False), ("transposed", True)):
        matmul._verdicts.clear()
        monkeypatch.setattr(matmul, "_time_products", lambda sample, rows, v=verdict: (timed.append(sample), v)[1])
        for _ in range(2):  # the second call reuses the verdict
            with matmul.draft_matmul(draft, "auto") as n:
                assert (n > 0) is patched
                assert ("forward" in draft.model.layers[0].mlp.up_proj.__dict__) is patched
    assert len(timed) == 2 and all(isinstance(m, torch.nn.Linear) for m in timed[0])
    with matmul.draft_matmul(draft, "transposed") as n:  # forced: no timing
        assert n > 0 and len(timed) == 2


@pytest.mark.parametrize("slow", ["linear", "transposed"])
def test_the_timing_picks_the_faster_product(monkeypatch, slow):
    import time

    layers = [torch.nn.Linear(16, 32) for _ in range(3)]
    real = {"linear": F.linear, "transposed": matmul._transposed_forward}

    def slowed(name):
        def run(*args, **kwargs):
            time.sleep(0.002)
            return real[name](*args, **kwargs)
        return run

    if slow == "linear":
        monkeypatch.setattr(matmul, "F", type("F", (), {"linear": staticmethod(slowed("linear"))}))
    else:
        monkeypatch.setattr(matmul, "_transposed_forward", slowed("transposed"))
    assert matmul._time_products(layers) == ("transposed" if slow == "linear" else "linear")


def test_the_timing_leaves_the_callers_random_state_alone():
    """A seeded sampling call must draw the same numbers whether or not "auto" timed the products first."""
    layers = [torch.nn.Linear(16, 32) for _ in range(2)]  # their initialisation draws from it
    torch.manual_seed(7)
    before = torch.get_rng_state()
    matmul._time_products(layers)
    assert torch.equal(torch.get_rng_state(), before)


def test_patch_is_undone_when_generate_fails(target, draft):
    def boom():
        raise RuntimeError("speculator fault")

    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(RuntimeError, match="speculator fault"):
        target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft, _ssd_hooks={"draft": boom},
                        ssd_config=hf_ssd.SSDConfig(draft_matmul="transposed", layout="inline", schedule="fixed",
                                                    **QUIET))
    assert not [m for m in draft.modules() if "forward" in m.__dict__]


@pytest.fixture
def counted(monkeypatch):
    """Counts calls of the transposed product (so a test knows the patch really ran)."""
    calls = [0]
    inner = matmul._transposed_forward

    def counting(self, x):
        calls[0] += 1
        return inner(self, x)

    monkeypatch.setattr(matmul, "_transposed_forward", counting)
    return calls


CONFIGS = [
    dict(schedule="fixed", layout="inline", gamma=3, fanout_budget=2, fanout="geometric"),
    dict(schedule="fixed", layout="thread", gamma=4, fanout_budget=4),
    dict(),  # the default scheduler: SD, AR and SSD rounds
    dict(schedule="fixed", layout="inline", gamma=2, fanout_budget=1, fanout="geometric", fallback="short"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_greedy_identical_to_target_with_the_transposed_product(target, draft, counted, config):
    for prompt in ([5, 6, 7, 8], [11, 3, 40, 2, 9], [1, 2], [60, 61, 62, 63, 64, 65]):
        ids = torch.tensor([prompt])
        ref = target.generate(ids, max_new_tokens=24, do_sample=False)
        out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft,
                              ssd_config=hf_ssd.SSDConfig(draft_matmul="transposed", **QUIET, **config))
        assert torch.equal(out, ref), (config, prompt)
        if config.get("layout") == "inline":  # rounds that repeat exactly: the same drafts as the stock product's
            patched = hf_ssd.last_stats(target)
            target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft,
                            ssd_config=hf_ssd.SSDConfig(draft_matmul="stock", **QUIET, **config))
            stock = hf_ssd.last_stats(target)
            assert (patched.accepted_tokens, patched.cache_hits) == (stock.accepted_tokens, stock.cache_hits)
    assert counted[0] > 0


@pytest.mark.slow  # the product changes only the draft's q; the kept chi-square tests hold for any q
def test_sampling_matches_target_with_the_transposed_product(counted):
    target, draft = sampling_pair()
    joint = exact_joint(target)
    config = hf_ssd.SSDConfig(gamma=2, layout="inline", schedule="fixed", fanout_budget=2, draft_matmul="transposed",
                              **QUIET)
    torch.manual_seed(4321)
    ids = torch.tensor([PROMPT])
    samples, hits = [], 0
    for _ in range(N):
        out = target.generate(ids, max_new_tokens=L, assistant_model=draft, ssd_config=config, **GEN)
        samples.append(tuple(out[0, len(PROMPT):].tolist()))
        hits += hf_ssd.last_stats(target).cache_hits
    assert hits > 0 and counted[0] > 0
    assert_matches_target(samples, joint, "draft_matmul=transposed")
