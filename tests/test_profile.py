"""Tuning profiles (hf_ssd/scheduling/profile.py): the scheduler's measured costs saved per (target, draft, device, dtype,
threads, machine) and loaded by new processes. Every test writes under its own temporary cache
(HF_SSD_CACHE=tmp_path); the rest of the suite runs with profiles off (conftest)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_model, noisy_copy

import hf_ssd
from hf_ssd import SSDConfig
from hf_ssd.scheduling import profile
from hf_ssd.scheduling.costs import CostModel, estimates_of, reset_estimates
from hf_ssd.scheduling.schedule import Option, Scheduler, allowed_options

ROOT = Path(__file__).resolve().parents[1]
PROMPT = torch.tensor([[5, 6, 7, 8]])


@pytest.fixture
def profiles_on(monkeypatch, tmp_path):
    """Profiles on, in a temporary cache; returns the profile directory."""
    monkeypatch.delenv(profile.NO_PROFILE_ENV, raising=False)
    monkeypatch.delenv(profile.PROFILES_ENV, raising=False)
    monkeypatch.setenv(profile.CACHE_ENV, str(tmp_path))
    return tmp_path / "profiles"


@pytest.fixture(scope="module")
def pair():
    target = make_model(0)
    hf_ssd.enable(target)
    return target, noisy_copy(target, 0.01)


def call(target, draft, tokens: int = 16, **config):
    with torch.inference_mode():
        out = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=tokens,
                              min_new_tokens=tokens, do_sample=False, assistant_model=draft,
                              ssd_config=SSDConfig(hit_rate_warning=0.0, **config))
    stats = hf_ssd.last_stats(target)
    stats.output = out[0, PROMPT.shape[1]:].tolist()
    return stats


def measured(target, draft) -> list:
    """A fresh start (no estimates in this process), one call (the calibrated fan-out: its calibration is saved
    too), the profile saved: its path."""
    reset_estimates(target)
    call(target, draft, 24, fanout="calibrated")
    return profile.save(target, draft, source="test")


def json_round(data):
    return json.loads(json.dumps(data))


# ----- the state ------------------------------------------------------------------------------------------------


def test_state_round_trip_reproduces_estimates_and_decisions(pair, profiles_on):
    target, draft = pair
    reset_estimates(target)

    def filled(state) -> bool:
        return all(state[name] for name in ("verify_overlapped", "overhead", "misses", "expected_misses", "outcomes")) \
            and bool(state["verify_alone"]["points"] and state["tree_step"]["points"])

    # The measured model must exercise every table (else the round trip would prove little). Which options the
    # scheduler runs depends on this machine's timings: four default calls once ran no job step (no `tree_step`),
    # so calls go on until every table holds something, the last ones at the fixed option (SSD every round).
    for tokens, config in ((32, {}), (16, {}), (32, {}), (16, {"schedule": "fixed"}), (32, {"schedule": "fixed"})):
        call(target, draft, tokens, **config)
        [(_, costs)] = estimates_of(target, draft)
        state = json_round(costs.state_dict())
        if filled(state):
            break
    for name in ("verify_overlapped", "overhead", "misses", "expected_misses"):
        assert state[name], name
    assert state["verify_alone"]["points"] and state["tree_step"]["points"] and state["outcomes"]
    assert state["rounds_seen"] > 0
    # Every estimate of a CostModel is in the state (an estimate added later without it fails here).
    # plain_streak: a count of calls; plain_verdict: this process's early verdict from its own few rounds; work_s: this process's decode time (its warm-up); draft_share and
    # draft_step_hint: set from the models in each process (parameter counts, the draft's probe); totals and
    # call_start: this process's acceptance counts (each call's own, `call_acceptances`).
    constants = {"lock", "_memo", "rank_decay", "plain_streak", "plain_verdict", "loop_pending", "work_s", "draft_share", "draft_step_hint",
                 "totals", "call_start"}
    assert set(vars(CostModel(False, 9, 0.7))) - constants <= set(state)

    loaded = CostModel(costs.on_gpu, costs.top_k, 0.7)
    loaded.load_state_dict(state)
    assert json_round(loaded.state_dict()) == state
    config = SSDConfig()
    options = allowed_options(config, "thread", 1)
    default = Option("ssd", 4, 1)
    a = Scheduler(config, costs, options, default, inline=False, deferred_record=True)
    b = Scheduler(config, loaded, options, default, inline=False, deferred_record=True)
    for o in options:
        assert a.predict(o) == b.predict(o), o.name
    assert loaded.snapshot(4, [1, 2, 4, 8]) == costs.snapshot(4, [1, 2, 4, 8])
    assert [a.decide()[:3:2] for _ in range(40)] == [b.decide()[:3:2] for _ in range(40)]
    # Loaded estimates skip the first-call exploration a model from the priors runs.
    assert not b._queue
    cold = Scheduler(config, CostModel(False, costs.top_k, 0.7), options, default, inline=False)
    assert [o.name for o in cold._queue] == ["ssd(b=1,g=4)"] * 3 + ["ar", "sd(g=4)"]
    # ... and the warm-up: a profile's pair has drafted.
    assert Scheduler(config, CostModel(False, costs.top_k, 0.7), options, default, inline=False,
                     warmup_budget=0.03).warming
    assert not Scheduler(config, loaded, options, default, inline=False, warmup_budget=0.03).warming


def test_damaged_state_is_refused_and_leaves_the_model_alone(pair, profiles_on):
    target, draft = pair
    reset_estimates(target)
    call(target, draft)
    [(_, costs)] = estimates_of(target, draft)
    good = json_round(costs.state_dict())
    fresh = CostModel(False, costs.top_k, 0.7)
    before = json_round(fresh.state_dict())
    for damage in ({"ranks": [1.0]}, {"format": 99}, {"top_k": costs.top_k + 1}, {"accepted": float("nan")},
                   {"outcomes": [[{"kind": "ssd", "nope": 1}, [1, 2, 3, 4, 5]]]}, {"verify_alone": {"line": {}}}):
        with pytest.raises(ValueError):
            fresh.load_state_dict({**good, **damage})
        assert json_round(fresh.state_dict()) == before, damage
    bad = dict(good)
    del bad["positions"]
    with pytest.raises(ValueError):
        fresh.load_state_dict(bad)


# ----- save and load in a process -------------------------------------------------------------------------------


def test_saved_profile_is_loaded_by_new_estimates_and_reported(pair, profiles_on, caplog):
    target, draft = pair
    [path] = measured(target, draft)
    assert path.parent == profiles_on and path.suffix == ".json"
    assert path.name == f"{profile.profile_key(profile.profile_fields(target, draft))}.json"
    saved = json.loads(path.read_text())
    assert saved["versions"] == profile.versions() and saved["written_by"] == "test"
    [(name, entry)] = saved["entries"].items()
    assert name == "thread/greedy/top_k=65/draft_matmul=auto/verify_matmul=auto" and entry["calibration"]["bins"] == 10
    rounds = entry["costs"]["rounds_seen"]

    reset_estimates(target)  # as a new process: the pair's estimates are created again, from the profile
    with caplog.at_level(logging.INFO, logger="hf_ssd"):
        stats = call(target, draft)
    assert stats.profile == str(path)
    assert "profile loaded" in stats.summary() and path.name in stats.summary()
    assert stats.to_dict()["profile"] == str(path)
    assert f"loaded from tuning profile {path}" in caplog.text
    [(_, costs)] = estimates_of(target, draft)
    assert costs.rounds_seen >= rounds + stats.rounds - 1  # (a call's first round, the prefill, is not measured)
    reset_estimates(target)
    with profile.ignored():
        assert call(target, draft).profile is None
        assert "profile loaded" not in hf_ssd.last_stats(target).summary()


def test_profile_of_other_models_threads_versions_or_machine_is_not_used(pair, profiles_on, caplog):
    target, draft = pair
    [path] = measured(target, draft)
    reset_estimates(target)
    assert call(target, draft).profile == str(path)

    # Other models: the fingerprint reads the weights (same architecture, other noise: another key).
    other = noisy_copy(target, 0.01, seed=7)
    assert profile.model_fingerprint(other) != profile.model_fingerprint(draft)
    assert profile.model_fingerprint(noisy_copy(target, 0.01)) == profile.model_fingerprint(draft)
    assert call(target, other).profile is None
    # Other torch threads: the call runs at 2 (cpu_threads), the profile was measured at 1.
    reset_estimates(target)
    assert call(target, draft, cpu_threads=2).profile is None
    assert profile.profile_path(profile.profile_fields(target, draft, threads=2)) != path

    data = json.loads(path.read_text())
    # Other versions: found, refused, said.
    data["versions"]["torch"] = "0.0.1"
    path.write_text(json.dumps(data))
    reset_estimates(target)
    with caplog.at_level(logging.INFO, logger="hf_ssd"):
        assert call(target, draft).profile is None
    assert "written with torch 0.0.1" in caplog.text and "ignored" in caplog.text
    # Fields that do not match the file's name (another machine's file copied over, a collision).
    data["versions"] = profile.versions()
    data["fields"]["machine"]["cpus"] = (data["fields"]["machine"]["cpus"] or 0) + 1
    path.write_text(json.dumps(data))
    reset_estimates(target)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_ssd"):
        assert call(target, draft).profile is None
    assert "other models or another machine" in caplog.text


def test_no_profile_environment_variable_ignores_it_and_stops_writing(pair, profiles_on, monkeypatch):
    target, draft = pair
    [path] = measured(target, draft)
    monkeypatch.setenv(profile.NO_PROFILE_ENV, "1")
    reset_estimates(target)
    assert call(target, draft).profile is None
    before = path.read_bytes()
    call(target, draft)
    assert profile.save(target, draft) == [] and path.read_bytes() == before
    monkeypatch.setenv(profile.NO_PROFILE_ENV, "0")  # "0" or empty: on
    reset_estimates(target)
    assert call(target, draft).profile == str(path)


def test_damaged_profile_is_ignored_and_generation_stays_exact(pair, profiles_on, caplog):
    target, draft = pair
    [path] = measured(target, draft)
    reference = target.generate(PROMPT, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, 4:].tolist()
    good = json.loads(path.read_text())
    name = next(iter(good["entries"]))
    broken_state = json.loads(path.read_text())
    broken_state["entries"][name]["costs"]["ranks"] = [1.0, 2.0]
    broken_calibration = json.loads(path.read_text())
    broken_calibration["entries"][name]["calibration"] = {"bins": 10, "accepted": [1.0], "tried": [1.0]}
    for text, said in ((path.read_text()[:200], "damaged"), ("", "damaged"), ("[1, 2]", "damaged"),
                       (json.dumps(broken_state), "not used")):
        path.write_text(text)
        reset_estimates(target)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_ssd"):
            stats = call(target, draft)
        assert stats.profile is None and said in caplog.text, text[:40]
        assert stats.output == reference
        [(_, costs)] = estimates_of(target, draft)
        assert costs.rounds_seen <= stats.rounds  # from the priors
    # A damaged calibration alone: the costs are still used.
    path.write_text(json.dumps(broken_calibration))
    reset_estimates(target)
    assert call(target, draft).profile == str(path)


def test_save_is_atomic_and_keeps_other_entries(pair, profiles_on, monkeypatch):
    target, draft = pair
    [path] = measured(target, draft)
    data = json.loads(path.read_text())
    data["entries"]["thread/sample/top_k=65/draft_matmul=auto/verify_matmul=auto"] = data["entries"]["thread/greedy/top_k=65/draft_matmul=auto/verify_matmul=auto"]
    path.write_text(json.dumps(data))
    before = path.read_bytes()

    def boom(fd):
        raise OSError("disk full")

    with monkeypatch.context() as m, pytest.raises(OSError, match="disk full"):
        m.setattr(os, "fsync", boom)  # the write fails after the data went into the temporary file
        profile.save(target, draft)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left
    assert profile.save(target, draft) == [path]
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert set(json.loads(path.read_text())["entries"]) == set(data["entries"])  # the sampling entry kept


def test_a_passed_probe_is_remembered_across_processes(profiles_on, monkeypatch):
    """The draft probe's verdict and step time are kept on disk (beside the profiles): a later process with the
    same draft skips the probe's forwards; another draft, or profiles off, runs it."""
    from hf_ssd.drafting import probe

    runs = []
    real = probe._run_probe
    monkeypatch.setattr(probe, "_run_probe", lambda m: (runs.append(m), real(m)))
    model, other = make_model(5), make_model(6)
    probe.probe_draft(model)
    step = probe.step_seconds(model)
    assert len(runs) == 1 and step > 0
    assert [p.suffix for p in (profiles_on.parent / "probes").iterdir()] == [".json"]
    probe._probed.clear()  # what a new process starts with
    probe.probe_draft(model)
    assert len(runs) == 1 and probe.step_seconds(model) == pytest.approx(step)
    probe.probe_draft(other)  # other weights: its own probe
    assert len(runs) == 2
    # A verdict saved by an earlier version timed another kind of forward: the probe runs again, once, and its
    # record is rewritten with this version's step.
    saved = next(p for p in (profiles_on.parent / "probes").iterdir() if json.loads(p.read_text())["step_s"] == step)
    saved.write_text(json.dumps({"passed": True, "step_s": 0.5}))
    probe._probed.clear()
    probe.probe_draft(model)
    assert len(runs) == 3 and probe.step_seconds(model) not in (None, 0.5)
    assert json.loads(saved.read_text())["step"] == probe.STEP_KIND
    probe._probed.clear()
    probe.probe_draft(model)
    assert len(runs) == 3 and probe.step_seconds(model) == pytest.approx(json.loads(saved.read_text())["step_s"])
    monkeypatch.setenv(profile.NO_PROFILE_ENV, "1")
    probe._probed.clear()
    probe.probe_draft(model)
    assert len(runs) == 4


# ----- fresh processes and the command line ---------------------------------------------------------------------

CHILD = """
import json, torch, hf_ssd
from hf_ssd import SSDConfig
from hf_ssd.models.tiny import tiny_pair
torch.set_num_threads(1)
target, draft, _ = tiny_pair()
hf_ssd.enable(target)
ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
with torch.inference_mode():
    target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                    do_sample=False, assistant_model=draft,
                    ssd_config=SSDConfig(hit_rate_warning=0.0, record_timeline=True))
s = hf_ssd.last_stats(target)
rounds = [e["option"] for e in s.timeline if e["option"] != "prefill"]  # the loop's first round: the prompt's
print(json.dumps({"options": len({n for n, *_ in s.option_shares()} - {"prefill"}), "first_5": rounds[:5],
                  "explored": s.explored_rounds, "profile": s.profile, "warming": s.warming_up}))
"""


def test_fresh_process_starts_from_the_profile_hf_ssd_tune_wrote(tmp_path):
    env = {**os.environ, profile.CACHE_ENV: str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop(profile.NO_PROFILE_ENV, None)
    env.pop(profile.PROFILES_ENV, None)
    tune = [sys.executable, "-m", "hf_ssd.cli", "tune", "--tiny", "--num-prompts", "1", "--max-new-tokens", "16",
            "--gammas", "2,4", "--budgets", "1,4", "--no-progress"]
    out = subprocess.run(tune, env=env, capture_output=True, text=True, check=True).stdout
    [path] = (tmp_path / "profiles").glob("*.json")
    assert f"tuning profile written to {path}" in out
    # tune's call that tries every family once measured confidence-stopped SD, which its own options (AR, SD and
    # SSD without a stop) leave out. (16 new tokens: in 8, every such round, up to 16 tokens, is cut by the length
    # left, and a capped round does not rate its option: `Round.typical`.)
    [entry] = json.loads(path.read_text())["entries"].values()
    assert any(o["stop"] > 0 for o, _ in entry["costs"]["outcomes"]), entry["costs"]["outcomes"]

    def child(**extra) -> dict:
        done = subprocess.run([sys.executable, "-c", CHILD], env={**env, **extra}, capture_output=True, text=True,
                              check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    informed, cold = child(), child(**{profile.NO_PROFILE_ENV: "1"})
    assert informed["profile"] == str(path) and cold["profile"] is None
    # Without the profile the short first call stays in the warm-up (the target alone: learning would cost more
    # than 3% of it); with it, the call starts past the warm-up from the best predicted option.
    assert cold["first_5"] == ["ar"] * 5 and cold["warming"] and cold["options"] == 1, cold
    assert not informed["warming"], informed


def test_cli_no_profile_flag_and_tune_reports_its_profile(profiles_on, capsys):
    from hf_ssd.cli import main

    small = ["--tiny", "--num-prompts", "1", "--max-new-tokens", "6", "--gammas", "2", "--budgets", "1",
             "--no-progress"]
    reports = []
    for extra in ([], [], ["--no-profile"]):
        json_path = profiles_on.parent / "tune.json"
        assert main(["tune", *small, "--json", str(json_path), *extra]) == 0
        out = capsys.readouterr().out
        reports.append(json.loads(json_path.read_text())["profile"])
        assert f"tuning profile written to {reports[-1]['written']}" in out
    [path] = profiles_on.glob("*.json")
    assert [r["written"] for r in reports] == [str(path)] * 3
    # The second tune started from the first one's profile; --no-profile from the priors.
    assert [r["loaded"] for r in reports] == [None, str(path), None]

    generate = ["generate", "--tiny", "--prompt-ids", "5,6,7,8", "--max-new-tokens", "6"]
    assert main(generate) == 0
    assert "profile loaded" in capsys.readouterr().out
    assert main([*generate, "--no-profile"]) == 0
    assert "profile loaded" not in capsys.readouterr().out


def test_tune_help_states_its_duration_and_the_profile():
    from hf_ssd.cli import build_parser

    tune = build_parser()._subparsers._group_actions[0].choices["tune"]
    text = " ".join(tune.format_help().split())
    assert "minutes on a 2-core CPU with the default pair" in text
    assert "profiles/<key>.json" in text and "--no-profile" in text and "HF_SSD_NO_PROFILE=1" in text


def test_tune_says_in_words_when_the_target_alone_is_best():
    from hf_ssd.bench.tune import recommendation_words, render

    report = {
        "mode": "greedy", "prompts": 1, "max_new_tokens": 8, "device": "cpu", "layout": "thread", "cost_model": {},
        "options": [{"option": "ar", "measured_tok_s": 9.0, "predicted_tok_s": 8.0}],
        "auto": {"measured_tok_s": 8.5, "schedule": "schedule auto: ar 100% of round time"},
        "greedy_identical": True,
        "recommended": {"option": "ar", "measured_tok_s": 9.0, "ssd_config": {},
                        "advice": recommendation_words(Option("ar"))},
        "profile": {"loaded": None, "written": None, "error": "HF_SSD_NO_PROFILE is set"},
    }
    text = render(report)
    assert "recommended: run the target alone (no SSD)" in text and "SSDConfig(**{})" not in text
    assert "tuning profile not written (HF_SSD_NO_PROFILE is set)" in text
    assert recommendation_words(Option("ssd", 4, 2)).startswith("SSDConfig(gamma=4, fanout_budget=2)")
