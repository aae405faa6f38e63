"""Where the speculator runs, chosen from where the models are placed.

- thread: CPU models; the speculator is a Python thread (torch releases the GIL inside kernels) and each side
  gets `cpu_threads` intra-op threads so the two do not fight over cores.
- stream: draft and target on the same CUDA device; draft work is issued on its own CUDA stream.
- device: the draft on a device of its own (another GPU, or the CPU next to a GPU target).
- inline: no overlap at all (the speculator's work sits on the critical path); for comparisons.
"""

from __future__ import annotations

import contextlib

import torch


class LayoutError(ValueError):
    """The requested layout cannot run with the models where they are placed."""


def model_devices(model) -> set[torch.device]:
    return {p.device for p in model.parameters()}


def resolve_layout(layout: str, target, draft) -> str:
    t_devs, d_devs = model_devices(target), model_devices(draft)
    d_cuda = any(d.type == "cuda" for d in d_devs)
    t_cuda = any(d.type == "cuda" for d in t_devs)
    if len(d_devs) > 1:
        raise LayoutError(
            f"The draft model is spread over {sorted(map(str, d_devs))}; SSD needs the draft on one device "
            "(load it with device_map={'': device})."
        )
    if layout == "auto":
        if not d_cuda and not t_cuda:
            return "thread"
        return "stream" if d_devs <= t_devs and len(t_devs) == 1 else "device"
    if layout == "thread" and d_cuda:
        raise LayoutError("layout='thread' runs the speculator on CPU cores, but the draft is on CUDA: use "
                          "layout='stream' (same GPU) or 'device' (own GPU), or 'auto'.")
    if layout == "stream":
        if not torch.cuda.is_available() or not d_cuda:
            raise LayoutError("layout='stream' needs the draft on a CUDA device (it issues draft work on its own "
                              "CUDA stream); on CPU use layout='thread' or 'auto'.")
        if d_devs != t_devs:
            raise LayoutError(f"layout='stream' needs draft and target on the same GPU; draft on "
                              f"{sorted(map(str, d_devs))}, target on {sorted(map(str, t_devs))}. Use "
                              "layout='device' for separate devices.")
    if layout == "device" and d_devs <= t_devs and len(t_devs) == 1:
        raise LayoutError("layout='device' needs the draft on a device of its own, but it shares "
                          f"{sorted(map(str, d_devs))} with the target: use 'stream' on one GPU or 'thread' on CPU.")
    return layout


def default_cpu_threads() -> int:
    """The caller's torch intra-op setting (all cores unless changed) for each side.

    Measured on the 2-core reference machine with the real pair: both sides at 2 threads ran 3.36 tok/s against
    2.66 with one core each, since either side gets the whole machine while the other waits
    (docs/performance.md)."""
    return max(1, torch.get_num_threads())


@contextlib.contextmanager
def thread_settings(layout: str, config, model):
    """For the CPU thread layout, set the verifier's intra-op threads for the call (restored afterwards)."""
    if layout != "thread":
        yield None
        return
    n = config.cpu_threads or default_cpu_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)
