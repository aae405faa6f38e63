"""Layouts on CPU: what `auto` picks, the errors for impossible placements (devices mocked where CUDA is
missing), greedy exactness in every layout that runs on CPU, shutdown of the speculator thread, the per-call
torch thread settings, and the SYNTHETIC pair and layout benchmark used on the GPU machine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import noisy_copy
from transformers import LlamaForCausalLM

import hf_ssd
from hf_ssd import LayoutError, SSDConfig
from hf_ssd import layouts as layouts_mod
from hf_ssd.layouts import resolve_layout
from hf_ssd.models.synthetic import LABEL, SHAPES, parse_pair, random_prompts, synthetic_pair

NEW = 20
CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


class Injected(Exception):
    """Planted by a test hook; nothing else raises it."""


def speculator_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hf_ssd-speculator"]


@pytest.fixture(scope="module")
def close_draft(target):
    return noisy_copy(target, 0.005)


@pytest.fixture
def fake_devices(monkeypatch):
    """Pretend the models sit on the given devices: `fake_devices(target_devs, draft_devs)`."""

    def place(target, draft, t_devs, d_devs):
        table = {id(target): set(t_devs), id(draft): set(d_devs)}
        monkeypatch.setattr(layouts_mod, "model_devices", lambda m: table[id(m)])

    return place


@pytest.fixture
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # not the 1 thread that the thread layout gives each side on this machine
    yield 2
    torch.set_num_threads(before)


def prompt(seed: int, length: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 96, (1, length), generator=g)


# ----- selection ---------------------------------------------------------------------------------------------
def test_auto_is_thread_on_cpu(target, close_draft):
    assert resolve_layout("auto", target, close_draft) == "thread"
    target.generate(prompt(0), max_new_tokens=8, do_sample=False, assistant_model=close_draft,
                    ssd_config=SSDConfig(layout="auto", hit_rate_warning=0.0))
    assert hf_ssd.last_stats(target).layout == "thread"


@pytest.mark.parametrize("layout", ["thread", "inline"])
def test_explicit_cpu_layouts_are_kept(target, close_draft, layout):
    assert resolve_layout(layout, target, close_draft) == layout


@pytest.mark.parametrize(
    ("t_devs", "d_devs", "expected"),
    [
        ([CUDA0], [CUDA0], "stream"),  # one GPU: own CUDA stream
        ([CUDA0], [CPU], "device"),  # GPU target, CPU draft
        ([CUDA0], [CUDA1], "device"),  # a GPU each
        ([CPU], [CPU], "thread"),
    ],
)
def test_auto_choice_by_placement(target, close_draft, fake_devices, t_devs, d_devs, expected):
    fake_devices(target, close_draft, t_devs, d_devs)
    assert resolve_layout("auto", target, close_draft) == expected


# ----- errors ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is missing")
def test_stream_without_cuda_is_a_clear_error(target, close_draft):
    with pytest.raises(LayoutError, match=r"layout='stream' needs the draft on a CUDA device.*'thread' or 'auto'"):
        target.generate(prompt(0), max_new_tokens=4, do_sample=False, assistant_model=close_draft,
                        ssd_config=SSDConfig(layout="stream"))
    assert not speculator_threads()
    # The error is raised before generation starts: the model works normally right after.
    ref = target.generate(prompt(0), max_new_tokens=4, do_sample=False)
    out = target.generate(prompt(0), max_new_tokens=4, do_sample=False, assistant_model=close_draft,
                          ssd_config=SSDConfig(layout="auto", hit_rate_warning=0.0))
    assert out.tolist() == ref.tolist()


def test_layout_error_is_a_value_error():
    assert issubclass(LayoutError, ValueError)


def test_thread_layout_with_cuda_draft(target, close_draft, fake_devices):
    fake_devices(target, close_draft, [CUDA0], [CUDA0])
    with pytest.raises(LayoutError, match=r"layout='thread'.*draft is on CUDA.*'stream'.*'device'"):
        resolve_layout("thread", target, close_draft)


@pytest.mark.parametrize("layout", ["auto", "thread", "stream", "device", "inline"])
def test_draft_spread_over_devices(target, close_draft, fake_devices, layout):
    fake_devices(target, close_draft, [CUDA0], [CPU, CUDA0])
    with pytest.raises(LayoutError, match=r"spread over.*device_map=\{'': device\}"):
        resolve_layout(layout, target, close_draft)


def test_device_layout_when_draft_shares_the_target_device(target, close_draft):
    with pytest.raises(LayoutError, match=r"layout='device' needs the draft on a device of its own"):
        target.generate(prompt(0), max_new_tokens=4, do_sample=False, assistant_model=close_draft,
                        ssd_config=SSDConfig(layout="device"))
    assert not speculator_threads()


def test_device_layout_on_a_shared_gpu(target, close_draft, fake_devices):
    fake_devices(target, close_draft, [CUDA0], [CUDA0])
    with pytest.raises(LayoutError, match="'stream' on one GPU"):
        resolve_layout("device", target, close_draft)


def test_stream_layout_across_devices(target, close_draft, fake_devices, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake_devices(target, close_draft, [CUDA0], [CUDA1])
    with pytest.raises(LayoutError, match=r"same GPU.*layout='device'"):
        resolve_layout("stream", target, close_draft)
    fake_devices(target, close_draft, [CUDA0], [CUDA0])
    assert resolve_layout("stream", target, close_draft) == "stream"


def test_device_layout_accepted_for_a_cpu_draft_next_to_a_gpu(target, close_draft, fake_devices):
    fake_devices(target, close_draft, [CUDA0], [CPU])
    assert resolve_layout("device", target, close_draft) == "device"


# ----- exactness in every CPU layout -------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["thread", "inline", "auto"])
@pytest.mark.parametrize(("seed", "gamma", "fallback"), [(0, 4, "sd"), (1, 2, "short"), (2, 5, "ngram")])
def test_greedy_identical_in_cpu_layouts(target, close_draft, draft, layout, seed, gamma, fallback):
    ids = prompt(seed)
    ref = target.generate(ids, max_new_tokens=NEW, do_sample=False)
    for d in (close_draft, draft):  # a draft that mostly agrees, and one that mostly does not
        out = target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=d,
                              ssd_config=SSDConfig(gamma=gamma, fallback=fallback, layout=layout,
                                                   hit_rate_warning=0.0))
        assert out.tolist() == ref.tolist()
        assert hf_ssd.last_stats(target).layout == ("thread" if layout == "auto" else layout)
    assert not speculator_threads()


# ----- where the speculator runs, thread settings, shutdown ---------------------------------------------------
def _record_where(seen: list):
    def hook():
        seen.append((threading.current_thread().name, torch.get_num_threads()))
    return hook


def test_thread_layout_runs_speculator_in_its_thread_with_its_threads(target, close_draft, two_torch_threads):
    seen: list = []
    target.generate(prompt(3), max_new_tokens=NEW, do_sample=False, assistant_model=close_draft,
                    ssd_config=SSDConfig(layout="thread", cpu_threads=1, hit_rate_warning=0.0),
                    _ssd_hooks={"predict": _record_where(seen)})
    assert seen and all(s == ("hf_ssd-speculator", 1) for s in seen)
    assert torch.get_num_threads() == two_torch_threads  # restored after the call
    assert not speculator_threads()


def test_inline_layout_runs_on_the_callers_thread(target, close_draft, two_torch_threads):
    seen: list = []
    target.generate(prompt(3), max_new_tokens=NEW, do_sample=False, assistant_model=close_draft,
                    ssd_config=SSDConfig(layout="inline", hit_rate_warning=0.0),
                    _ssd_hooks={"predict": _record_where(seen)})
    main = threading.current_thread().name
    assert seen and all(s == (main, two_torch_threads) for s in seen)  # inline leaves thread settings alone
    assert not speculator_threads()


def test_default_cpu_threads_follow_the_torch_setting():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert layouts_mod.default_cpu_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("layout", ["thread", "inline"])
@pytest.mark.parametrize("stage", ["predict", "draft", "insert"])
def test_no_speculator_thread_outlives_a_failed_call(target, close_draft, two_torch_threads, layout, stage):
    def boom():
        raise Injected(stage)

    with pytest.raises(Injected):
        target.generate(prompt(4), max_new_tokens=NEW, do_sample=False, assistant_model=close_draft,
                        ssd_config=SSDConfig(layout=layout, cpu_threads=1, hit_rate_warning=0.0),
                        _ssd_hooks={stage: boom})
    assert not speculator_threads()
    assert torch.get_num_threads() == two_torch_threads
    # The models are fine afterwards.
    ref = target.generate(prompt(4), max_new_tokens=8, do_sample=False)
    out = target.generate(prompt(4), max_new_tokens=8, do_sample=False, assistant_model=close_draft,
                          ssd_config=SSDConfig(layout=layout, hit_rate_warning=0.0))
    assert out.tolist() == ref.tolist()
    assert not speculator_threads()


def test_no_speculator_thread_outlives_successful_calls(target, close_draft, two_torch_threads):
    for _ in range(3):
        target.generate(prompt(5), max_new_tokens=NEW, do_sample=False, assistant_model=close_draft,
                        ssd_config=SSDConfig(layout="thread", hit_rate_warning=0.0))
        assert not speculator_threads()
        assert torch.get_num_threads() == two_torch_threads


# ----- the SYNTHETIC pair ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def synthetic_tiny():
    return synthetic_pair("tiny", "tiny", agreement=0.8, dtype=torch.float64, device="cpu", vocab_size=256, seed=3)


def test_synthetic_pair_is_labelled_and_calibrated(synthetic_tiny):
    target, draft = synthetic_tiny
    info = target.synthetic_info
    assert info is draft.synthetic_info
    assert info.describe().startswith(LABEL)
    assert info.to_dict()["label"] == LABEL
    assert target.config.name_or_path.startswith(LABEL) and draft.config.name_or_path.startswith(LABEL)
    assert abs(info.measured_agreement - 0.8) < 0.05
    assert all(p.dtype == torch.float64 for p in target.parameters())


def test_synthetic_agreement_one_is_identical_argmax():
    target, draft = synthetic_pair("small", "tiny", agreement=1.0, dtype=torch.float64, device="cpu",
                                   vocab_size=128, calibration_tokens=128)
    assert target.synthetic_info.measured_agreement == 1.0


def test_synthetic_weights_behave_like_a_normal_model(synthetic_tiny):
    """Skipping transformers' init must not leave anything (e.g. rotary buffers) unset."""
    target, _ = synthetic_tiny
    fresh = LlamaForCausalLM(target.config).double().eval()
    fresh.load_state_dict(target.state_dict())
    ids = random_prompts(1, 12, 256)[0]
    with torch.no_grad():
        torch.testing.assert_close(target(ids).logits, fresh(ids).logits)


def test_synthetic_greedy_ssd_is_exact(synthetic_tiny):
    target, draft = synthetic_tiny
    hf_ssd.enable(target)
    ids = random_prompts(1, 8, 256, seed=1)[0]
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    assert ref.shape[1] == 8 + 24  # special tokens never win the argmax: no early EOS
    out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft,
                          ssd_config=SSDConfig(gamma=4, hit_rate_warning=0.0))
    assert out.tolist() == ref.tolist()
    assert hf_ssd.last_stats(target).accepted_tokens > 0


def test_synthetic_argument_errors():
    assert parse_pair("1b-8b") == ("1b", "8b")
    assert parse_pair("tiny") == ("tiny", "small")
    assert {"tiny", "small", "1b", "8b"} <= set(SHAPES)
    with pytest.raises(ValueError, match="Unknown synthetic pair"):
        parse_pair("2b-9b")
    with pytest.raises(ValueError, match="must not be wider"):
        synthetic_pair("tiny", "small", device="cpu", dtype=torch.float32, vocab_size=64)
    with pytest.raises(ValueError, match="Unknown synthetic shape"):
        synthetic_pair("70b", "tiny", device="cpu", dtype=torch.float32, vocab_size=64)
    with pytest.raises(ValueError, match="agreement"):
        synthetic_pair("tiny", "tiny", agreement=1.5, device="cpu", dtype=torch.float32, vocab_size=64)


# ----- the layout benchmark script ---------------------------------------------------------------------------
def _load_script(name: str):
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executed
    spec.loader.exec_module(module)
    return module


def test_layout_bench_smoke(tmp_path, capsys):
    bench = _load_script("layout_bench")
    out_json = tmp_path / "bench.json"
    rc = bench.main(["--device", "cpu", "--shape", "tiny-tiny", "--vocab-size", "256", "--prompts", "1",
                     "--prompt-len", "8", "--max-new-tokens", "8", "--dtype", "float64", "--json", str(out_json)])
    assert rc == 0
    text = capsys.readouterr().out
    table = text[text.rindex("**SYNTHETIC"):]  # the markdown table comes last
    for name in ("| AR |", "| SSD inline | inline |", "| SSD auto | thread |"):
        assert name in table
    assert table.count("| 1/1 |") == 4  # AR, SD, inline, auto: all identical to AR (float64)
    data = json.loads(out_json.read_text())
    assert data["label"] == LABEL and len(data["rows"]) == 4
    assert not speculator_threads()


def test_layout_bench_markdown_labels_synthetic():
    bench = _load_script("layout_bench")
    rows = [{"method": "SSD inline", "layout": "inline", "tok_s": 10.0, "identical": "1/1", "acceptance": 0.5,
             "hit_rate": 0.5, "bubble": 1.0, "verify_s": 1.0, "speculate_s": 1.0, "wait_s": 1.0},
            {"method": "AR", "layout": "-", "tok_s": 5.0, "identical": "1/1"}]
    text = bench.markdown(rows, f"{LABEL} test")
    assert LABEL in text.splitlines()[0] and LABEL in text.splitlines()[-1]
    assert "| AR | - | - | 5.0 | 0.50x | - |" in text


# ----- the GPU check script -----------------------------------------------------------------------------------
GPU_CHECK = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_gpu_check_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(GPU_CHECK)], capture_output=True).returncode == 0
    usage = subprocess.run(["bash", str(GPU_CHECK), "--help"], capture_output=True, text=True)
    assert usage.returncode == 0 and "--cpu-dry-run" in usage.stdout
    bad = subprocess.run(["bash", str(GPU_CHECK), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown option" in bad.stderr


@pytest.mark.slow
def test_gpu_check_cpu_dry_run(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path)}
    run = subprocess.run(["bash", str(GPU_CHECK), "--cpu-dry-run"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "SKIPPED: GPU only" in run.stdout
    assert run.stdout.rstrip().splitlines()[-1].startswith("(SYNTHETIC models")  # the table comes last
