"""SSDConfig.verify_matmul: the target's CPU linear layers computed as (W @ x^T)^T in its verify forwards only
(hf_ssd/drafting/matmul.py `verify_matmul`, `verifying`).

- Only forwards that score drafted candidates take it, on the caller's thread: never the target's one-token (AR)
  steps, its prompt prefill or plain batched decoding, never a speculation job's thread.
- Greedy, forced on the float64 tiny pairs: every row identical to the target's own batched generate and to the
  row alone, B in {1, 2, 3, 8}, several schedules; sampled output with the target's exact distribution
  (chi-square as in test_sampling.py: a correct implementation fails with probability < 1e-4).
- Patched only during the call, shared by concurrent calls; "auto" times the target's layers at verify rows and
  leaves tiny weights alone; the one-prompt path (transformers' assisted loop) refuses "transposed".
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import make_model, noisy_copy
from test_sampling import GEN, PROMPT, L, N, assert_matches_target, exact_joint, sampling_pair

import hf_ssd
from hf_ssd import SSDConfig, SSDUsageError
from hf_ssd.drafting import matmul

QUIET = {"hit_rate_warning": 0.0}
NEW = 20


@pytest.fixture(scope="module")
def pair():
    target = hf_ssd.enable(make_model(0, attn="sdpa"))  # SDPA: its own padded batches are exact
    target.generation_config.eos_token_id = None
    return target, noisy_copy(target, 0.02)


@pytest.fixture
def target_calls(monkeypatch):
    """(tokens per row, thread) of every transposed product a layer of the `pair` target took."""
    calls = []
    inner = matmul._transposed_forward

    def counting(self, x, *limit):
        out = inner(self, x, *limit)
        rows = x.numel() // x.shape[-1]
        if getattr(self, "_verify_probe", False) and rows <= (limit[0] if limit else matmul.MAX_ROWS):
            calls.append((x.shape[-2] if x.dim() == 3 else 1, threading.current_thread()))
        return out

    monkeypatch.setattr(matmul, "_transposed_forward", counting)
    return calls


def _mark(model):
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m._verify_probe = True


def _batch(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(2, 96, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def _only(kind: str) -> dict:
    return {"options": lambda options: [o for o in options if o.kind == kind], "plain": False, "loop": "batch"}


SCHEDULES = {
    "auto": (SSDConfig(verify_matmul="transposed", **QUIET), {"plain": False, "loop": "batch"}),
    "sd_g3": (SSDConfig(gamma=3, verify_matmul="transposed", **QUIET), _only("sd")),
    "ssd_g2_b2_inline": (SSDConfig(gamma=2, fanout_budget=2, schedule="fixed", layout="inline",
                                   verify_matmul="transposed", **QUIET), {"loop": "batch"}),
    "ssd_g3_b2_thread": (SSDConfig(gamma=3, fanout_budget=2, schedule="fixed", layout="thread",
                                   verify_matmul="transposed", **QUIET), {"loop": "batch"}),
}


@pytest.mark.parametrize("b", [1, 2, 3, 8])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_greedy_rows_identical_to_target_with_the_transposed_verify(pair, target_calls, b, name):
    target, draft = pair
    _mark(target)
    config, hooks = SCHEDULES[name]
    for seed in range(3):
        g = torch.Generator().manual_seed(100 * b + seed)
        ids, mask = _batch(torch.randint(2, 10, (b,), generator=g).tolist(), seed)
        out = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=NEW,
                              ssd_config=config, _ssd_hooks=hooks)
        want = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
        assert torch.equal(out, want), (name, b, seed)
        width = ids.shape[1]
        for i in range(b):
            prompt = ids[i:i + 1, width - int(mask[i].sum()):]
            alone = target.generate(prompt, do_sample=False, max_new_tokens=NEW)[0, prompt.shape[1]:]
            assert torch.equal(out[i, width:width + alone.numel()], alone), (name, b, seed, i)
    assert target_calls, "the target's verify never took the transposed product"
    # Only verify forwards: at least one candidate beside the row's unverified token, on the caller's thread.
    assert all(tokens >= 2 and thread is threading.main_thread() for tokens, thread in target_calls)
    assert not [m for m in target.modules() if "forward" in m.__dict__]  # restored after the calls


def test_ar_rounds_prefill_and_plain_decoding_keep_transformers_product(pair, target_calls):
    """The target alone's computations stay bit for bit its own: AR rounds, the prompt's prefill (short prompts
    included) and plain batched decoding take no transposed product even with verify_matmul="transposed"."""
    target, draft = pair
    _mark(target)
    config = SSDConfig(verify_matmul="transposed", **QUIET)
    for b, hooks in ((1, _only("ar")), (3, _only("ar")), (4, {"plain_forced": True})):
        ids, mask = _batch([3] * b, b)
        kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=8)
        if "plain_forced" in hooks:  # plain batched decoding, as the loop hands a call to it
            from hf_ssd.loop import batch as loop

            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(loop.BatchPlan, "plain", lambda self, rows, new: True)
                out = target.generate(ids, assistant_model=draft, ssd_config=config, **kwargs)
            assert hf_ssd.last_stats(target).draft_path == "plain batched"
        else:
            out = target.generate(ids, assistant_model=draft, ssd_config=config, _ssd_hooks=hooks, **kwargs)
        assert torch.equal(out, target.generate(ids, **kwargs))
    assert target_calls == []
    # The same calls with SD rounds do take it (the filter above is what kept it out).
    target.generate(*_batch([3], 9)[:1], do_sample=False, max_new_tokens=8, assistant_model=draft,
                    ssd_config=config, _ssd_hooks=_only("sd"))
    assert target_calls


def test_stock_and_auto_on_tiny_weights_leave_the_target_alone(pair, target_calls):
    target, draft = pair
    _mark(target)
    ids, mask = _batch([4, 6], 1)
    for mode in ("stock", "auto"):  # auto: float64 layers, and tiny float32 ones untimed: transformers' product
        target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=12,
                        ssd_config=SSDConfig(verify_matmul=mode, **QUIET), _ssd_hooks=_only("sd"))
    assert target_calls == []
    small = make_model(0).float()
    with matmul.verify_matmul(small, "auto") as n:
        assert n == 0


@pytest.mark.parametrize("verdicts", [("linear",), ("transposed", "linear"), ("transposed", "transposed")])
def test_auto_times_the_targets_layers_at_their_first_verify(monkeypatch, verdicts):
    """Not when the call starts: at its first verify forward (a call of AR rounds only never pays), at VERIFY_ROWS
    first, and where the product won there at VERIFY_WIDE_ROWS too, which sets the largest verify (tokens in all)
    that takes it. The timing's seconds are the verifying thread's setup (`setup_seconds`), which the loop leaves
    out of the verify's measured time; a later call patches by the verdicts at once."""
    model = make_model(0).float()
    monkeypatch.setattr(matmul, "TIMED_MIN_PARAMS", 0)
    matmul._verdicts.clear()
    timed, answers = [], dict(zip((matmul.VERIFY_ROWS, (matmul.VERIFY_WIDE_ROWS,)), verdicts))

    def timing(sample, rows):
        timed.append(rows)
        time.sleep(0.05)
        return answers[rows]

    monkeypatch.setattr(matmul, "_time_products", timing)
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(1, 3, layer.in_features)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    with matmul.verify_matmul(model, "auto") as n:
        assert n > 0 and timed == []
        torch.testing.assert_close(layer(x), expected)  # not a verify: transformers' product, nothing timed
        assert timed == []
        other = []
        thread = threading.Thread(target=lambda: other.append(matmul.setup_seconds()))
        before = matmul.setup_seconds()
        with matmul.verifying():
            torch.testing.assert_close(layer(x), expected)
            thread.start()
            thread.join()
        assert timed == [matmul.VERIFY_ROWS, (matmul.VERIFY_WIDE_ROWS,)][:len(verdicts)]
        assert matmul.setup_seconds() - before >= 0.05 * len(verdicts) and other == [0.0]
        with matmul.verify_matmul(model, "auto") as m:  # a concurrent call shares the patch (and the timing)
            assert m == n
        with matmul.verifying():
            layer(x)
        assert len(timed) == len(verdicts)
        threads = torch.get_num_threads()
        torch.set_num_threads(threads + 1)  # a round with other threads: its own verdicts
        try:
            with matmul.verifying():
                layer(x)
        finally:
            torch.set_num_threads(threads)
        assert len(timed) == 2 * len(verdicts)
    assert not [m for m in model.modules() if "forward" in m.__dict__]
    with matmul.verify_matmul(model, "auto") as n:  # timed in this process: patched by the verdicts
        assert (n > 0) is (verdicts[0] == "transposed")
        if n:
            limit = matmul.VERIFY_WIDE_ROWS if verdicts[1] == "transposed" else matmul.MAX_ROWS
            assert layer.forward.__func__.keywords == {"max_rows": limit}
    assert len(timed) == 2 * len(verdicts)
    matmul._verdicts.clear()


def test_the_verify_products_timing_is_not_the_verifys_time(monkeypatch):
    """The first verify that scores candidates times the target's product (1 s here): the round's measured
    verify time, from which the scheduler prices verifying, leaves it out."""
    target = hf_ssd.enable(make_model(0).float())
    draft = noisy_copy(target, 0.01)
    monkeypatch.setattr(matmul, "TIMED_MIN_PARAMS", 0)
    matmul._verdicts.clear()
    timed = []

    def timing(sample, rows):
        timed.append(rows)
        time.sleep(1.0)
        return "linear"

    monkeypatch.setattr(matmul, "_time_products", lambda sample, rows, half=False: (
        timing(sample, rows) if rows in (matmul.VERIFY_ROWS, (matmul.VERIFY_WIDE_ROWS,)) else "linear"))
    prompt = torch.tensor([[5, 6, 7, 8]])
    out = target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=draft,
                          ssd_config=SSDConfig(**QUIET), _ssd_hooks=_only("sd"))
    assert torch.equal(out, target.generate(prompt, max_new_tokens=16, do_sample=False))
    stats = hf_ssd.last_stats(target)
    assert timed == [matmul.VERIFY_ROWS] and stats.proposed_tokens > 0
    assert max(b - a for a, b in stats.intervals["verify"]) >= 1.0  # the round that timed took it ...
    assert max(stats.cost_model["verify_s"].values()) < 0.05  # ... and the scheduler's price of a verify did not
    matmul._verdicts.clear()


@pytest.mark.parametrize("limit", [8, 16])
def test_a_verify_takes_the_product_up_to_its_limit_in_tokens(monkeypatch, limit):
    layer = torch.nn.Linear(8, 16).double()
    seen = []
    inner = matmul.F.linear
    monkeypatch.setattr(matmul, "F", type("F", (), {"linear": staticmethod(
        lambda x, w, b: (seen.append(x.numel() // x.shape[-1]), inner(x, w, b))[1])}))
    with matmul.verifying():
        for tokens in (2, 8, 12, 16, 17):
            x = torch.randn(1, tokens, 8, dtype=torch.float64)
            torch.testing.assert_close(matmul._verify_forward(layer, x, limit), inner(x, layer.weight, layer.bias))
    assert seen == [t for t in (2, 8, 12, 16, 17) if t > limit]


def test_verifying_is_per_thread_and_restores():
    layer = torch.nn.Linear(8, 16).double()
    seen = []
    with matmul.verify_matmul(layer, "transposed"):
        calls = []
        real = matmul._transposed_forward
        try:
            matmul._transposed_forward = lambda self, x, *a: (calls.append(threading.current_thread()),
                                                              real(self, x, *a))[1]
            x = torch.randn(2, 8, dtype=torch.float64)
            layer(x)
            with matmul.verifying():
                layer(x)
                other = threading.Thread(target=lambda: seen.append(layer(x)))
                other.start()
                other.join()
                with matmul.verifying(False):
                    layer(x)
            layer(x)
        finally:
            matmul._transposed_forward = real
    assert calls == [threading.main_thread()] and len(seen) == 1


def test_the_one_prompt_path_refuses_a_transposed_verify(pair):
    target, draft = pair
    with pytest.raises(SSDUsageError, match="verify_matmul='transposed'.*static_draft=False"):
        target.generate(torch.tensor([[5, 6, 7]]), assistant_model=draft, do_sample=False, max_new_tokens=4,
                        ssd_config=SSDConfig(verify_matmul="transposed", static_draft=False, **QUIET))


@pytest.mark.slow  # the product changes the target's p only by rounding; the chi-square test holds for p exact
def test_sampling_matches_target_with_the_transposed_verify(monkeypatch):
    target, draft = sampling_pair()
    calls = [0]
    inner = matmul._transposed_forward
    monkeypatch.setattr(matmul, "_transposed_forward", lambda self, x, *a: (calls.__setitem__(0, calls[0] + 1),
                                                                            inner(self, x, *a))[1])
    joint = exact_joint(target)
    config = SSDConfig(gamma=2, layout="inline", schedule="fixed", fanout_budget=2, verify_matmul="transposed",
                       **QUIET)
    torch.manual_seed(4322)
    ids = torch.tensor([PROMPT])
    samples = []
    for _ in range(N):
        out = target.generate(ids, max_new_tokens=L, assistant_model=draft, ssd_config=config, **GEN)
        samples.append(tuple(out[0, len(PROMPT):].tolist()))
    assert calls[0] > 0
    assert_matches_target(samples, joint, "verify_matmul=transposed")
