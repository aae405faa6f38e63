"""Load: many consecutive short SSD calls leak no threads and no memory, never overfill the speculation cache,
and stay exact; two enabled models driven from two Python threads at once stay independent and exact.

The 1,000-call soak is marked slow (run with --runslow or HF_SSD_SLOW=1); a 100-call version runs in CI.
"""

from __future__ import annotations

import gc
import inspect
import os
import threading
from collections import Counter

import pytest
import torch
from conftest import make_model, noisy_copy

import hf_ssd
from hf_ssd import SSDConfig
from hf_ssd.loop import batch as batch_loop
from hf_ssd.speculation.cache import SpeculationCache

NEW = 8
PROMPTS = [torch.tensor([[5 + i, 6 + 3 * i, 7, 8 + 2 * i][: 2 + i % 3]]) for i in range(8)]
WARMUP = 20
RSS_BOUND_MB = {100: 100, 1000: 150}  # growth allowed after warm-up; observed growth is well under 1 MB


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def speculator_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hf_ssd-speculator"]


@pytest.fixture
def bounded_cache(monkeypatch):
    """Wrap SpeculationCache.put (the one-prompt path) and the loop's jobs: record every put's size, and every
    job's branches of one row, against the capacity (asserting inside the speculator thread could be lost, so
    violations are collected and checked by the test)."""
    seen = {"puts": 0, "violations": [], "fullest": 0, "capacity": 0}  # capacity: the soak's cache_size
    original_put = SpeculationCache.put

    def put(self, branch):
        original_put(self, branch)
        seen["puts"] += 1
        if len(self) > self.capacity:
            seen["violations"].append((len(self), self.capacity))
        seen["fullest"] = max(seen["fullest"], len(self))

    def speculate(*args, **kwargs):  # hf_ssd's loop: a job's branches, per row
        speculated(*args, **kwargs)
        tree = inspect.signature(speculated).bind(*args, **kwargs).arguments["tree"]
        per_row = Counter(b.row for b in tree.branches)
        seen["puts"] += len(tree.branches)
        if per_row and max(per_row.values()) > seen["capacity"]:
            seen["violations"].append((max(per_row.values()), seen["capacity"]))
        seen["fullest"] = max([seen["fullest"], *per_row.values()])

    speculated = batch_loop.speculate
    monkeypatch.setattr(SpeculationCache, "put", put)
    monkeypatch.setattr(batch_loop, "speculate", speculate)
    return seen


def soak(target, draft, calls: int, bounded_cache) -> None:
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("needs /proc/self/statm to measure resident memory")
    references = [target.generate(p, max_new_tokens=NEW, do_sample=False) for p in PROMPTS]
    # A small cache under a larger fan-out budget: the cache fills up, so the bound is really exercised (a fixed
    # schedule: SSD every round; the auto scheduler may run SD on these cores and leave the cache unfilled).
    config = SSDConfig(gamma=4, fanout_budget=8, max_outcomes=8, cache_size=3, schedule="fixed", hit_rate_warning=0.0)
    bounded_cache["capacity"] = config.cache_size

    def call(i):
        return target.generate(PROMPTS[i % len(PROMPTS)], assistant_model=draft, max_new_tokens=NEW,
                               do_sample=False, ssd_config=config)

    for i in range(WARMUP):
        call(i)
    gc.collect()
    threads0, rss0 = threading.active_count(), rss_mb()
    hits = 0
    for i in range(calls):
        out = call(i)
        hits += hf_ssd.last_stats(target).cache_hits
        if i % 10 == 0:  # exactness on a sample of the calls
            assert torch.equal(out, references[i % len(PROMPTS)]), f"call {i} differs from the target alone"
    gc.collect()
    growth = rss_mb() - rss0
    assert threading.active_count() == threads0
    assert not speculator_threads()
    assert growth < RSS_BOUND_MB[calls], f"resident memory grew by {growth:.1f} MB over {calls} calls"
    assert bounded_cache["puts"] > 0
    assert not bounded_cache["violations"], f"cache above capacity: {bounded_cache['violations'][:5]}"
    assert bounded_cache["fullest"] == config.cache_size
    assert hits > 0


@pytest.fixture(scope="module")
def soak_draft(target):
    return noisy_copy(target, 0.02)


def test_soak_100_calls(target, soak_draft, bounded_cache):
    soak(target, soak_draft, 100, bounded_cache)


@pytest.mark.slow
def test_soak_1000_calls(target, soak_draft, bounded_cache):
    soak(target, soak_draft, 1000, bounded_cache)


def _run_in_threads(jobs) -> list[BaseException]:
    """Run every job in its own thread, all released at once; return what they raised."""
    barrier = threading.Barrier(len(jobs))
    errors: list[BaseException] = []

    def runner(job):
        try:
            barrier.wait()
            job()
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    threads = [threading.Thread(target=runner, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a generating thread hung"
    return errors


def test_two_models_from_two_threads(target):
    """Two enabled targets, each with its own draft, generating concurrently: each matches its own reference,
    and each model's last_stats describes its own call."""
    other = hf_ssd.enable(make_model(7))
    pairs = [(target, noisy_copy(target, 0.01)), (other, noisy_copy(other, 0.01, seed=3))]
    prompts = PROMPTS[:4]
    new = 16
    references = [[m.generate(p, max_new_tokens=new, do_sample=False) for p in prompts] for m, _ in pairs]
    assert not torch.equal(references[0][0], references[1][0]), "the two targets should differ"
    results: dict[int, list] = {0: [], 1: []}

    def job(which):
        model, draft = pairs[which]
        for p in prompts:
            out = model.generate(p, assistant_model=draft, max_new_tokens=new, do_sample=False,
                                 ssd_config=SSDConfig(gamma=3, hit_rate_warning=0.0))
            results[which].append((out, hf_ssd.last_stats(model).new_tokens, out.shape[1] - p.shape[1]))

    errors = _run_in_threads([lambda: job(0), lambda: job(1)])
    assert not errors, errors
    for which in (0, 1):
        for (out, stats_tokens, generated), ref in zip(results[which], references[which]):
            assert torch.equal(out, ref)
            assert stats_tokens == generated  # the stats of this model's own call, not the other thread's
    assert not speculator_threads()


def test_one_model_from_two_threads(target):
    """The same enabled target, shared by two threads with different drafts: SSD state is per call."""
    drafts = [noisy_copy(target, 0.01, seed=5), noisy_copy(target, 0.05, seed=6)]
    prompts = [PROMPTS[1], PROMPTS[2]]
    references = [target.generate(p, max_new_tokens=12, do_sample=False) for p in prompts]
    outs: dict[int, list] = {0: [], 1: []}

    def job(which):
        for _ in range(3):
            outs[which].append(target.generate(prompts[which], assistant_model=drafts[which], max_new_tokens=12,
                                               do_sample=False, ssd_config=SSDConfig(hit_rate_warning=0.0)))

    errors = _run_in_threads([lambda: job(0), lambda: job(1)])
    assert not errors, errors
    for which in (0, 1):
        assert all(torch.equal(o, references[which]) for o in outs[which])
    assert not speculator_threads()
