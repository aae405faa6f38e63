"""SSDConfig.draft_matmul: the draft's CPU linear layers computed as (W @ x^T)^T during a call, and one-row steps
with float16 copies of the weights ("half"; hf_ssd/drafting/matmul.py).

- The product equals `F.linear` (float64: to rounding) for every row count, shape and bias; the float16 one is
  close to it, serves one row only, follows weight changes and falls back where float16 overflows.
- Only the draft's own plain `nn.Linear` layers are patched, only during the call (also when it fails), never a
  layer the target shares, and "auto" picks float32 CPU layers only.
- With either patch forced on the float64 tiny pairs: greedy output identical to the target alone (several
  prompts and configs) and sampled output with the target's exact distribution (chi-square as in
  test_sampling.py: a correct implementation fails with probability < 1e-4).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from conftest import make_model, noisy_copy
from test_sampling import GEN, PROMPT, L, N, assert_matches_target, exact_joint, sampling_pair
from test_verify_matmul import _batch, pair  # noqa: F401  (a fixture: SDPA, so padded batches are exact)

import hf_ssd
from hf_ssd.drafting import matmul
from hf_ssd.scheduling import profile

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


@pytest.mark.parametrize("bias", [False, True])
def test_half_product_serves_one_row_close_to_linear(bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48, bias=bias)
    one = torch.randn(1, 1, 64)
    got = matmul._draft_forward(layer, one, half=True)
    assert got.dtype == torch.float32 and got.shape == (1, 1, 48)
    torch.testing.assert_close(got, F.linear(one, layer.weight, layer.bias), rtol=2e-3, atol=2e-3)
    assert not torch.equal(got, F.linear(one, layer.weight, layer.bias))  # it really took float16 operands
    assert layer in matmul._halves
    few = torch.randn(3, 64)  # more rows: the transposed product, bit for bit
    assert torch.equal(matmul._draft_forward(layer, few, half=True), matmul._transposed_forward(layer, few))
    assert torch.equal(matmul._draft_forward(layer, few, half=True, transposed=False),
                       F.linear(few, layer.weight, layer.bias))
    with torch.no_grad():  # a weight changed in place: the copy follows it
        layer.weight.mul_(-1)
    torch.testing.assert_close(matmul._draft_forward(layer, one, half=True), F.linear(one, layer.weight, layer.bias),
                               rtol=2e-3, atol=2e-3)


def test_half_product_overflow_falls_back_to_the_layers_own_dtype():
    layer = torch.nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1000.0)
    x = torch.full((1, 64), 10.0)  # each output 640000: above float16's 65504
    got = matmul._draft_forward(layer, x, half=True, transposed=False)
    assert torch.isfinite(got).all() and torch.equal(got, F.linear(x, layer.weight))


def test_auto_times_the_float16_copies_without_deadlock(monkeypatch):
    """The real timing, float16 copies included, runs while the patch registry's lock is held (a copy's clock once
    took that lock too and hung the first call on the real pair)."""
    import threading

    draft = make_model(0).float()
    monkeypatch.setattr(matmul, "TIMED_MIN_PARAMS", 0)
    matmul._verdicts.clear()
    matmul._halves.clear()
    done = []

    def call():
        with matmul.draft_matmul(draft, "auto"):
            done.append(True)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert done, "draft_matmul('auto') hung while timing the float16 copies"
    assert any(key.endswith("/half") for key in matmul._verdicts)  # the float16 copies were really timed
    matmul._verdicts.clear()


def test_the_float16_copies_time_is_not_the_drafts_step(monkeypatch):
    """A layer's float16 copy is made at its first one-row step, inside a round: the loop takes the copying out of
    the round's measured draft time (`matmul.setup_seconds`), from which the scheduler prices drafting."""
    target = hf_ssd.enable(make_model(0).float())
    draft = noisy_copy(target, 0.01)
    inner = matmul._half_weight

    def slow_copy(layer):  # each copy takes 0.1 s more (the real 0.5B draft's take about 0.3 s in all)
        if layer not in matmul._halves:
            start = time.perf_counter()
            time.sleep(0.1)
            matmul.count_setup(time.perf_counter() - start)
        return inner(layer)

    monkeypatch.setattr(matmul, "_half_weight", slow_copy)
    matmul._halves.clear()
    layers = sum(type(m) is torch.nn.Linear for m in draft.modules())
    before = matmul.setup_seconds()
    target.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=16, do_sample=False, assistant_model=draft,
                    ssd_config=hf_ssd.SSDConfig(draft_matmul="half", **QUIET),
                    _ssd_hooks={"options": lambda options: [o for o in options if o.name == "sd(g=3)"]})
    stats = hf_ssd.last_stats(target)
    assert matmul.setup_seconds() - before >= 0.1 * layers  # every layer was copied in this call ...
    assert stats.proposed_tokens > 0 and stats.fallback_draft_time < 0.05 * layers  # ... outside the draft's time


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
        monkeypatch.setattr(matmul, "_time_products",  # float16 copies timed slower: the transposed verdict decides
                            lambda sample, rows, half=False, v=verdict: (timed.append(sample), v)[1] if not half
                            else "linear")
        for _ in range(2):  # the second call reuses the verdict
            with matmul.draft_matmul(draft, "auto") as n:
                assert (n > 0) is patched
                assert ("forward" in draft.model.layers[0].mlp.up_proj.__dict__) is patched
    assert len(timed) == 2 and all(isinstance(m, torch.nn.Linear) for m in timed[0])
    with matmul.draft_matmul(draft, "transposed") as n:  # forced: no timing
        assert n > 0 and len(timed) == 2


@pytest.mark.parametrize("verdicts", [("half", "transposed"), ("half", "linear"), ("linear", "transposed"),
                                      ("transposed", "linear")])
def test_auto_takes_float16_for_one_row_only_where_it_timed_fastest(monkeypatch, verdicts):
    """"auto" also times float16 copies against both float32 products at one row; where they won, one-row draft
    forwards take them and wider ones the transposed product as its own timing says."""
    one_row, few_rows = verdicts
    draft = make_model(0).float()
    monkeypatch.setattr(matmul, "TIMED_MIN_PARAMS", 0)
    matmul._verdicts.clear()
    monkeypatch.setattr(matmul, "_time_products",
                        lambda sample, rows=None, half=False: one_row if half else few_rows)
    calls = {"half": 0, "transposed": 0}
    for name in calls:
        inner = getattr(matmul, f"_{name}_product" if name == "half" else "_transposed_forward")
        monkeypatch.setattr(matmul, f"_{name}_product" if name == "half" else "_transposed_forward",
                            lambda *a, _inner=inner, _name=name: (calls.__setitem__(_name, calls[_name] + 1),
                                                                   _inner(*a))[1])
    matmul._halves.clear()
    layers = [m for m in draft.modules() if type(m) is torch.nn.Linear]
    with matmul.draft_matmul(draft, "auto") as n, torch.no_grad():
        assert (n > 0) is (one_row == "half" or few_rows == "transposed")
        draft(torch.tensor([[3, 4, 5]]))  # a three-token forward, then a one-token one
        wide = dict(calls)
        assert not any(m in matmul._halves for m in layers)  # copies only at a one-row product: none yet
        draft(torch.tensor([[6]]))
        assert all(m in matmul._halves for m in layers) is (one_row == "half")
    assert (wide["transposed"] > 0) is (few_rows == "transposed") and wide["half"] == 0
    assert (calls["half"] > 0) is (one_row == "half")
    assert (calls["transposed"] > wide["transposed"]) is (one_row != "half" and few_rows == "transposed")
    matmul._verdicts.clear()


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
    """Counts calls of the transposed and float16 products (so a test knows the patch really ran)."""
    calls = {"transposed": 0, "half": 0}
    for mode, name in (("transposed", "_transposed_forward"), ("half", "_half_product")):
        inner = getattr(matmul, name)

        def counting(self, x, _inner=inner, _mode=mode):
            calls[_mode] += 1
            return _inner(self, x)

        monkeypatch.setattr(matmul, name, counting)
    return calls


CONFIGS = [
    dict(schedule="fixed", layout="inline", gamma=3, fanout_budget=2, fanout="geometric"),
    dict(schedule="fixed", layout="thread", gamma=4, fanout_budget=4),
    dict(),  # the default scheduler: SD, AR and SSD rounds
    dict(schedule="fixed", layout="inline", gamma=2, fanout_budget=1, fanout="geometric", fallback="short"),
]


@pytest.mark.parametrize("mode", ["transposed", "half"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_greedy_identical_to_target_with_the_drafts_products(target, draft, counted, config, mode):
    for prompt in ([5, 6, 7, 8], [11, 3, 40, 2, 9], [1, 2], [60, 61, 62, 63, 64, 65]):
        ids = torch.tensor([prompt])
        ref = target.generate(ids, max_new_tokens=24, do_sample=False)
        out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft,
                              ssd_config=hf_ssd.SSDConfig(draft_matmul=mode, **QUIET, **config))
        assert torch.equal(out, ref), (config, prompt)
        if config.get("layout") == "inline" and mode == "transposed":  # rounds that repeat exactly: the same drafts
            # as the stock product's (float16 operands may round a near tie of the draft's the other way)
            patched = hf_ssd.last_stats(target)
            target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft,
                            ssd_config=hf_ssd.SSDConfig(draft_matmul="stock", **QUIET, **config))
            stock = hf_ssd.last_stats(target)
            assert (patched.accepted_tokens, patched.cache_hits) == (stock.accepted_tokens, stock.cache_hits)
    if config:  # the default scheduler may keep the target alone in these short calls: nothing to count there
        assert counted[mode] > 0


@pytest.mark.slow  # the product changes only the draft's q; the kept chi-square tests hold for any q
@pytest.mark.parametrize("mode", ["transposed", "half"])
def test_sampling_matches_target_with_the_drafts_products(counted, mode):
    target, draft = sampling_pair()
    joint = exact_joint(target)
    config = hf_ssd.SSDConfig(gamma=2, layout="inline", schedule="fixed", fanout_budget=2, draft_matmul=mode,
                              **QUIET)
    torch.manual_seed(4321)
    ids = torch.tensor([PROMPT])
    samples, hits = [], 0
    for _ in range(N):
        out = target.generate(ids, max_new_tokens=L, assistant_model=draft, ssd_config=config, **GEN)
        samples.append(tuple(out[0, len(PROMPT):].tolist()))
        hits += hf_ssd.last_stats(target).cache_hits
    assert hits > 0 and counted[mode] > 0
    assert_matches_target(samples, joint, f"draft_matmul={mode}")


@pytest.mark.parametrize("b", [1, 2, 3])
def test_greedy_rows_identical_to_target_with_float16_draft_steps(pair, counted, b):  # noqa: F811 (the fixture)
    """Batched calls with "half": every row equals the target's batched generate. One-row draft steps take the float16
    copies (one prompt; in a batch, a step that drafts for one row only). Measured: b = 1 and 2 reach such steps,
    b = 3 does not, so there only the identity is checked."""
    target, draft = pair
    hooks = {"options": lambda options: [o for o in options if o.kind == "sd"], "plain": False, "loop": "batch"}
    for seed in range(3):
        g = torch.Generator().manual_seed(10 * b + seed)
        ids, mask = _batch(torch.randint(2, 10, (b,), generator=g).tolist(), seed)
        out = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=16,
                              ssd_config=hf_ssd.SSDConfig(draft_matmul="half", **QUIET), _ssd_hooks=hooks)
        assert torch.equal(out, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)), seed
    if b <= 2:
        assert counted["half"] > 0


def test_auto_verdicts_are_remembered_on_disk_for_later_processes(monkeypatch, tmp_path):
    """A verdict timed once is written under <cache>/matmul/; a later process (here: this one's verdicts forgotten)
    takes it without timing. Another machine, HF_SSD_NO_PROFILE=1 or a damaged file: timed again."""
    monkeypatch.delenv(profile.NO_PROFILE_ENV, raising=False)
    monkeypatch.setenv(profile.PROFILES_ENV, str(tmp_path / "profiles"))
    monkeypatch.setattr(matmul, "TIMED_MIN_PARAMS", 0)
    timed = []
    monkeypatch.setattr(matmul, "_time_products", lambda sample, rows, half=False: (
        timed.append(rows), "half" if half else "transposed")[1])
    layers = [torch.nn.Linear(8, 16)]

    def new_process():
        monkeypatch.setattr(matmul, "_verdicts", {})
        monkeypatch.setattr(matmul, "_read", set())

    new_process()
    assert matmul.transposed_pays(layers) is True and matmul.half_pays(layers) is True and len(timed) == 2
    [file] = (tmp_path / "matmul").glob("*.json")
    new_process()
    assert matmul.transposed_pays(layers, timing=False) is True and matmul.half_pays(layers) is True
    assert len(timed) == 2  # remembered: nothing timed
    machine = profile.machine
    monkeypatch.setattr(profile, "machine", lambda: {"cpu": "another"})
    new_process()
    assert matmul.transposed_pays(layers, timing=False) is None  # another machine's file: none yet
    assert matmul.transposed_pays(layers) is True and len(timed) == 3
    assert len(list((tmp_path / "matmul").glob("*.json"))) == 2
    monkeypatch.setenv(profile.NO_PROFILE_ENV, "1")
    new_process()
    assert matmul.transposed_pays(layers, timing=False) is None and matmul.transposed_pays(layers) is True
    assert len(timed) == 4 and len(list((tmp_path / "matmul").glob("*.json"))) == 2
    monkeypatch.delenv(profile.NO_PROFILE_ENV)
    monkeypatch.setattr(profile, "machine", machine)  # the first machine again, its file damaged
    file.write_text("{damaged", encoding="utf-8")
    monkeypatch.setattr(matmul, "_time_products", lambda sample, rows, half=False: (timed.append(rows), "linear")[1])
    new_process()
    assert matmul.transposed_pays(layers) is False and len(timed) == 5
