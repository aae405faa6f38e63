"""A SIMULATED device: a (tiny) model whose every forward takes a configured time, for scheduling tests.

`simulate_device(model, cost)` wraps `model.forward`: the real forward runs (so outputs, caches and exactness
are real), then the call is padded to `cost.seconds(tokens, width)`:

- `on_core=False` (an accelerator): the rest is slept. A host thread waiting on a GPU kernel behaves like this:
  it uses no CPU and releases the GIL, so draft and target really overlap.
- `on_core=True` (shared CPU cores): the rest is spent busy-spinning in Python until the thread has used that
  much CPU time. Two such forwards at once share the interpreter (the GIL), so each takes longer, as a
  verifier sharing cores with the speculator does.

`tokens` is the number of input positions per row, `width` the number of rows (SSD's branches).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

_MARK = "_hf_ssd_simulated"


@dataclass
class DeviceCost:
    """Time of one forward: `base_s + per_token_s * tokens + per_row_s * (width - 1)` seconds.

    `per_row_s=0` makes batching free (a batch of branches costs one branch, as on a GPU).
    """

    base_s: float
    per_token_s: float = 0.0
    per_row_s: float = 0.0
    on_core: bool = False

    def seconds(self, tokens: int, width: int) -> float:
        return self.base_s + self.per_token_s * tokens + self.per_row_s * max(0, width - 1)


def _spin_cpu(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:  # pure Python: holds the GIL except at switch intervals
        pass


def simulate_device(model, cost: DeviceCost):
    """Make `model`'s forwards take `cost` (in place; `unsimulate` undoes it). Returns the model."""
    unsimulate(model)
    original = model.forward

    @functools.wraps(original)  # keeps the signature, which transformers and the drafter inspect
    def forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        width, tokens = (ids.shape[0], ids.shape[-1]) if ids is not None and ids.dim() == 2 else (1, 1)
        wall, cpu = time.perf_counter(), time.thread_time()
        out = original(*args, **kwargs)
        want = cost.seconds(tokens, width)
        if cost.on_core:
            _spin_cpu(want - (time.thread_time() - cpu))
        else:
            left = want - (time.perf_counter() - wall)
            if left > 0:
                time.sleep(left)
        return out

    model.forward = forward
    setattr(model, _MARK, cost)
    return model


def unsimulate(model):
    if getattr(model, _MARK, None) is not None:
        model.__dict__.pop("forward", None)
        model.__dict__.pop(_MARK, None)
    return model
