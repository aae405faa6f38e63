"""Smoke tests of `hf-ssd generate` on the tiny offline pair (`--tiny`), in-process via `main` plus one run of
the console entry point as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_ssd.cli import build_parser, main, ssd_options

STATS_WORDS = ("tok/s", "acceptance", "hit rate", "bubble ratio")


def test_generate_tiny_streams_and_prints_stats(capsys):
    assert main(["generate", "--tiny", "--prompt", "def add(a, b):", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    stats = [line for line in out.splitlines() if line.startswith("[hf-ssd]")]
    assert len(stats) == 1
    assert all(word in stats[0] for word in STATS_WORDS)


def test_generate_timeline_writes_png(tmp_path, capsys):
    png = tmp_path / "timeline.png"
    argv = ["generate", "--tiny", "--prompt", "x = 1\n", "--max-new-tokens", "16", "--gamma", "3", "--timeline", str(png)]
    assert main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "timeline written" in capsys.readouterr().out


def test_generate_prompt_ids_chat_and_sampling(capsys):
    assert main(["generate", "--tiny", "--prompt-ids", "20,21,22,23", "--max-new-tokens", "6",
                 "--do-sample", "--temperature", "0.9", "--seed", "3", "--fallback", "short"]) == 0
    assert "hit rate" in capsys.readouterr().out
    assert main(["generate", "--tiny", "--prompt", "hello", "--chat", "--max-new-tokens", "6", "--method", "ar"]) == 0
    assert "[hf-ssd] ar:" in capsys.readouterr().out


def test_generate_leaves_torch_threads_as_they_were():
    before = torch.get_num_threads()
    main(["generate", "--tiny", "--prompt-ids", "5,6", "--max-new-tokens", "2", "--threads", "1"])
    assert torch.get_num_threads() == before


def test_ssd_flags_map_to_config_fields():
    args = build_parser().parse_args([
        "generate", "--prompt", "p", "--gamma", "6", "--fanout-budget", "5", "--max-outcomes", "3", "--cache-size", "9",
        "--fallback", "ngram", "--saguaro-c", "0.5", "--layout", "inline", "--cpu-threads", "1",
    ])
    opts = ssd_options(args)
    assert opts["gamma"] == 6 and opts["fanout_budget"] == 5 and opts["max_outcomes"] == 3
    assert opts["cache_size"] == 9 and opts["fallback"] == "ngram"
    assert opts["saguaro_c"] == 0.5 and opts["layout"] == "inline" and opts["cpu_threads"] == 1
    assert opts["static_draft"] is None and opts["cuda_graphs"] is None  # auto by default
    args = build_parser().parse_args(["generate", "--prompt", "p", "--static-draft", "on", "--cuda-graphs", "off"])
    assert ssd_options(args)["static_draft"] is True and ssd_options(args)["cuda_graphs"] is False


@pytest.mark.parametrize("argv, message", [
    (["--gamma", "0"], "gamma"),
    (["--target", "some/model"], "--tiny builds its own pair"),
    (["--saguaro-c", "1.5"], "saguaro_c"),
])
def test_generate_bad_arguments_exit_with_a_message(argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--tiny", "--prompt", "p", *argv])
    assert message in str(exc.value)


def test_console_entry_point_as_module():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, "-m", "hf_ssd.cli", "generate", "--tiny", "--prompt-ids", "5,6,7", "--max-new-tokens", "4"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tok/s" in proc.stdout and "hit rate" in proc.stdout


def _subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_every_option_shows_its_default(command):
    """`--help` tells every default: shown by the formatter, or said in the help text when it is None/off."""
    import argparse

    sub = _subparsers(build_parser())[command]
    formatter = sub._get_formatter()
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        text = formatter._get_help_string(action) or ""
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        required_choice = action.dest in ("prompt", "prompt_ids")  # one of the two is required: no default
        assert flag or required_choice or "default" in text.lower(), f"{command} {action.option_strings}: {text!r}"
        if flag:
            assert text, f"{command} {action.option_strings} has no help"


def test_gamma_is_left_to_the_scheduler_unless_given():
    parser = build_parser()
    assert "gamma" not in ssd_options(parser.parse_args(["generate", "--tiny", "--prompt", "x"]))
    given = ssd_options(parser.parse_args(["generate", "--tiny", "--prompt", "x", "--gamma", "3"]))
    assert given["gamma"] == 3
    assert ssd_options(parser.parse_args(["bench", "--schedule", "fixed"]))["schedule"] == "fixed"


def test_generate_echoes_the_prompt_before_the_continuation(capsys):
    assert main(["generate", "--tiny", "--prompt", "def add(a, b):", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.startswith("def add(a, b):")
