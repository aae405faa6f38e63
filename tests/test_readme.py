"""The README's Python code runs exactly as written.

Its code blocks are extracted and executed in order in one namespace. Blocks after a `<!-- needs-hub -->`
marker need the Hugging Face Hub and are only compiled. Here the default pair is replaced by the tiny pair (the
code is the README's, only `load_default_pair` returns small models); `tests/test_real_pair.py` runs the same
blocks on the real pair.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"(<!-- needs-hub -->\s*)?```python\n(.*?)```", re.S)


def readme_blocks() -> list[tuple[bool, str]]:
    """(needs_hub, code) of every python block of the README, in order."""
    return [(bool(m.group(1)), m.group(2)) for m in FENCE.finditer(README.read_text(encoding="utf-8"))]


def run_readme(monkeypatch, pair) -> dict:
    import hf_ssd.models.pairs as pairs

    monkeypatch.setattr(pairs, "load_default_pair", lambda *a, **k: pair)
    namespace: dict = {"__name__": "readme"}
    ran = 0
    for needs_hub, code in readme_blocks():
        compiled = compile(code, str(README), "exec")
        if not needs_hub:
            exec(compiled, namespace)
            ran += 1
    assert ran >= 1, "no runnable python block in the README"
    return namespace


def test_readme_has_an_offline_example_and_marks_the_hub_one():
    blocks = readme_blocks()
    offline = [code for hub, code in blocks if not hub]
    assert offline and any("hf_ssd.pairs.load_default_pair()" in code for code in offline)
    assert all("from_pretrained(\"Qwen/" not in code for code in offline), "a Hub download in a block marked offline"


def test_readme_python_example_runs_as_written(monkeypatch, capsys):
    import torch

    import hf_ssd.integration as integration
    from hf_ssd.models.tiny import tiny_pair

    calls = []
    real = integration._ssd_generate
    monkeypatch.setattr(integration, "_ssd_generate", lambda *a: calls.append(a[1]) or real(*a))
    torch.manual_seed(0)
    ns = run_readme(monkeypatch, tiny_pair(noise=0.001))
    printed = capsys.readouterr().out
    assert len(calls) == 4, "generate and the pipeline call, one prompt and batched, should all run SSD"
    stats = ns["hf_ssd"].last_stats(ns["target"])
    assert stats is not None and stats.batch_size == 2 and 0 < stats.new_tokens <= 2 * 16  # the batched pipeline
    assert "tok/s" in printed and "hit rate" in printed


@pytest.mark.parametrize("code", [c for hub, c in readme_blocks() if hub] or [None])
def test_hub_blocks_at_least_compile(code):
    if code is None:
        pytest.skip("no Hub block in the README")
    compile(code, str(README), "exec")


def test_readme_table_lists_every_ssdconfig_field_with_its_default():
    from dataclasses import MISSING, fields

    from hf_ssd import SSDConfig

    text = README.read_text(encoding="utf-8")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", text, re.M)}
    for f in fields(SSDConfig):
        assert f.name in rows, f"README's SSDConfig table lacks {f.name}"
        default = f.default if f.default is not MISSING else None
        if isinstance(default, (int, float, str)) and not isinstance(default, bool):
            assert str(default) in rows[f.name], f"{f.name}: README says {rows[f.name]!r}, default is {default!r}"
