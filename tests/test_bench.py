"""The benchmark harness: the local `evaluate` metric, prompt loading, the paper's speedup model, and an
end-to-end `hf-ssd bench --tiny` run."""

from __future__ import annotations

import json

import datasets
import pytest

from hf_ssd.bench import (
    CallResult,
    Method,
    MethodRun,
    assistant_settings,
    bench_methods,
    check_identical,
    load_metric,
    predicted_speedups,
)
from hf_ssd.bench.prompts import PromptsError, extract_number, load_prompts
from hf_ssd.cli import main


@pytest.fixture(scope="module")
def metric():
    return load_metric()


def test_metric_loads_locally_and_scores_token_sequences(metric):
    r = metric.compute(predictions=[[1, 2, 3], [4, 5, 6], [7, 8]], references=[[1, 2, 3], [4, 9, 6], [7, 8, 9]])
    assert r["exact_match"] == pytest.approx(1 / 3)
    assert r["num_mismatches"] == 2
    assert r["mismatch_indices"] == [1, 2]
    assert r["first_divergence"] == [-1, 1, 2]  # a shorter output diverges where it stops
    assert metric.compute(predictions=[[5, 6]], references=[[5, 6]])["exact_match"] == 1.0


def test_metric_scores_strings(metric):
    r = metric.compute(predictions=["72", "3", "10"], references=["72", "4", "10"])
    assert r["exact_match"] == pytest.approx(2 / 3)
    assert r["mismatch_indices"] == [1]


def test_check_identical_flags_a_mismatching_method(metric):
    ar, ssd = MethodRun(Method("ar", "ar")), MethodRun(Method("ssd_g2", "ssd", 2, "auto"))
    for a, s in (([1, 2, 3], [1, 2, 3]), ([4, 5], [4, 6])):
        ar.add(CallResult(a, 0.1))
        ssd.add(CallResult(s, 0.1))
    check = check_identical(metric, {"ar": ar, "ssd_g2": ssd})
    assert check["ssd_g2"]["num_mismatches"] == 1 and check["ssd_g2"]["first_divergence"] == [-1, 1]


def test_predicted_speedup_follows_the_paper_formula():
    ssd = {"rounds": 10, "mean_accepted": 2.0, "hit_rate": 0.75, "T_v": 0.10, "T_s": 0.08, "T_fb": 0.04}
    pred_ssd, pred_sd = predicted_speedups(ssd, t_ar_token=0.05)
    # E = 3; per round 0.75 * max(0.10, 0.08) + 0.25 * (0.04 + 0.10) = 0.11
    assert pred_ssd == pytest.approx(3 / 0.11 * 0.05)
    assert pred_sd == pytest.approx(3 / 0.14 * 0.05)
    assert predicted_speedups({}, 0.05) == (None, None)


def test_bench_methods_and_assistant_settings_restore():
    names = [m.name for m in bench_methods([2, 4, 6])]
    assert names == ["ar", "assisted", "assisted_g2", "assisted_g4", "assisted_g6", "ssd", "ssd_g2", "ssd_g4", "ssd_g6",
                     "ssd_g4_inline"]

    class GC:
        num_assistant_tokens = 20

    class Draft:
        generation_config = GC()

    d = Draft()
    with assistant_settings(d, num_assistant_tokens=4, assistant_confidence_threshold=0.0):
        assert d.generation_config.num_assistant_tokens == 4
    assert d.generation_config.num_assistant_tokens == 20
    assert d.generation_config.assistant_confidence_threshold is None


def test_prompts_from_files_and_builtin_sets(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": "4"}\n')
    (tmp_path / "p.csv").write_text("prompt\nhello\nworld\n")
    datasets.Dataset.from_list([{"text": "a"}, {"text": "b"}, {"text": "c"}]).save_to_disk(str(tmp_path / "disk"))
    name, ds = load_prompts(str(tmp_path / "p.jsonl"))
    assert name == "p" and ds["prompt"] == ["1+1?", "2+2?"] and ds["kind"] == ["math", "math"]
    assert [extract_number(r) for r in ds["reference"]] == ["2", "4"]
    assert load_prompts(str(tmp_path / "p.csv"), num_prompts=1)[1]["prompt"] == ["hello"]
    assert load_prompts(str(tmp_path / "disk"), num_prompts=2)[1]["kind"] == ["text", "text"]
    name, ds = load_prompts("humaneval", num_prompts=2)
    assert len(ds) == 2 and ds[0]["id"] == "HumanEval/0" and ds[0]["kind"] == "code"
    name, ds = load_prompts("gsm8k", num_prompts=2)
    assert name == "gsm" and len(ds) == 2 and all(extract_number(r) for r in ds["reference"])
    with pytest.raises(PromptsError):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_extract_number():
    assert extract_number("so the total is 1,200.50.") == "1200.5"
    assert extract_number("first 3 then 4") == "4"
    assert extract_number("#### -7") == "-7"
    assert extract_number("12.0") == "12"
    assert extract_number("no digits") == ""


def test_bench_tiny_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", "--tiny", "--num-prompts", "2", "--max-new-tokens", "8", "--gammas", "2,4", "--out", str(out),
            "--no-progress", "--modes", "greedy,sample"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| method | tok/s |" in printed and "greedy outputs identical" in printed
    assert "estimated" in printed and " on this machine" in printed  # said before the run starts
    assert printed.index("estimated") < printed.index("| method | tok/s |")
    results = json.loads((out / "results.json").read_text())
    assert results["greedy_identical"] is True
    assert results["environment"]["torch"] and results["environment"]["transformers"]
    methods = {r["method"] for r in results["results"]}
    assert {"ar", "assisted", "assisted_g2", "assisted_g4", "ssd_g2", "ssd_g4", "ssd_g4_inline"} <= methods
    assert {(r["dataset"], r["mode"]) for r in results["results"]} == {
        ("humaneval", "greedy"), ("humaneval", "sample"), ("gsm", "greedy"), ("gsm", "sample")}
    for r in results["results"]:
        assert r["new_tokens"] > 0 and r["tokens_per_second"] > 0
        if r["kind"] == "ssd":
            assert 0 <= r["hit_rate"] <= 1 and 0 <= r["acceptance_rate"] <= 1 and r["predicted_speedup"] is not None
    assert set(results["greedy_check"]) == {"humaneval", "gsm"}
    assert all(c["exact_match"] == 1.0 for checks in results["greedy_check"].values() for c in checks.values())
    assert set(results["gsm_accuracy"]["gsm"]) == {"greedy", "sample"}
    md = (out / "results.md").read_text()
    assert "speedup vs best assisted" in md and "token-identical to AR" in md and "T_ar_token" in md
    assert "humaneval: 2 prompts, gsm: 2 prompts" in md and "greedy and sampling at T=0.7" in md
    # 8 tokens cannot hold a GSM answer: the accuracy table says the outputs were cut off.
    assert all(n > 0 for n in results["cut_off"]["gsm"]["greedy"].values())
    assert "cut²" in md and "max_new_tokens=8" in md
    for png in ("tok_s.png", "ssd_hit_acceptance.png", "speedup_vs_gamma.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    check_figures(results)


def check_figures(results):
    """Plots that do not flatter: y from zero, every baseline drawn, the sample size written on the figure."""
    from hf_ssd.bench.runner import figures

    figs = figures(results)
    for name, fig in figs.items():
        texts = [fig._suptitle.get_text() if fig._suptitle else ""] + [ax.get_title() for ax in fig.axes]
        assert any("prompts:" in t and "SSD rounds" in t for t in texts), (name, texts)
        for ax in fig.axes:
            assert ax.get_ylim()[0] == 0, (name, ax.get_ylim())
    for ax in figs["speedup_vs_gamma"].axes:
        labels = set(ax.get_legend_handles_labels()[1])
        assert {"AR (target alone)", "assisted (defaults)", "best assisted", "SSD measured"} <= labels, labels
        assert ax.get_ylim()[1] >= max(r["speedup_vs_ar"] for r in results["results"] if r["speedup_vs_ar"])


def test_bench_defaults_are_the_quick_setting_and_full_is_larger():
    from hf_ssd.cli import BENCH_FULL, BENCH_QUICK, bench_setting, build_parser

    parser = build_parser()
    quick = bench_setting(parser.parse_args(["bench"]))
    full = bench_setting(parser.parse_args(["bench", "--full"]))
    assert quick == BENCH_QUICK and full == BENCH_FULL
    size = lambda s: s["num_prompts"] * s["max_new_tokens"] * len(s["modes"]) * len(s["gammas"])  # noqa: E731
    assert size(full) > 10 * size(quick)
    # An explicit option wins over either setting.
    assert bench_setting(parser.parse_args(["bench", "--full", "--num-prompts", "3"]))["num_prompts"] == 3


def test_header_says_only_what_ran():
    from hf_ssd.bench import FORMULA, render_markdown

    results = {
        "environment": {"target": "t", "draft": "d", "device": "cpu", "dtype": "float32", "torch_threads": 1,
                        "torch": "x", "transformers": "y", "machine": "m", "cpu_count": 1, "date": "now"},
        "settings": {"datasets": ["humaneval"], "modes": ["greedy"], "num_prompts": 10, "max_new_tokens": 4,
                     "sample_temperature": 0.7, "prompts_per_dataset": {"humaneval": 1}},
        "results": [], "greedy_check": {}, "gsm_accuracy": {}, "layout_effect": [], "formula": FORMULA,
    }
    md = render_markdown(results)
    assert "humaneval: 1 prompt ·" in md and "sampling" not in md.split("\n")[3]


def test_markdown_reports_a_greedy_mismatch_loudly():
    from hf_ssd.bench import FORMULA, render_markdown

    row = {"dataset": "d", "mode": "greedy", "method": "ar", "kind": "ar", "gamma": None, "layout": None,
           "tokens_per_second": 10.0, "speedup_vs_ar": 1.0, "speedup_vs_best_assisted": None}
    results = {
        "environment": {"target": "t", "draft": "d", "device": "cpu", "dtype": "float32", "torch_threads": 1,
                        "torch": "x", "transformers": "y", "machine": "m", "cpu_count": 1, "date": "now"},
        "settings": {"datasets": ["d"], "modes": ["greedy"], "num_prompts": 2, "max_new_tokens": 4,
                     "sample_temperature": 0.7},
        "results": [row],
        "greedy_check": {"d": {"ssd_g2": {"num_mismatches": 1, "mismatch_indices": [1], "first_divergence": [-1, 3]}}},
        "gsm_accuracy": {}, "layout_effect": [], "formula": FORMULA,
    }
    md = render_markdown(results)
    assert "**MISMATCH** d · ssd_g2: 1 prompt(s) differ" in md and "[3]" in md
    assert "| ar | 10.00 | 1.00× | — |" in md


# ----------------------------------------------------------------------------------------------- batches


def test_bench_batch_sizes_tiny(tmp_path, capsys):
    """--batch-sizes 1,2: the bench's methods at 1 and, at 2, the target's own batched generate and SSDConfig()
    over the same prompts in batches of two (3 prompts: batches of 2 and 1)."""
    out = tmp_path / "bench"
    argv = ["bench", "--tiny", "--num-prompts", "3", "--max-new-tokens", "8", "--gammas", "2", "--out", str(out),
            "--no-progress", "--batch-sizes", "1,2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "target batched and SSD at B = 2" in printed and "## Batched: dataset throughput" in printed
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["batch_sizes"] == [1, 2] and results["greedy_identical"] is True
    rows = results["batched"]
    assert {(r["dataset"], r["batch_size"], r["method"]) for r in rows} == {
        (d, b, m) for d in ("humaneval", "gsm") for b in (1, 2) for m in ("target_batched", "ssd")}
    singles = {(r["dataset"], r["method"]): r for r in results["results"]}
    for r in rows:
        assert r["prompts"] == 3 and r["new_tokens"] > 0 and r["tokens_per_second"] > 0
        assert r["rows_per_batch"] == ([1, 1, 1] if r["batch_size"] == 1 else [2, 1])
        assert r["tokens_per_second"] == pytest.approx(r["new_tokens"] / r["seconds"])  # dataset throughput
        assert r["seconds"] == pytest.approx(sum(b["seconds"] for b in r["per_batch"]))
        base = next(x for x in rows if x["dataset"] == r["dataset"] and x["batch_size"] == r["batch_size"]
                    and x["method"] == "target_batched")
        assert r["ratio_vs_target_batched"] == pytest.approx(r["tokens_per_second"] / base["tokens_per_second"])
        if r["batch_size"] == 1:  # from the bench's own ar and ssd rows
            single = singles[(r["dataset"], r["from_method"])]
            assert r["tokens_per_second"] == pytest.approx(single["tokens_per_second"])
        if r["method"] == "ssd":
            assert r["options"] and sum(o["rounds"] for o in r["options"].values()) == r["rounds"]
            assert [s[0] for s in r["option_shares"]] and sum(s[2] for s in r["option_shares"]) == pytest.approx(1)
    for d in ("humaneval", "gsm"):
        check = results["batched_check"][d]["2"]
        assert check["ssd_vs_target_batched"]["exact_match"] == 1.0
        assert len(check["ssd_vs_target_batched"]["first_divergence"]) == 3  # every row compared
        assert check["target_batched_vs_target_alone"]["exact_match"] == 1.0  # float64: batching changes nothing
    md = (out / "results.md").read_text()
    assert "| B | calls × rows | target batched tok/s | SSD tok/s | SSD / target batched |" in md
    assert "| 2 | 2 × 2/1 |" in md and "SSD token-identical to the target's batched generate on all 3 rows" in md
    assert (out / "batched_tok_s.png").read_bytes()[:4] == b"\x89PNG"
    check_figures_batched(results)


def check_figures_batched(results):
    from hf_ssd.bench.runner import figures

    fig = figures(results)["batched_tok_s"]
    assert "prompts:" in fig._suptitle.get_text() and "SSD rounds" in fig._suptitle.get_text()
    for ax in fig.axes:
        assert ax.get_ylim()[0] == 0
        assert set(ax.get_legend_handles_labels()[1]) == {"target's own batched generate", "SSD (SSDConfig())"}


def test_batched_mismatch_is_reported(metric):
    from hf_ssd.bench.runner import BatchResult, BatchRun, check_batched, render_batched, summarize_batched

    target, ssd = BatchRun("target_batched", 2), BatchRun("ssd", 2)
    target.add(BatchResult([[1, 2, 3], [4, 5]], 1.0))
    target.add(BatchResult([[6, 7]], 0.5))
    ssd.add(BatchResult([[1, 2, 3], [4, 9]], 0.5))
    ssd.add(BatchResult([[6, 7]], 0.25))
    by_size = {2: {"target_batched": target, "ssd": ssd}}
    check = check_batched(metric, by_size, None)
    assert check[2]["ssd_vs_target_batched"]["mismatch_indices"] == [1]
    assert target.tokens_per_second == pytest.approx(7 / 1.5) and target.rows == [2, 1]
    rows = summarize_batched("d", "greedy", by_size)
    assert [r["ratio_vs_target_batched"] for r in rows] == [pytest.approx(1.0), pytest.approx(2.0)]
    from hf_ssd.bench import FORMULA, render_markdown

    results = {
        "environment": {"target": "t", "draft": "d", "device": "cpu", "dtype": "float32", "torch_threads": 1,
                        "torch": "x", "transformers": "y", "machine": "m", "cpu_count": 1, "date": "now"},
        "settings": {"datasets": ["d"], "modes": ["greedy"], "num_prompts": 3, "max_new_tokens": 4,
                     "sample_temperature": 0.7, "batch_sizes": [2], "ssd_options": {}},
        "results": [], "greedy_check": {}, "gsm_accuracy": {}, "layout_effect": [], "formula": FORMULA,
        "batched": rows, "batched_check": {"d": check},
    }
    md = render_markdown(results)
    assert "**MISMATCH** d · SSD at B=2: 1 row(s) differ" in md and "| 2 | 2 × 2/1 |" in md
    assert "2.00×" in md and render_batched(results)


def test_ssd_ceiling_counts_rounds_of_the_slowest_row():
    from hf_ssd.bench.batched import ssd_ceiling

    row = [True, True, False, True]  # gamma 2: a round takes 2 + 1 tokens, then the last 1 + 1: 2 rounds for 4 steps
    assert ssd_ceiling([[row]], 2, 40.0, 10.0) == pytest.approx(2.0)
    assert ssd_ceiling([[row]], 1, 40.0, 10.0) == pytest.approx(4 / 3)  # 2 + 1 + 2 tokens: 3 rounds
    assert ssd_ceiling([[row]], 2, 40.0, 30.0) == pytest.approx(4 * 40 / (2 * 60))  # drafting outlasts the verify
    slow = [False] * 4  # one token a round: the batch goes at its pace, whatever the other row gains
    assert ssd_ceiling([[row, slow]], 2, 40.0, 10.0) == pytest.approx(1.0)
    assert ssd_ceiling([[row], [slow]], 2, 40.0, 10.0) == pytest.approx(8 / 6)  # datasets add steps and rounds
    with pytest.raises(ValueError, match="gamma must be at least 1"):
        ssd_ceiling([[row]], 0, 40.0, 10.0)


def test_greedy_matches_of_a_model_with_itself_and_with_a_noisy_copy():
    import torch

    from hf_ssd.bench.batched import greedy_matches
    from hf_ssd.models.tiny import tiny_pair

    target, draft, tok = tiny_pair(noise=0.05)
    prompt = tok("def f(x):")["input_ids"]
    new = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy_matches(target, prompt, new) == [True] * 24  # the target's own greedy choices
    agree = greedy_matches(draft, prompt, new)
    assert len(agree) == 24 and not all(agree)  # a noisier draft parts from it somewhere
