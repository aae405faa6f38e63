"""CUDA layouts: greedy exactness with layout="stream" (draft work on its own CUDA stream of the target's GPU)
for each draft path (dynamic, static eager, static with CUDA graphs: the default on CUDA), a sampling smoke
test and a chi-square test with graphs, layout="device" with the draft on the CPU next to a GPU target (and on
a second GPU when there is one), that neither the speculator thread nor pending work on its stream outlives
`generate`, and for the graphs: captured once per draft and reused across calls, no host sync inside the
steps of a round, a failed capture logged (auto) or raised (cuda_graphs=True).

The models are the float64 tiny Llamas of conftest moved to the GPU: float32 could flip near-ties between
verifying k tokens in one forward and decoding them one by one, which would be rounding, not an SSD bug.
Skipped without CUDA (conftest).
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import make_model, noisy_copy

import hf_ssd
import hf_ssd.loop.assisted as generator_mod
from hf_ssd import LayoutError, SSDConfig
from hf_ssd.speculation.speculator import Speculator

pytestmark = pytest.mark.cuda

NEW = 24
CASES = [(1, "sd"), (3, "short"), (4, "ar"), (5, "ngram"), (4, "sd")]  # (gamma, fallback)
PATHS = {"graphs": {}, "static": dict(cuda_graphs=False), "dynamic": dict(static_draft=False)}
PATH_NAMES = {"graphs": "static+graphs", "static": "static", "dynamic": "dynamic"}


class Injected(Exception):
    """Planted by a test hook; nothing else raises it."""


def speculator_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hf_ssd-speculator"]


def prompt(seed: int, length: int = 6, device="cuda") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 96, (1, length), generator=g).to(device)


@pytest.fixture(scope="module")
def gpu_target():
    model = make_model(0).to("cuda")
    hf_ssd.enable(model)
    return model


@pytest.fixture(scope="module")
def gpu_drafts(gpu_target):
    cpu_target = make_model(0)
    return {
        "close": noisy_copy(cpu_target, 0.005).to("cuda"),  # mostly hits the cache
        "noisy": noisy_copy(cpu_target, 0.05).to("cuda"),  # mostly misses: fallbacks run
    }


@pytest.fixture
def speculators(monkeypatch):
    """Every Speculator built during the test, to inspect its thread and stream afterwards."""
    made: list[Speculator] = []

    class Recording(Speculator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(generator_mod, "Speculator", Recording)
    return made


def assert_shut_down(made: list[Speculator]) -> None:
    assert made, "no speculator was built"
    assert not speculator_threads()
    for sp in made:
        assert sp._thread is None
        if sp.stream is not None:
            assert sp.stream.query(), "work is still pending on the speculator's CUDA stream"


# ----- stream layout ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("gamma", "fallback"), CASES)
def test_stream_greedy_identical_to_target(gpu_target, gpu_drafts, speculators, seed, gamma, fallback, path):
    ids = prompt(seed)
    ref = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False)
    for name, draft in gpu_drafts.items():
        out = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                                  ssd_config=SSDConfig(gamma=gamma, fallback=fallback, layout="stream",
                                                       hit_rate_warning=0.0, **PATHS[path]))
        assert out.tolist() == ref.tolist(), f"draft {name}"
        st = hf_ssd.last_stats(gpu_target)
        assert st.layout == "stream" and st.draft_path == PATH_NAMES[path]
    assert all(sp.stream is not None for sp in speculators)
    assert_shut_down(speculators)


def test_auto_picks_stream_on_one_gpu(gpu_target, gpu_drafts):
    ids = prompt(7)
    ref = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False)
    out = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=gpu_drafts["close"],
                              ssd_config=SSDConfig(layout="auto", hit_rate_warning=0.0))
    assert out.tolist() == ref.tolist()
    st = hf_ssd.last_stats(gpu_target)
    assert st.layout == "stream" and st.lookups > 0  # hits depend on timing: not asserted


def test_speculation_runs_on_the_side_stream(gpu_target, gpu_drafts, speculators):
    seen: list = []

    def hook():
        seen.append((threading.current_thread().name, torch.cuda.current_stream()))

    gpu_target.generate(prompt(3), max_new_tokens=NEW, do_sample=False, assistant_model=gpu_drafts["close"],
                        ssd_config=SSDConfig(layout="stream", hit_rate_warning=0.0), _ssd_hooks={"predict": hook})
    side = speculators[0].stream
    assert seen
    for name, stream in seen:
        assert name == "hf_ssd-speculator"
        assert stream == side and stream != torch.cuda.default_stream()
    assert_shut_down(speculators)


@pytest.mark.parametrize("stage", ["predict", "draft", "insert"])
def test_stream_fault_shuts_down(gpu_target, gpu_drafts, speculators, stage):
    def boom():
        raise Injected(stage)

    with pytest.raises(Injected):
        gpu_target.generate(prompt(4), max_new_tokens=NEW, do_sample=False, assistant_model=gpu_drafts["close"],
                            ssd_config=SSDConfig(layout="stream", hit_rate_warning=0.0), _ssd_hooks={stage: boom})
    assert_shut_down(speculators)
    ref = gpu_target.generate(prompt(4), max_new_tokens=8, do_sample=False)
    out = gpu_target.generate(prompt(4), max_new_tokens=8, do_sample=False, assistant_model=gpu_drafts["close"],
                              ssd_config=SSDConfig(layout="stream", hit_rate_warning=0.0))
    assert out.tolist() == ref.tolist()


def test_stream_sampling_smoke(gpu_target, gpu_drafts, speculators):
    ids = prompt(5)
    for seed in range(3):
        torch.manual_seed(seed)
        out = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=True, temperature=1.0,
                                  assistant_model=gpu_drafts["close"],
                                  ssd_config=SSDConfig(layout="stream", saguaro_c=0.5 if seed else None,
                                                       hit_rate_warning=0.0))
        assert out.shape[0] == 1 and 6 < out.shape[1] <= 6 + NEW
        assert out[0, :6].tolist() == ids[0].tolist()
        assert int(out.min()) >= 0 and int(out.max()) < 96
        st = hf_ssd.last_stats(gpu_target)
        assert st.layout == "stream" and st.rounds > 0 and 0 < st.new_tokens <= NEW
    assert_shut_down(speculators)


# ----- device layout ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("static", [None, True])
@pytest.mark.parametrize("layout", ["device", "auto"])
@pytest.mark.parametrize("seed", [0, 1])
def test_device_layout_cpu_draft_gpu_target(gpu_target, speculators, layout, seed, static):
    cpu_draft = noisy_copy(make_model(0), 0.005)  # stays on the CPU
    ids = prompt(seed)
    ref = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False)
    out = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=cpu_draft,
                              ssd_config=SSDConfig(gamma=4, layout=layout, hit_rate_warning=0.0,
                                                   static_draft=static))
    assert out.tolist() == ref.tolist()
    assert out.device.type == "cuda"
    st = hf_ssd.last_stats(gpu_target)
    assert st.layout == "device" and st.lookups > 0
    assert st.draft_path == ("static" if static else "dynamic")  # a CPU draft never uses graphs
    assert_shut_down(speculators)


def test_device_layout_cpu_draft_sampling_smoke(gpu_target):
    cpu_draft = noisy_copy(make_model(0), 0.005)
    torch.manual_seed(0)
    out = gpu_target.generate(prompt(2), max_new_tokens=NEW, do_sample=True, assistant_model=cpu_draft,
                              ssd_config=SSDConfig(layout="device", hit_rate_warning=0.0))
    assert out.device.type == "cuda" and out.shape[1] > 6
    assert not speculator_threads()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_device_layout_second_gpu(gpu_target, gpu_drafts, speculators):
    draft = noisy_copy(make_model(0), 0.005).to("cuda:1")
    ids = prompt(1)
    ref = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False)
    out = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                              ssd_config=SSDConfig(layout="auto", hit_rate_warning=0.0))
    assert out.tolist() == ref.tolist()
    assert hf_ssd.last_stats(gpu_target).layout == "device"
    assert hf_ssd.last_stats(gpu_target).draft_path == "static+graphs"  # captured and replayed on cuda:1
    assert_shut_down(speculators)


# ----- placement errors on a real GPU ----------------------------------------------------------------------------
def test_cuda_placement_errors(gpu_target, gpu_drafts):
    kw = dict(max_new_tokens=4, do_sample=False)
    cpu_draft = noisy_copy(make_model(0), 0.005)
    with pytest.raises(LayoutError, match="layout='stream' needs the draft on a CUDA device"):
        gpu_target.generate(prompt(0), assistant_model=cpu_draft, ssd_config=SSDConfig(layout="stream"), **kw)
    with pytest.raises(LayoutError, match="layout='thread'"):
        gpu_target.generate(prompt(0), assistant_model=gpu_drafts["close"], ssd_config=SSDConfig(layout="thread"),
                            **kw)
    with pytest.raises(LayoutError, match="layout='device' needs the draft on a device of its own"):
        gpu_target.generate(prompt(0), assistant_model=gpu_drafts["close"], ssd_config=SSDConfig(layout="device"),
                            **kw)
    assert not speculator_threads()


# ----- the SYNTHETIC pair on the GPU -------------------------------------------------------------------------------
def test_synthetic_pair_on_cuda_is_exact_in_float64():
    from hf_ssd.models.synthetic import LABEL, random_prompts, synthetic_pair

    target, draft = synthetic_pair("small", "tiny", agreement=0.8, dtype=torch.float64, device="cuda",
                                   vocab_size=512)
    assert target.synthetic_info.describe().startswith(LABEL)
    assert next(target.parameters()).device.type == "cuda"
    hf_ssd.enable(target)
    ids = random_prompts(1, 16, 512)[0].to("cuda")
    ref = target.generate(ids, max_new_tokens=32, do_sample=False)
    for graphs in (True, False):
        out = target.generate(ids, max_new_tokens=32, do_sample=False, assistant_model=draft,
                              ssd_config=SSDConfig(layout="stream", hit_rate_warning=0.0, cuda_graphs=graphs))
        assert out.tolist() == ref.tolist()
        assert hf_ssd.last_stats(target).draft_path == ("static+graphs" if graphs else "static")
    assert not speculator_threads()


# ----- CUDA graphs ------------------------------------------------------------------------------------------------
def fresh_draft(noise: float = 0.005):
    return noisy_copy(make_model(0), noise).to("cuda")


def test_graphs_captured_once_and_reused_across_calls(gpu_target, speculators):
    import hf_ssd.drafting.static as sd

    draft = fresh_draft()
    cfg = SSDConfig(layout="stream", hit_rate_warning=0.0, cuda_graphs=True)
    for seed in range(3):
        ids = prompt(seed)
        ref = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False)
        out = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft, ssd_config=cfg)
        assert out.tolist() == ref.tolist()
        assert hf_ssd.last_stats(gpu_target).draft_path == "static+graphs"
        state = sd._states[draft][True]
        if seed == 0:
            first, graphs = state, [state.trunk_step.graph] + [r.graph for _, r in state.trees.values()]
            replays = state.trunk_step.replays
        assert state is first and not state.busy
        assert [state.trunk_step.graph] + [r.graph for _, r in state.trees.values()] == graphs  # never recaptured
    assert state.trunk_step.captured and all(r.captured for _, r in state.trees.values())
    assert state.trunk_step.replays > replays and sum(r.replays for _, r in state.trees.values()) > 0
    assert_shut_down(speculators)


def test_no_host_sync_inside_draft_steps():
    """torch's sync debug mode errors on any synchronising call; only the end-of-round transfers are allowed."""
    import hf_ssd.drafting.static as sd
    from hf_ssd.speculation.outcomes import Outcome

    draft = fresh_draft()
    sta = sd.StaticDrafter(draft, None, True, 3, 0.5, torch.Generator(device="cuda").manual_seed(0), max_len=256,
                           rows=4, graphs=True, strict_graphs=True)
    context = prompt(1, 10, device="cpu")[0].tolist()
    sta.record(context, len(context) - 1)
    sta.candidate_tops(len(context), 0)
    real = sd.host_list

    def allowed(t):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real(t)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    sd.host_list = allowed
    event_sync = torch.cuda.Event.synchronize

    def between_steps(self):  # the tree loop waits for step j - 2 before step j: allowed, it is not in a step
        torch.cuda.set_sync_debug_mode(0)
        try:
            return event_sync(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    torch.cuda.Event.synchronize = between_steps
    try:
        torch.cuda.set_sync_debug_mode("error")
        result = sta.draft(context, 4, [2] * 5)
        outcomes = [Outcome(0, 5), Outcome(1, 6), Outcome(0, 7)]
        tree = sta.start_tree(len(context), outcomes)
        drafted = sta.tree_steps(tree, outcomes, 4, [2] * 5, lambda: False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        sd.host_list = real
        torch.cuda.Event.synchronize = event_sync
        sta.release()
    assert len(result.tokens) == 4
    assert all(len(r.tokens) == 4 and r.logits.shape == (4, 96) for _, r in drafted)
    assert sta.state.trunk_step.captured and sta.state.trunk_step.replays >= 3


def test_graph_capture_failure_logged_or_raised(gpu_target, caplog, monkeypatch):
    """A forward that syncs with the host cannot be captured: auto falls back to eager steps, True raises."""
    import functools
    import logging

    from hf_ssd import GraphCaptureError

    for strict in (False, True):
        draft = fresh_draft()
        forward = draft.forward

        @functools.wraps(forward)
        def syncing_forward(*args, _forward=forward, **kwargs):
            out = _forward(*args, **kwargs)
            out.logits.sum().item()  # a host sync: illegal while a stream is capturing
            return out

        monkeypatch.setattr(draft, "forward", syncing_forward)
        ids = prompt(3)
        cfg = SSDConfig(layout="stream", hit_rate_warning=0.0, cuda_graphs=True if strict else None)
        if strict:
            with pytest.raises(GraphCaptureError, match="could not capture the draft step"):
                gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft, ssd_config=cfg)
        else:
            ref = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="hf_ssd"):
                out = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                                          ssd_config=cfg)
            assert out.tolist() == ref.tolist()
            assert "capture of draft step" in caplog.text
            assert hf_ssd.last_stats(gpu_target).draft_path == "static"  # graphs asked for, none captured
        assert not speculator_threads()


def test_stream_graphs_sampling_matches_target_distribution():
    """The chi-square test of tests/test_sampling.py with the stream layout and graphs (false fail < 1e-4)."""
    from test_sampling import GEN, PROMPT, L, N, assert_matches_target, exact_joint, sampling_pair

    cpu_target, draft = sampling_pair()
    joint = exact_joint(cpu_target)
    target, draft = cpu_target.to("cuda"), draft.to("cuda")
    hf_ssd.enable(target)
    config = SSDConfig(gamma=2, fanout_budget=4, layout="stream", hit_rate_warning=0.0)
    torch.manual_seed(77)
    samples, hits = [], 0
    ids = torch.tensor([PROMPT], device="cuda")
    for _ in range(N):
        out = target.generate(ids, max_new_tokens=L, assistant_model=draft, ssd_config=config, **GEN)
        samples.append(tuple(out[0, len(PROMPT):].tolist()))
        st = hf_ssd.last_stats(target)
        assert st.draft_path == "static+graphs"
        hits += st.cache_hits
    assert hits > 0
    assert_matches_target(samples, joint, "graphs")


def test_graphs_under_inference_mode(gpu_target, speculators):
    """Pipelines and the CLI run generate under torch.inference_mode(); the speculator thread does not."""
    draft = fresh_draft()
    ids = prompt(6)
    ref = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False)
    for mode in (True, False, True):
        with torch.inference_mode(mode):
            out = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                                      ssd_config=SSDConfig(layout="stream", hit_rate_warning=0.0))
        assert out.tolist() == ref.tolist()
        assert hf_ssd.last_stats(gpu_target).draft_path == "static+graphs"
    assert_shut_down(speculators)


# ----- batched calls (hf_ssd/loop/) ----------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["auto", "fixed"])
def test_batched_rows_identical_to_target_on_cuda(gpu_target, gpu_drafts, schedule):
    """A left-padded batch of 4 on the GPU: each row is what the target alone generates (float64 models)."""
    g = torch.Generator().manual_seed(11)
    lengths = [6, 3, 5, 2]
    ids = torch.zeros(4, 6, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, 6 - n:] = torch.randint(2, 96, (n,), generator=g)
        mask[i, 6 - n:] = 1
    ids, mask = ids.cuda(), mask.cuda()
    config = SSDConfig(gamma=3, schedule=schedule, hit_rate_warning=0.0)
    out = gpu_target.generate(ids, attention_mask=mask, assistant_model=gpu_drafts["close"], do_sample=False,
                              max_new_tokens=NEW, ssd_config=config)
    for i, n in enumerate(lengths):
        alone = gpu_target.generate(ids[i : i + 1, 6 - n:], do_sample=False, max_new_tokens=NEW)[0, n:]
        assert out[i, 6 : 6 + alone.numel()].tolist() == alone.tolist(), i
    assert hf_ssd.last_stats(gpu_target).batch_size == 4
