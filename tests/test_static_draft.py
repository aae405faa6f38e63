"""The static-shape draft path (hf_ssd/drafting/static.py) on CPU: same candidates as the dynamic drafter, greedy
output identical to the target alone, sampled output distributed as the target's, its config switches, the
fallback to the dynamic path for drafts it cannot drive, buffer reuse across calls, and no host sync inside the
steps of a round. CUDA graphs themselves are tested in tests/test_cuda.py.
"""

from __future__ import annotations

import inspect
import logging
import threading

import pytest
import torch
from conftest import make_model, noisy_copy, slow_cases
from transformers import LogitsProcessorList
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper

import hf_ssd
import hf_ssd.drafting.static as sd
from hf_ssd import SSDConfig, SSDConfigError
from hf_ssd.drafting.drafter import Drafter
from hf_ssd.drafting.graphs import GraphCaptureError, StepRunner
from hf_ssd.drafting.static import StaticDrafter, make_drafter, static_support
from hf_ssd.speculation.outcomes import Outcome

NEW = 24
REAL_STEP_FN = sd._step_fn


def prompt(seed: int, length: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 96, (1, length), generator=g)


def static_config(**kw) -> SSDConfig:
    # schedule="fixed" and fanout="geometric": the same options and predictions every run (no state carried
    # from earlier calls), so static and dynamic paths can be compared round by round.
    return SSDConfig(**{"static_draft": True, "layout": "inline", "hit_rate_warning": 0.0, "schedule": "fixed",
                        "fanout": "geometric", **kw})


# ----- the drafter alone: same candidates as the dynamic path ------------------------------------------------------
def pair_of_drafters(model, processors=None, top_k=4, rows=4):
    dyn = Drafter(model, processors, False, top_k)
    sta = StaticDrafter(model, processors, False, top_k, max_len=80, rows=rows)
    return dyn, sta


def same_tops(a: dict, b: dict, positions) -> None:
    for p in positions:
        (va, ia), (vb, ib) = a[p], b[p]
        assert ia.tolist() == ib.tolist(), p
        assert torch.allclose(va.cpu(), vb.cpu(), atol=1e-6), p


@pytest.mark.parametrize(("procs", "attn"), [(None, "eager"), ("penalty", "eager"), ("temperature", "eager"),
                                             (None, "sdpa")])
def test_static_drafter_matches_dynamic_through_rounds(draft, target, procs, attn):
    """Drive both drafters through the calls a generation makes (fallback draft, record, tree, adopt, again)."""
    processors = {None: None,
                  "penalty": LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)]),
                  "temperature": LogitsProcessorList([TemperatureLogitsWarper(0.7)])}[procs]
    if attn == "sdpa":  # SDPA reads the 4D float mask through its own kernel
        draft = noisy_copy(target, 0.01)
        draft.config._attn_implementation = "sdpa"
    dyn, sta = pair_of_drafters(draft, processors)
    context = prompt(3, 9)[0].tolist()
    gamma = 4
    for _round in range(4):
        a, b = dyn.draft(context, gamma, [2] * 5), sta.draft(context, gamma, [2] * 5)
        assert a.tokens == b.tokens
        cand = a.tokens
        for d in (dyn, sta):
            d.record(context + cand, record_from=len(context) - 1)
        tops_a, tops_b = dyn.candidate_tops(len(context), gamma), sta.candidate_tops(len(context), gamma)
        for (va, ia), (vb, ib) in zip(tops_a, tops_b):
            assert ia.tolist() == ib.tolist()
            assert torch.allclose(va, vb, atol=1e-6)
        # Outcomes of several acceptance lengths, fewer than the tree's rows (padding rows run too).
        outcomes = [Outcome(0, int(tops_a[0][1][1])), Outcome(2, int(tops_a[2][1][1])), Outcome(gamma, 7)]
        ta, tb = dyn.start_tree(len(context), outcomes), sta.start_tree(len(context), outcomes)
        ra = dyn.tree_steps(ta, outcomes, gamma, [2] * 5, lambda: False)
        rb = sta.tree_steps(tb, outcomes, gamma, [2] * 5, lambda: False)
        for (sa, da), (sb, db) in zip(ra, rb):
            assert da.tokens == db.tokens and sa.fed == sb.fed
            same_tops(sa.top, sb.top, sa.top)
        # Adopt the middle branch (a "hit"), then continue from its context.
        k = 2
        tokens = ra[1][1].tokens
        dyn.adopt(ra[1][0], tokens)
        sta.adopt(rb[1][0], tokens)
        assert dyn.ids == sta.ids
        same_tops(dyn.top, sta.top, dyn.top)
        context = context + cand[:k] + [outcomes[1].bonus]
        nxt_a = dyn.draft(context, gamma, [2] * 5)
        nxt_b = sta.draft(context, gamma, [2] * 5)
        assert nxt_a.tokens == nxt_b.tokens
        context = context + nxt_a.tokens[:1]  # a miss next: the trunk is cropped and refilled
    sta.release()


def test_early_stop_and_partial_branches(draft):
    dyn, sta = pair_of_drafters(draft)
    context = prompt(5, 7)[0].tolist()
    cands = [d.draft(context, 3, [1] * 4).tokens for d in (dyn, sta)]
    assert cands[0] == cands[1]
    for d in (dyn, sta):
        d.record(context + cands[0], len(context) - 1)
    outcomes = [Outcome(1, 5), Outcome(0, 9)]
    calls = {"n": 0}

    def stop_after(n):
        def should_stop():
            calls["n"] += 1
            return calls["n"] > n
        return should_stop

    calls["n"] = 0
    ra = dyn.tree_steps(dyn.start_tree(len(context), outcomes), outcomes, 3, [1] * 4, stop_after(2))
    calls["n"] = 0
    rb = sta.tree_steps(sta.start_tree(len(context), outcomes), outcomes, 3, [1] * 4, stop_after(2))
    for (_, da), (sb, db) in zip(ra, rb):
        assert da.tokens == db.tokens and len(db.tokens) == 2 and sb.fed == 2
    sta.adopt(rb[0][0], rb[0][1].tokens)
    dyn.adopt(ra[0][0], ra[0][1].tokens)
    assert sta.ids == dyn.ids
    sta.release()


def test_tree_larger_than_planned_gets_its_own_rows(target):
    dyn, sta = pair_of_drafters(noisy_copy(target, 0.01), rows=1)  # a fresh draft: no cached state
    context = prompt(2, 8)[0].tolist()
    for d in (dyn, sta):
        d.record(context, len(context) - 1)
    outcomes = [Outcome(0, b) for b in (4, 5, 6)]
    ra = dyn.tree_steps(dyn.start_tree(len(context), outcomes), outcomes, 2, [3, 0, 0], lambda: False)
    rb = sta.tree_steps(sta.start_tree(len(context), outcomes), outcomes, 2, [3, 0, 0], lambda: False)
    assert [d.tokens for _, d in ra] == [d.tokens for _, d in rb]
    assert sorted(sta.state.trees) == [1, 3]
    sta.release()


# ----- generate: greedy identical to the target alone --------------------------------------------------------------
CASES = [
    dict(gamma=4),
    dict(gamma=4, fanout_budget=3),  # fewer outcomes than rows: padding rows
    dict(gamma=3, fallback="short", fanout_budget=2),
    dict(gamma=2, fallback="ar"),
    dict(gamma=5, fallback="ngram", fanout_budget=4),
    dict(gamma=1),
    dict(gamma=4, fanout_budget=2, layout="thread"),
    dict(gamma=3, cuda_graphs=True, static_draft=None),  # on CPU: the static path without graphs
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_greedy_identical_to_target_over_seeds(target, draft, random_draft, case):
    config = static_config(**CASES[case])
    for seed in range(6):
        ids = prompt(seed)
        ref = target.generate(ids, max_new_tokens=NEW, do_sample=False)
        for d in (draft, random_draft):
            out = target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=d, ssd_config=config)
            assert out.tolist() == ref.tolist(), (seed, CASES[case])
            assert hf_ssd.last_stats(target).draft_path == "static"


def test_greedy_with_repetition_penalty_and_long_prompt(target, draft):
    """A context-dependent processor (per-row path) and a prompt prefilled as one chunk into the static cache."""
    for seed in range(4):
        ids = prompt(seed, 40)
        kw = dict(max_new_tokens=NEW, do_sample=False, repetition_penalty=1.3)
        ref = target.generate(ids, **kw)
        out = target.generate(ids, assistant_model=draft, ssd_config=static_config(gamma=3, fanout_budget=3), **kw)
        assert out.tolist() == ref.tolist()


@pytest.mark.parametrize("layout", ["inline", "thread"])
def test_static_path_under_the_scheduler_is_exact(target, draft, layout):
    for seed in range(4):
        ids = prompt(seed)
        ref = target.generate(ids, max_new_tokens=NEW, do_sample=False)
        out = target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                              ssd_config=SSDConfig(static_draft=True, layout=layout, hit_rate_warning=0.0))
        assert out.tolist() == ref.tolist()
        assert hf_ssd.last_stats(target).draft_path == "static"


def test_static_path_has_hits(target, draft):
    """Not a degenerate path: branches are drafted and hit as often as with the dynamic drafter."""
    hits = {}
    for static in (False, True):
        total = 0
        for seed in range(6):
            target.generate(prompt(seed), max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                            ssd_config=static_config(static_draft=static, fanout_budget=3))
            total += hf_ssd.last_stats(target).cache_hits
        hits[static] = total
    assert hits[True] == hits[False] > 0  # inline layout: the same predictions, the same hits


# ----- graph semantics, emulated on CPU --------------------------------------------------------------------------
@pytest.fixture
def graph_like(monkeypatch):
    """Steps behave as CUDA-graph replays do: the output is one buffer overwritten by every step, and the step's
    input tensors must be the same storage every time (updated in place, never re-bound)."""
    real = sd._step_fn

    def fake(model, rows, *args):
        fn = real(model, rows, *args)
        inputs = lambda: [rows.input_ids, rows.position_ids, rows.mask, rows.step_cols, *rows.keys, *rows.values]  # noqa: E731
        ptrs = [t.data_ptr() for t in inputs()]
        out: dict = {}

        def step():
            assert [t.data_ptr() for t in inputs()] == ptrs and rows.cols is rows.step_cols
            result = fn()
            if "buf" not in out:
                out["buf"] = result.clone()
            else:
                out["buf"].copy_(result)
            return out["buf"]

        return step

    monkeypatch.setattr(sd, "_step_fn", fake)


@pytest.mark.parametrize("sample", [False, True])
def test_graph_like_steps_give_the_same_output(target, graph_like, sample):
    """With replay semantics (aliased outputs) the static path produces exactly what it does eagerly."""
    kw = dict(max_new_tokens=NEW, do_sample=sample, **(dict(temperature=0.8, top_k=20) if sample else {}))
    for i, cfg in enumerate([static_config(fanout_budget=3), static_config(gamma=3, saguaro_c=0.3, fanout_budget=4),
                             static_config(gamma=2, fallback="short")]):
        outs = []
        for step_fn in (REAL_STEP_FN, sd._step_fn):  # eager, then the emulation
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(sd, "_step_fn", step_fn)
                d = noisy_copy(target, 0.01)  # a fresh draft: a fresh state built with this step function
                torch.manual_seed(i)
                outs.append(target.generate(prompt(i), assistant_model=d, ssd_config=cfg, **kw).tolist())
        assert outs[0] == outs[1]
        if not sample:
            assert outs[1] == target.generate(prompt(i), **kw).tolist()


# ----- config ----------------------------------------------------------------------------------------------------
def test_resolved_draft_path():
    assert SSDConfig().resolved_draft_path(False) == (False, False)
    assert SSDConfig().resolved_draft_path(True) == (True, True)
    assert SSDConfig(static_draft=True).resolved_draft_path(False) == (True, False)
    assert SSDConfig(cuda_graphs=True).resolved_draft_path(False) == (True, False)
    assert SSDConfig(cuda_graphs=False).resolved_draft_path(True) == (True, False)
    assert SSDConfig(static_draft=False).resolved_draft_path(True) == (False, False)
    assert SSDConfig(static_draft=True, cuda_graphs=False).resolved_draft_path(True) == (True, False)


def test_one_prompt_with_a_static_draft_runs_the_one_prompt_path(target, draft):
    """hf_ssd's loop has no static draft yet: one prompt whose draft resolves to it (a CUDA draft by default, or
    static_draft=True) runs the one-prompt path, which drafts with it (and graphs on CUDA)."""
    from types import SimpleNamespace

    target.generate(prompt(0), max_new_tokens=8, do_sample=False, assistant_model=draft,
                    ssd_config=SSDConfig(static_draft=True, layout="inline", hit_rate_warning=0.0))
    assert hf_ssd.last_stats(target).draft_path == "static"

    from hf_ssd.integration import _static_draft

    on = {kind: SimpleNamespace(device=torch.device(kind)) for kind in ("cpu", "cuda")}
    assert _static_draft(SSDConfig(), on["cuda"]) and not _static_draft(SSDConfig(), on["cpu"])
    assert not _static_draft(SSDConfig(static_draft=False), on["cuda"])
    assert _static_draft(SSDConfig(static_draft=True), on["cpu"])
    assert not _static_draft(SSDConfig(), None)  # no draft: refused later, with its own message


@pytest.mark.parametrize(("kw", "match"), [
    (dict(static_draft="yes"), "static_draft must be True, False or None"),
    (dict(cuda_graphs=1), "cuda_graphs must be True, False or None"),
    (dict(cuda_graphs=True, static_draft=False), "cuda_graphs=True needs the static draft path"),
])
def test_bad_config(kw, match):
    with pytest.raises(SSDConfigError, match=match):
        SSDConfig(**kw)


def test_default_on_cpu_is_dynamic(target, draft):
    target.generate(prompt(0), max_new_tokens=8, do_sample=False, assistant_model=draft,
                    ssd_config=SSDConfig(layout="inline", hit_rate_warning=0.0))
    # hf_ssd's loop ("batched", which one prompt runs by default) and the one-prompt path's dynamic drafter both
    # grow their caches as they go; neither is the static path.
    assert hf_ssd.last_stats(target).draft_path == "batched"
    target.generate(prompt(0), max_new_tokens=8, do_sample=False, assistant_model=draft,
                    ssd_config=SSDConfig(layout="inline", hit_rate_warning=0.0), _ssd_hooks={"loop": "assisted"})
    assert hf_ssd.last_stats(target).draft_path == "dynamic"


def test_masked_prompt_takes_the_dynamic_path_and_stays_exact(caplog):
    # float32: in float64 with eager attention, transformers 5.25 turns this left-padded prompt's logits to NaN
    # (the target alone's too), and hf_ssd's estimates cannot bin NaN probabilities.
    target = hf_ssd.enable(make_model(0).float())
    draft = noisy_copy(target, 0.01).float()
    ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt(1)], dim=1)
    mask = torch.ones_like(ids)
    mask[:, :3] = 0  # left padding: only the dynamic drafter honours the caller's attention_mask
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    with caplog.at_level(logging.INFO, logger="hf_ssd"):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant_model=draft,
                              ssd_config=SSDConfig(static_draft=True, layout="inline", hit_rate_warning=0.0))
    assert len(set(ref[0, ids.shape[1]:].tolist())) > 1 and out.tolist() == ref.tolist()
    assert hf_ssd.last_stats(target).draft_path == "dynamic"
    assert "attention_mask masks some columns" in caplog.text


# ----- drafts the static path cannot drive -------------------------------------------------------------------------
def sliding_draft():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=4)
    cfg._attn_implementation = "eager"
    return MistralForCausalLM(cfg).eval()


def test_unsupported_draft_uses_dynamic_path_with_a_message(caplog, draft):
    model = sliding_draft()
    assert "sliding-window" in static_support(model)
    assert static_support(draft) is None
    for config, level in [(SSDConfig(), None), (SSDConfig(static_draft=True), logging.WARNING),
                          (SSDConfig(cuda_graphs=True), logging.WARNING)]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_ssd"):
            d = make_drafter(model, config, None, False, 2, None, 96, 32, 2)
        assert type(d) is Drafter
        if level is None:
            assert not caplog.records  # auto on CPU never asks for the static path
        else:
            assert [r.levelno for r in caplog.records] == [level]
            assert "using the dynamic draft path" in caplog.text


def family_draft(name: str):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(7)
    if name == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    else:
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    model.config._attn_implementation = "eager"
    return model.double().eval()


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_full_attention_families_are_static_and_exact(target, family):
    d = family_draft(family)
    assert static_support(d) is None
    for seed in range(3):
        ids = prompt(seed)
        ref = target.generate(ids, max_new_tokens=NEW, do_sample=False)
        out = target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=d,
                              ssd_config=static_config(fanout_budget=2))
        assert out.tolist() == ref.tolist()
        assert hf_ssd.last_stats(target).draft_path == "static"


def test_flash_attention_is_not_static(draft):
    model = make_model(0)
    model.config._attn_implementation = "flash_attention_2"
    assert "attention implementation" in static_support(model)


def test_inference_mode_calls(target):
    """Pipelines and the CLI call generate under torch.inference_mode(); the speculator thread runs outside it
    and updates the static buffers in place, so they must be normal tensors; later calls reuse them."""
    draft = noisy_copy(target, 0.01)
    ids = prompt(3)
    ref = target.generate(ids, max_new_tokens=NEW, do_sample=False)
    for mode in (True, False, True):
        with torch.inference_mode(mode):
            out = target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                                  ssd_config=static_config(layout="thread", fanout_budget=2))
        assert out.tolist() == ref.tolist()
        assert hf_ssd.last_stats(target).draft_path == "static"


# ----- buffers reused across calls ---------------------------------------------------------------------------------
def test_state_is_reused_across_calls_and_not_shared_by_concurrent_ones(target):
    draft = noisy_copy(target, 0.01)
    cfg = static_config(fanout_budget=2)
    target.generate(prompt(0), max_new_tokens=NEW, do_sample=False, assistant_model=draft, ssd_config=cfg)
    first = sd._states[draft][False]
    assert not first.busy
    target.generate(prompt(1), max_new_tokens=NEW, do_sample=False, assistant_model=draft, ssd_config=cfg)
    assert sd._states[draft][False] is first
    held = make_drafter(draft, cfg, None, False, 3, None, 96, 30, 2)
    other = make_drafter(draft, cfg, None, False, 3, None, 96, 30, 2)
    assert held.state is first and other.state is not first  # a second drafter never shares busy buffers
    held.release()
    other.release()
    dropped = make_drafter(draft, cfg, None, False, 3, None, 96, 30, 2)
    assert dropped.state is first and first.busy
    del dropped  # e.g. a generator that failed after building its drafter: the buffers are free again
    assert not first.busy
    # Exact after all that (the buffers of a new call start clean).
    ids = prompt(2)
    ref = target.generate(ids, max_new_tokens=NEW, do_sample=False)
    out = target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft, ssd_config=cfg)
    assert out.tolist() == ref.tolist()


def test_concurrent_generates_on_one_draft_are_exact(draft):
    targets = [make_model(0) for _ in range(2)]
    for t in targets:
        hf_ssd.enable(t)
    refs = [t.generate(prompt(i), max_new_tokens=NEW, do_sample=False) for i, t in enumerate(targets)]
    outs = [None, None]

    def run(i):
        outs[i] = targets[i].generate(prompt(i), max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                                      ssd_config=static_config(fanout_budget=2))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert [o.tolist() for o in outs] == [r.tolist() for r in refs]


# ----- no host sync inside a step --------------------------------------------------------------------------------
def test_tree_steps_reach_the_host_once(draft, monkeypatch):
    """Within a round's tree steps the only device->host transfer is the final one (graphs.host_list)."""
    sta = StaticDrafter(draft, None, True, 3, 0.5, torch.Generator().manual_seed(0), max_len=60, rows=3)
    context = prompt(4, 8)[0].tolist()
    sta.record(context, len(context) - 1)
    outcomes = [Outcome(0, 5), Outcome(0, 6)]
    tree = sta.start_tree(len(context), outcomes)
    counts = {"sync": 0, "host": 0}
    real_host_list = sd.host_list

    def counted(name):
        real = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):
            counts["sync"] += 1
            return real(self, *a, **k)
        return wrapper

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))

    def host_list(t):
        counts["host"] += 1
        counts["sync"] -= 1  # its own tolist
        return real_host_list(t)

    monkeypatch.setattr(sd, "host_list", host_list)
    out = sta.tree_steps(tree, outcomes, 4, [2] * 5, lambda: False)
    monkeypatch.undo()
    assert counts == {"sync": 0, "host": 1}
    assert all(len(r.tokens) == 4 and r.logits.shape == (4, 96) for _, r in out)
    sta.release()


# ----- the step runner without CUDA ---------------------------------------------------------------------------------
def test_step_runner_capture_failure(monkeypatch, caplog):
    import hf_ssd.drafting.graphs as graphs

    def boom(fn, warmup):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", boom)
    calls = []
    runner = StepRunner(lambda: calls.append(1) or torch.ones(1), graphs=True, strict=False, name="t")
    with caplog.at_level(logging.WARNING, logger="hf_ssd"):
        assert runner().item() == 1.0 and runner().item() == 1.0
    assert len(calls) == 2 and not runner.captured and "capture of draft step 't' failed" in caplog.text
    assert len(caplog.records) == 1  # reported once
    strict = StepRunner(lambda: torch.ones(1), graphs=True, strict=True, name="t")
    with pytest.raises(GraphCaptureError, match="cuda_graphs=None"):
        strict()


def test_failed_capture_raises_for_a_strict_call_that_reuses_the_state(target, monkeypatch, caplog):
    """A capture that failed under cuda_graphs=None is remembered: a later cuda_graphs=True call raises, and the
    buffers are free afterwards (CPU stand-in: the capture itself is made to fail)."""
    import hf_ssd.drafting.graphs as graphs

    def boom(fn, warmup):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(graphs, "_capture", boom)
    d = noisy_copy(target, 0.01)
    with caplog.at_level(logging.WARNING, logger="hf_ssd"):
        auto = StaticDrafter(d, None, False, 3, max_len=40, rows=2, graphs=True, strict_graphs=False)
    assert auto.path == "static" and len(caplog.records) == 2  # trunk and tree, logged once each
    context = prompt(1)[0].tolist()
    assert len(auto.draft(context, 3, [1] * 4).tokens) == 3  # eager steps
    auto.release()
    with pytest.raises(GraphCaptureError, match="could not capture the draft step 'trunk"):
        StaticDrafter(d, None, False, 3, max_len=40, rows=2, graphs=True, strict_graphs=True)
    assert not sd._states[d][True].busy


def test_step_runner_eager_on_cpu():
    runner = StepRunner(lambda: torch.zeros(2), graphs=False, strict=True, name="t")
    runner.capture()
    assert not runner.captured and runner().shape == (2,)


# ----- sampling: exactly the target's distribution ------------------------------------------------------------------
SAMPLING = {
    "static": dict(gamma=2, fanout_budget=2),
    "static_saguaro": dict(gamma=3, saguaro_c=0.0, fanout_budget=4),
    "static_short_thread": dict(gamma=3, fanout_budget=1, fallback="short", layout="thread"),
}


@pytest.mark.parametrize("case", slow_cases(SAMPLING, ["static_saguaro", "static_short_thread"]))
def test_sampling_matches_target_distribution(case):
    """Same statistics as tests/test_sampling.py: false-fail probability < 1e-4 per case (Bonferroni)."""
    from test_sampling import GEN, PROMPT, L, N, assert_matches_target, exact_joint, sampling_pair

    target, d = sampling_pair()
    joint = exact_joint(target)
    config = static_config(**SAMPLING[case])
    torch.manual_seed(4321)
    samples, hits = [], 0
    ids = torch.tensor([PROMPT])
    for _ in range(N):
        out = target.generate(ids, max_new_tokens=L, assistant_model=d, ssd_config=config, **GEN)
        samples.append(tuple(out[0, len(PROMPT):].tolist()))
        stats = hf_ssd.last_stats(target)
        assert stats.draft_path == "static"
        hits += stats.cache_hits
    assert hits > 0
    assert_matches_target(samples, joint, case)


# ----- buffer size at the length boundary ---------------------------------------------------------------------------
def _longest_ssd(options):
    """Overlapped SSD at its longest gamma (8) only: every round pre-drafts 8-token branches, the last ones too."""
    longest = max(o.gamma for o in options if o.kind == "ssd")
    return [o for o in options if o.kind == "ssd" and o.gamma == longest]


@pytest.mark.parametrize("forced", [False, True], ids=["auto", "longest-options"])
def test_static_buffers_hold_the_longest_draft_up_to_max_length(forced):
    """The scheduler runs drafts longer than `config.gamma` (8 for SSD, 16 for confidence-stopped SD): the
    static buffers must hold them at every distance from max_length. An identical draft accepts everything, so
    every round drafts its whole length; forcing the longest options reaches the last columns (sized from
    config.gamma, max_new_tokens=39 overflowed)."""
    target = hf_ssd.enable(make_model(0))
    same = make_model(0)
    hooks = {"options": _longest_ssd} if forced else None
    config = SSDConfig(static_draft=True, hit_rate_warning=0.0)
    p = torch.tensor([[5, 6, 7, 8]])
    for n in range(20, 61):
        out = target.generate(p, assistant_model=same, do_sample=False, max_new_tokens=n, ssd_config=config,
                              _ssd_hooks=hooks)
        assert torch.equal(out, target.generate(p, do_sample=False, max_new_tokens=n)), n
        assert hf_ssd.last_stats(target).draft_path == "static"
    assert hf_ssd.last_stats(target).acceptance_rate > 0.95


def test_both_drafters_answer_the_generators_calls_with_the_same_signatures(draft):
    """The generator calls either drafter alike (no attribute sniffing): the same parameters, and the static path
    refuses, with an error, what its fixed-shape tree cannot do (it says so in defers_record)."""
    dyn, sta = pair_of_drafters(draft)
    for name in ("sync", "draft", "record", "candidate_tops", "start_tree", "tree_steps", "adopt", "release"):
        assert list(inspect.signature(getattr(dyn, name)).parameters) == \
            list(inspect.signature(getattr(sta, name)).parameters), name
    assert (dyn.path, dyn.defers_record) == ("dynamic", True)
    assert (sta.path, sta.defers_record) == ("static", False)
    context = prompt(4, 8)[0].tolist()
    sta.sync(context)
    outcomes = [Outcome(0, 5)]
    tree = sta.start_tree(len(context), outcomes)
    with pytest.raises(ValueError, match="fixed shape"):
        sta.tree_steps(tree, outcomes, 2, [1, 0, 0], lambda: False, last=(0, lambda top, first: (0.0, []), 1))
    sta.release()
