"""CUDA-graph capture and replay of fixed-shape draft steps, plus pinned host transfers.

A step is a zero-argument function that reads preallocated input tensors and writes preallocated state (the
static KV cache) in place; it returns one output tensor. `StepRunner` runs it eagerly, or, on CUDA with graphs
on, captures it once (warm-up on a side stream, then `torch.cuda.CUDAGraph` capture) and from then on replays
the graph on the caller's current stream: the step's inputs are updated in place between replays, never
re-bound. A capture that fails is reported once (logged) and the step keeps running eagerly, or, when graphs
were asked for explicitly, raises `GraphCaptureError`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger("hf_ssd")


class GraphCaptureError(RuntimeError):
    """A draft step could not be captured as a CUDA graph (SSDConfig(cuda_graphs=True) was set explicitly)."""


class StepRunner:
    """Runs one fixed-shape step, captured as a CUDA graph when `graphs` is set (CUDA only).

    Warm-up and capture execute the step for real (the warm-up does, capture only records), so they must be
    called when the step's side effect is harmless: it writes the KV column its inputs point at, which the next
    real step overwrites with its own values.
    """

    def __init__(self, fn: Callable[[], torch.Tensor], graphs: bool, strict: bool, name: str,
                 device: torch.device | None = None, warmup: int = 2):
        self.fn = fn
        self.device = device
        self.graphs = graphs
        self.strict = strict
        self.name = name
        self.warmup = warmup
        self.graph = None
        self.output: torch.Tensor | None = None
        self.replays = 0
        self.failed: str | None = None  # why capture failed (then it runs eagerly)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def capture(self) -> None:
        if not self.graphs or self.graph is not None or self.failed is not None:
            return
        try:
            on_device = self.device is not None and self.device.type == "cuda"
            # Under the model's GPU, whichever device this thread is on.
            with torch.cuda.device(self.device) if on_device else contextlib.nullcontext():
                self.graph, self.output = _capture(self.fn, self.warmup)
        except Exception as err:  # noqa: BLE001 - reported below, then eager (or raised when asked for explicitly)
            self.failed = f"{type(err).__name__}: {err}"
            self.graph = None
            if self.strict:
                raise GraphCaptureError(
                    f"hf_ssd could not capture the draft step {self.name!r} as a CUDA graph ({self.failed}). "
                    "Use SSDConfig(cuda_graphs=None) to fall back to eager steps, or cuda_graphs=False."
                ) from err
            logger.warning("hf_ssd: CUDA graph capture of draft step %r failed (%s); running it eagerly.",
                           self.name, self.failed)

    def __call__(self) -> torch.Tensor:
        if self.graphs and self.graph is None and self.failed is None:
            self.capture()
        if self.graph is not None:
            self.graph.replay()
            self.replays += 1
            return self.output
        return self.fn()


@torch.inference_mode(False)  # outputs are normal tensors, whatever mode generate runs in
@torch.no_grad()
def _capture(fn: Callable[[], torch.Tensor], warmup: int):
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream(device=current.device)
    side.wait_stream(current)
    # Warm-up on a side stream: lazy initialisations (cuBLAS handles, autotuning) happen outside the capture.
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        # thread_local: the verifier may be launching work from another thread while the speculator captures.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = fn()
    finally:
        torch.cuda.set_stream(current)  # a failed capture can leave its capture stream current
    return graph, out


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `t`; on CUDA through pinned memory, waiting only for the current stream's work so far."""
    if t.device.type != "cuda":
        return t
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # torch caches pinned blocks
    buf.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))  # the copy's stream, not this thread's current device
    done.synchronize()
    return buf


def host_list(t: torch.Tensor) -> list:
    return to_host(t).tolist()


def to_device(values: list, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor; on CUDA through pinned memory, without blocking the host."""
    if device.type != "cuda":
        return torch.tensor(values, device=device)
    return torch.tensor(values, pin_memory=True).to(device, non_blocking=True)
