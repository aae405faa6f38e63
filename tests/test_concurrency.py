"""Concurrent calls on one pair: the pair's shared estimates (costs.CostModel) stay consistent, every output is
the target's own, and no thread outlives the calls."""

from __future__ import annotations

import threading
import time

import torch
from conftest import make_model, noisy_copy

import hf_ssd
from hf_ssd import SSDConfig
from hf_ssd.scheduling.costs import CostModel

THREADS, CALLS, NEW = 6, 15, 10


def test_concurrent_generate_calls_on_one_pair_are_exact():
    """6 threads x 15 calls of the default SSDConfig on one tiny pair at once: no exception, every output
    identical to the target alone, no speculator thread left behind."""
    target = hf_ssd.enable(make_model(0))
    draft = noisy_copy(target, 0.01)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 96, (1, 3 + i % 5), generator=g) for i in range(THREADS * CALLS)]
    with torch.no_grad():
        want = [target.generate(p, do_sample=False, max_new_tokens=NEW) for p in prompts]
    before = {t.ident for t in threading.enumerate()}
    errors, mismatches = [], []
    start = threading.Barrier(THREADS)

    def worker(w: int) -> None:
        try:
            start.wait()
            for i in range(w, len(prompts), THREADS):
                out = target.generate(prompts[i], assistant_model=draft, do_sample=False, max_new_tokens=NEW,
                                      ssd_config=SSDConfig(hit_rate_warning=0.0))
                if not torch.equal(out, want[i]):
                    mismatches.append(i)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(repr(err))

    workers = [threading.Thread(target=worker, args=(w,)) for w in range(THREADS)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in workers), "a generate call hung"
    assert not errors, errors
    assert not mismatches, f"outputs differ from the target alone for prompts {mismatches}"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("hf_ssd")]
        if not left:
            break
        time.sleep(0.05)
    assert not left, f"threads left behind: {[t.name for t in left]}"


def test_cost_updates_wait_for_a_reader_holding_the_lock():
    """Every update takes the model's lock: while a reader (`Scheduler.decide`) holds it, an update from
    another thread waits instead of changing the tables under it."""
    costs = CostModel(False, 8, 0.7)
    updates = [
        lambda: costs.add_lookup(4, False, 0.5), lambda: costs.add_verify(4, 0.01, None),
        lambda: costs.add_verify(4, 0.01, 2), lambda: costs.add_draft(3, 0.01), lambda: costs.add_rank(1),
        lambda: costs.add_verified([(2, 4, None)], by_position=False), lambda: costs.add_verified([(2, 4, None)]), lambda: costs.add_overhead(2, 0.001),
        lambda: costs.add_confidence([([0.9, 0.5], 1)]), lambda: costs.add_record(0.001),
        lambda: costs.add_tree_step(4, 0.002), lambda: costs.add_round(), lambda: costs.new_call(),
    ]
    for update in updates:
        done = threading.Event()

        def run(update=update, done=done):
            update()
            done.set()

        with costs.lock:
            t = threading.Thread(target=run)
            t.start()
            assert not done.wait(0.05), "an update ran while another thread held the cost model's lock"
        assert done.wait(5)
        t.join()
