"""CUDA layouts: greedy exactness with layout="stream" (draft work on its own CUDA stream of the target's GPU),
a sampling smoke test, layout="device" with the draft on the CPU next to a GPU target (and on a second GPU
when there is one), and that neither the speculator thread nor pending work on its stream outlives `generate`.

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
import hf_ssd.generator as generator_mod
from hf_ssd import LayoutError, SSDConfig
from hf_ssd.speculator import Speculator

pytestmark = pytest.mark.cuda

NEW = 24
CASES = [(1, "sd"), (3, "short"), (4, "ar"), (5, "ngram"), (4, "sd")]  # (gamma, fallback)


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
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("gamma", "fallback"), CASES)
def test_stream_greedy_identical_to_target(gpu_target, gpu_drafts, speculators, seed, gamma, fallback):
    ids = prompt(seed)
    ref = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False)
    for name, draft in gpu_drafts.items():
        out = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                                  ssd_config=SSDConfig(gamma=gamma, fallback=fallback, layout="stream",
                                                       hit_rate_warning=0.0))
        assert out.tolist() == ref.tolist(), f"draft {name}"
        assert hf_ssd.last_stats(gpu_target).layout == "stream"
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
@pytest.mark.parametrize("layout", ["device", "auto"])
@pytest.mark.parametrize("seed", [0, 1])
def test_device_layout_cpu_draft_gpu_target(gpu_target, speculators, layout, seed):
    cpu_draft = noisy_copy(make_model(0), 0.005)  # stays on the CPU
    ids = prompt(seed)
    ref = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False)
    out = gpu_target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=cpu_draft,
                              ssd_config=SSDConfig(gamma=4, layout=layout, hit_rate_warning=0.0))
    assert out.tolist() == ref.tolist()
    assert out.device.type == "cuda"
    st = hf_ssd.last_stats(gpu_target)
    assert st.layout == "device" and st.lookups > 0
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
    out = target.generate(ids, max_new_tokens=32, do_sample=False, assistant_model=draft,
                          ssd_config=SSDConfig(layout="stream", hit_rate_warning=0.0))
    assert out.tolist() == ref.tolist()
    assert not speculator_threads()
