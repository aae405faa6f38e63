"""Fault injection: an error anywhere in SSD reaches the caller of `generate` promptly, with its own traceback;
the background speculator never outlives the call; the same models then generate exactly again.

Faults are injected with the speculator's test hooks (`_ssd_hooks={"predict" | "draft" | "insert": fn}`), with
forward hooks on the models, and with stopping criteria and streamers that raise in the main thread; on both
paths a prompt can take (`ROUTES`: transformers' assisted loop with hf_ssd's generator, and hf_ssd's own loop).
"""

from __future__ import annotations

import threading
import time
import traceback

import pytest
import torch
from conftest import noisy_copy
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_ssd import SSDConfig, last_stats

PROMPT = torch.tensor([[5, 6, 7, 8]])
NEW = 24
STAGES = ("predict", "draft", "insert")
SURFACE_WITHIN_S = 1.0


class InjectedFault(Exception):
    """The error the tests plant; nothing else raises it."""


def speculator_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hf_ssd-speculator"]


def frame_names(err: BaseException) -> list[str]:
    return [f.name for f in traceback.extract_tb(err.__traceback__)]


@pytest.fixture(scope="module")
def close_draft(target):
    """A draft that agrees with the target almost always: the cache hits, so every stage really runs."""
    return noisy_copy(target, 0.002)


@pytest.fixture(scope="module")
def reference(target):
    return target.generate(PROMPT, max_new_tokens=NEW, do_sample=False)


# The two paths a prompt can take (`_ssd_hooks["loop"]`): transformers' assisted loop with hf_ssd's candidate
# generator (where an explicit layout keeps the speculator running: the scheduler tunes only the fan-out budget),
# and hf_ssd's own loop, here held to overlapped SSD rounds (never plain decoding, no other option family).
ROUTES = {
    "assisted": {"loop": "assisted"},
    "loop": {"loop": "batch", "plain": False, "options": lambda options: [o for o in options if o.kind == "ssd"]},
}


def ssd(target, draft, route="assisted", **kw):
    config = kw.pop("ssd_config", SSDConfig(gamma=4, layout="thread", hit_rate_warning=0.0))
    hooks = {**ROUTES[route], **kw.pop("_ssd_hooks", {})}
    return target.generate(PROMPT, assistant_model=draft, max_new_tokens=NEW, do_sample=False, ssd_config=config,
                           _ssd_hooks=hooks, **kw)


def assert_recovered(target, draft, reference, route="assisted"):
    """No speculator thread left, and the next SSD call on the same models is exact."""
    assert not speculator_threads(), "a speculator thread outlived generate"
    assert torch.equal(ssd(target, draft, route), reference)


class FaultAtCall:
    """Raises `exc` on the `at`-th call (1-based), records when it raised; a plain callable for `_ssd_hooks`."""

    def __init__(self, exc: type[BaseException], at: int = 1):
        self.exc, self.at, self.calls, self.raised_at = exc, at, 0, None

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            self.raised_at = time.perf_counter()
            _planted_fault_frame(self.exc)


def _planted_fault_frame(exc):
    raise exc("planted fault")


# ----- errors raised by the speculator -------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["thread", "inline"])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("at", [1, 3])
@pytest.mark.parametrize("route", list(ROUTES))
def test_speculator_fault_surfaces_promptly_with_traceback(target, close_draft, reference, stage, layout, at, route):
    fault = FaultAtCall(InjectedFault, at=at)
    config = SSDConfig(gamma=4, layout=layout, hit_rate_warning=0.0)
    with pytest.raises(InjectedFault) as info:
        ssd(target, close_draft, route, ssd_config=config, _ssd_hooks={stage: fault})
    caught = time.perf_counter()
    assert fault.raised_at is not None
    assert caught - fault.raised_at < SURFACE_WITHIN_S, f"took {caught - fault.raised_at:.3f}s to surface"
    # The original traceback: the raising frame and the speculator job that called it are both there.
    names = frame_names(info.value)
    assert names[-1] == "_planted_fault_frame"
    assert "job" in names
    assert_recovered(target, close_draft, reference, route)


@pytest.mark.parametrize("route", list(ROUTES))
def test_fault_in_draft_model_forward(target, close_draft, reference, route):
    """A crash inside the draft model itself (whichever thread runs it) surfaces and leaves nothing behind."""
    fault = FaultAtCall(InjectedFault, at=6)
    handle = close_draft.register_forward_pre_hook(lambda module, args: fault())
    try:
        with pytest.raises(InjectedFault) as info:
            ssd(target, close_draft, route)
    finally:
        handle.remove()
    assert "_planted_fault_frame" in frame_names(info.value)
    assert_recovered(target, close_draft, reference, route)


class FaultFromCall(FaultAtCall):
    """Raises `exc` on every call from the `at`-th on."""

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls >= self.at:
            self.raised_at = time.perf_counter()
            _planted_fault_frame(self.exc)


@pytest.mark.parametrize("layout", ["inline", "thread"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_fault_in_last_round_job_is_not_lost(target, close_draft, layout, route):
    """An error in the speculation job running while the final round is verified must not vanish.

    Inline, with one fixed option, the rounds repeat exactly, so the fault lands in the last job. On a thread
    the number of jobs depends on timing (a job cut short misses): the fault then fires in every job from the
    counted last one on, so it lands in the last job whether the run has as many jobs or more."""
    eos = int(target.generate(PROMPT, max_new_tokens=8, do_sample=False)[0, -1])

    class Slow(StoppingCriteria):  # gives the last job time to run before generate ends
        def __call__(self, input_ids, scores, **kwargs):
            time.sleep(0.05)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    config = SSDConfig(gamma=4, layout=layout, hit_rate_warning=0.0, schedule="fixed", fanout="geometric",
                       fanout_budget=2)

    def run(hook):
        return ssd(target, close_draft, route, eos_token_id=eos, stopping_criteria=StoppingCriteriaList([Slow()]),
                   _ssd_hooks={"predict": hook}, ssd_config=config)

    counter = FaultAtCall(InjectedFault, at=10**9)
    run(counter)
    jobs = counter.calls
    assert jobs >= 1
    fault = (FaultAtCall if layout == "inline" else FaultFromCall)(InjectedFault, at=jobs)
    with pytest.raises(InjectedFault):
        run(fault)
    if layout == "inline":
        assert fault.calls == jobs, "the fault did not land in the last job"
    assert not speculator_threads()


# ----- errors and interrupts raised in the main thread while the speculator works -------------------------------


class RaisingCriteria(StoppingCriteria):
    def __init__(self, fault):
        self.fault = fault

    def __call__(self, input_ids, scores, **kwargs):
        self.fault()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class RaisingStreamer(BaseStreamer):
    def __init__(self, fault):
        self.fault = fault

    def put(self, value):
        self.fault()

    def end(self):
        pass


def _plant_in_target(target, fault):
    return target.register_forward_pre_hook(lambda module, args: fault())


@pytest.mark.parametrize("exc", [InjectedFault, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["stopping_criteria", "streamer", "target_forward"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_main_thread_fault_stops_background_work(target, close_draft, reference, where, exc, route):
    fault = FaultAtCall(exc, at=3)
    forwards = {"n": 0}
    counting = close_draft.register_forward_pre_hook(lambda m, a: forwards.__setitem__("n", forwards["n"] + 1))
    handle = None
    kwargs = {}
    if where == "stopping_criteria":
        kwargs["stopping_criteria"] = StoppingCriteriaList([RaisingCriteria(fault)])
    elif where == "streamer":
        kwargs["streamer"] = RaisingStreamer(fault)
    else:
        handle = _plant_in_target(target, fault)
    try:
        with pytest.raises(exc):
            ssd(target, close_draft, route, **kwargs)
        # Background work has stopped: no thread, and no draft forward happens after generate returned.
        assert not speculator_threads()
        after = forwards["n"]
        time.sleep(0.05)
        assert forwards["n"] == after
    finally:
        counting.remove()
        if handle is not None:
            handle.remove()
    assert fault.calls >= 3
    assert_recovered(target, close_draft, reference, route)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("route", list(ROUTES))
def test_keyboard_interrupt_in_speculator(target, close_draft, reference, stage, route):
    with pytest.raises(KeyboardInterrupt):
        ssd(target, close_draft, route, _ssd_hooks={stage: FaultAtCall(KeyboardInterrupt, at=2)})
    assert_recovered(target, close_draft, reference, route)


@pytest.mark.parametrize("route", list(ROUTES))
def test_fault_does_not_leave_stale_stats_or_thread_settings(target, close_draft, reference, route):
    threads_before = torch.get_num_threads()
    with pytest.raises(InjectedFault):
        ssd(target, close_draft, route, _ssd_hooks={"draft": FaultAtCall(InjectedFault)})
    assert torch.get_num_threads() == threads_before
    out = ssd(target, close_draft, route)
    assert torch.equal(out, reference)
    assert last_stats(target).new_tokens == NEW


@pytest.mark.parametrize("route", list(ROUTES))
def test_repeated_faults_do_not_accumulate_threads(target, close_draft, reference, route):
    baseline = threading.active_count()
    for i in range(10):
        with pytest.raises(InjectedFault):
            ssd(target, close_draft, route, _ssd_hooks={STAGES[i % 3]: FaultAtCall(InjectedFault, at=1 + i % 2)})
    assert threading.active_count() == baseline
    assert_recovered(target, close_draft, reference, route)


# ----- shutdown: bounded waits, the first error wins, buffers always released ------------------------------------


@pytest.mark.parametrize("route", list(ROUTES))
def test_stuck_speculator_job_does_not_hang_generate(target, close_draft, reference, monkeypatch, route):
    """A draft call that never returns (a stuck device call) makes generate raise within the bounded wait
    instead of hanging it, at collect and at exit alike."""
    import hf_ssd.speculation.speculator as spec

    monkeypatch.setattr(spec, "WAIT_TIMEOUT_S", 0.5)
    release = threading.Event()
    stuck = FaultAtCall(InjectedFault, at=10**9)

    def hang():
        stuck()
        if stuck.calls == 2:
            release.wait(30)

    start = time.perf_counter()
    try:
        with pytest.raises(spec.SpeculatorTimeout, match="did not reach"):
            ssd(target, close_draft, route, _ssd_hooks={"draft": hang})
        assert time.perf_counter() - start < 10, "generate waited far beyond the bounded wait"
    finally:
        release.set()  # the stuck job returns; the worker, told to close, exits
    deadline = time.monotonic() + 5
    while speculator_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert_recovered(target, close_draft, reference, route)


@pytest.mark.parametrize("route", list(ROUTES))
def test_error_while_closing_does_not_replace_the_callers_error(target, close_draft, reference, monkeypatch, route):
    """The user gets the first error (here from a stopping criterion), not one raised while shutting down."""
    from hf_ssd.loop.assisted import SSDCandidateGenerator
    from hf_ssd.speculation.speculator import Speculator

    owner = SSDCandidateGenerator if route == "assisted" else Speculator  # what each path closes
    real_close = owner.close

    def failing_close(self):
        real_close(self)
        raise RuntimeError("close failed")

    monkeypatch.setattr(owner, "close", failing_close)
    criteria = StoppingCriteriaList([RaisingCriteria(FaultAtCall(InjectedFault, at=3))])
    with pytest.raises(InjectedFault):
        ssd(target, close_draft, route, stopping_criteria=criteria)
    monkeypatch.undo()
    assert_recovered(target, close_draft, reference, route)


def test_failed_close_still_releases_the_static_buffers(target, close_draft, reference, monkeypatch):
    """A failure in the speculator's shutdown must not leave the draft's static buffers marked busy (the next
    call would then allocate new ones instead of reusing them)."""
    import hf_ssd.drafting.static as sd
    from hf_ssd.speculation.speculator import Speculator

    config = SSDConfig(gamma=4, layout="thread", hit_rate_warning=0.0, static_draft=True)
    real_close = Speculator.close

    def failing_close(self):
        real_close(self)
        raise RuntimeError("close failed")

    monkeypatch.setattr(Speculator, "close", failing_close)
    with pytest.raises(RuntimeError, match="close failed") as info:  # held, as a caller logging it would
        ssd(target, close_draft, ssd_config=config)
    monkeypatch.undo()
    state = sd._states[close_draft][False]
    assert not state.busy, "the static buffers stayed marked busy after a failed close"
    del info
    assert torch.equal(ssd(target, close_draft, ssd_config=config), reference)
    assert sd._states[close_draft][False] is state, "the buffers were not reused"


@pytest.mark.parametrize("layout", ["thread", "inline"])
def test_a_fault_in_the_jobs_decision_surfaces_in_the_caller(target, close_draft, reference, monkeypatch, layout):
    """hf_ssd's own loop decides the next round's option in the job beside the verify: an error there reaches
    the caller with its traceback, and leaves nothing running."""
    from hf_ssd.loop import batch as loop

    fault = FaultAtCall(InjectedFault, at=3)
    real = loop._decide

    def deciding(*args):
        fault()
        return real(*args)

    monkeypatch.setattr(loop, "_decide", deciding)
    with pytest.raises(InjectedFault) as info:
        ssd(target, close_draft, "loop", ssd_config=SSDConfig(gamma=4, layout=layout, hit_rate_warning=0.0))
    names = frame_names(info.value)
    assert names[-1] == "_planted_fault_frame" and "job" in names
    monkeypatch.undo()
    assert_recovered(target, close_draft, reference, "loop")


def test_a_held_job_starts_on_start_or_collect_and_never_after_close():
    """`submit(hold=True)`: the job waits for `start` (the loop calls it as the verify starts), `collect` starts
    a job still held, and `close` drops one never started."""
    from hf_ssd.speculation.speculator import Speculator

    spec, ran = Speculator("thread"), []
    try:
        spec.submit(lambda stop: ran.append(time.perf_counter()), hold=True)
        time.sleep(0.05)
        assert not ran
        started = time.perf_counter()
        spec.start()
        spec.collect()
        assert len(ran) == 1 and ran[0] >= started
        spec.submit(lambda stop: ran.append("collected"), hold=True)
        spec.collect()
        assert ran[1:] == ["collected"]
        spec.submit(lambda stop: ran.append("closed"), hold=True)
    finally:
        spec.close()
    time.sleep(0.05)
    assert "closed" not in ran and not speculator_threads()
