"""The speculator's execution context: where background speculation runs and how it hands back results.

One job is in flight at a time. `submit` starts it right after the round's candidates are returned (or, with
`hold`, when the caller says `start`: as its verify begins); `collect` starts a held job if need be, tells it that the verification outcome has arrived (so it stops at its next step boundary), waits for it, and
re-raises anything it raised, with its original traceback, in the caller's thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import torch

Job = Callable[[Callable[[], bool]], None]

# How long the caller waits for a signalled job (one draft step) or for the worker to exit, before giving up
# with SpeculatorTimeout: a step is at most a few seconds even for a wide tree on CPU cores; a device call that
# never returns must not hang generate.
WAIT_TIMEOUT_S = 120.0


class SpeculatorTimeout(RuntimeError):
    """The speculation job did not stop within WAIT_TIMEOUT_S (a draft forward that never returned)."""


class Speculator:
    def __init__(self, layout: str, cpu_threads: int | None = None, device: torch.device | None = None):
        self.layout = layout
        self.cpu_threads = cpu_threads
        self.stream = None
        self._caller_stream = None
        if layout == "stream":
            self.stream = torch.cuda.Stream(device=device)
        self._arrived = threading.Event()
        self._done = threading.Event()
        self._done.set()
        self._wake = threading.Event()
        self._closing = False
        self._job: Job | None = None
        self._held = False  # a job submitted, not started yet (`submit(hold=True)`)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.busy: list[tuple[float, float]] = []  # (start, end) of each job, perf_counter seconds
        self.in_flight = 0  # observable for tests: 1 while a background job is running

    # ----- public ----------------------------------------------------------------------------------------
    def submit(self, job: Job, hold: bool = False) -> None:
        if not self._done.is_set():
            raise RuntimeError("hf_ssd internal error: a speculation job is already in flight")
        self._arrived.clear()
        if self.stream is not None:
            # Captured here: in the worker thread current_stream() would be the default stream, not the caller's.
            self._caller_stream = torch.cuda.current_stream(self.stream.device)
        if self.layout == "inline":
            self._run(job, lambda: False)  # no overlap: the whole job sits on the critical path
            return
        self._ensure_thread()
        self._job = job
        self._done.clear()
        self._held = hold
        if not hold:
            self._wake.set()

    def start(self) -> None:
        """Start the job submitted with `hold` (no-op otherwise)."""
        if self._held:
            self._held = False
            self._wake.set()

    def signal(self) -> None:
        """The outcome is known: the job stops at its next step boundary (`collect` waits for that)."""
        self._arrived.set()

    def collect(self) -> None:
        """Signal that the outcome is known, wait for the job, and raise its error here if it failed."""
        self._arrived.set()
        self.start()
        if not self._done.wait(WAIT_TIMEOUT_S):
            raise SpeculatorTimeout(self._stuck("its current draft step"))
        self.raise_pending()

    def close(self) -> None:
        """Stop the background thread; never leaves it running after `generate` returns or raises, and returns
        within WAIT_TIMEOUT_S (else SpeculatorTimeout: the thread, a daemon, is stuck in a call that never
        returned and cannot be stopped from Python)."""
        self._arrived.set()
        self._closing = True
        self._wake.set()
        self._job = None
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(WAIT_TIMEOUT_S)
            if thread.is_alive():
                raise SpeculatorTimeout(self._stuck("its exit"))

    @staticmethod
    def _stuck(what: str) -> str:
        return (f"hf_ssd: the speculator thread did not reach {what} within {WAIT_TIMEOUT_S:.0f} s: a draft forward "
                "did not return (a stuck device call?). The draft model may be unusable; check its device.")

    @contextlib.contextmanager
    def on_critical_path(self):
        """Draft work done by the caller (fallback drafts, adopting a branch) on the speculator's stream too.

        All draft tensors then belong to one stream, so the caching allocator never hands a block to one stream
        while the other still reads it; the caller waits for the work, as it would anyway on this path.
        """
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def raise_pending(self) -> None:
        err = self.take_pending()
        if err is not None:
            raise err

    def take_pending(self) -> BaseException | None:
        """The job's error, if it failed and it was not raised yet (cleared)."""
        err, self._error = self._error, None
        return err

    # ----- internals -------------------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hf_ssd-speculator", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)  # intra-op threads are per calling thread
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closing:
                self._done.set()
                return
            job, self._job = self._job, None
            if job is not None:
                self._run(job, self._arrived.is_set)
            self._done.set()

    def _run(self, job: Job, should_stop: Callable[[], bool]) -> None:
        start = time.perf_counter()
        self.in_flight = 1
        try:
            if self.stream is not None:
                # Draft work goes on its own stream; wait for the verifier's stream up to now (inputs ready),
                # and make the verifier wait for ours only when results are collected.
                self.stream.wait_stream(self._caller_stream)
                with torch.cuda.stream(self.stream):
                    job(should_stop)
                self.stream.synchronize()
            else:
                job(should_stop)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller by collect()
            self._error = err
        finally:
            self.in_flight = 0
            self.busy.append((start, time.perf_counter()))
