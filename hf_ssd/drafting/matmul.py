"""The CPU linear layers of the draft, and of the target in its verify forwards: the same product, computed the way
the CPU kernels run it fastest.

Why: torch's CPU float32 `linear` (x @ W^T) on a few rows can take a matrix-vector path per row. Measured on
one 2-core machine of the kind this project runs on (`python scripts/matmul_bench.py --real`, torch 2.13, an 8960 x 1536
weight, 30 copies so nothing stays in cache): `linear` 3.6 / 5.6 / 8.7 / 5.3 ms for 1 / 2 / 3 / 4 rows, the same
product as (W @ x^T)^T 1.2-1.9 ms (2.8-4.7x); 1.1-1.5x for 5-8 rows, equal at 16. With the real pair's draft
(Qwen2.5-Coder 0.5B) a one-token step takes 0.062 s instead of 0.122 s and a 2-4-row batched step 0.064-0.080 s
instead of 0.21-0.34 s (docs/performance.md).

Which is faster depends on the CPU: on a 2-vCPU Intel Xeon (torch 2.13, a 4864 x 896 weight)
`linear` took 0.84-0.88 ms for 1-3 rows against 1.7 ms transposed, and the real pair's draft step 0.12 s against
0.26 s. So "auto" times both products on the draft's own layers once per process (`transposed_pays`, ~50 ms)
and patches only where the transposed one is faster.

Its one-row steps (batch-1 drafting) can also multiply by a float16 copy of each weight: half the bytes to stream.
On the 2-vCPU AMD EPYC the real pair's draft stepped in 58 ms that way against 113 ms transposed, its greedy
tokens the same over 6 HumanEval prompts x 48 tokens (`scripts/matmul_bench.py --real`); at 2 and 4 rows float16
took 122 and 176 ms against 109 and 111, so it serves one row only. "auto" times it on the draft's layers too. A
product that overflows float16 is recomputed in the layer's own dtype. A layer's copy is made at its first one-row
product, so calls that never draft one row (the target alone, batches) pay neither its time nor its memory; it
lives as long as the layer (half the float32 weights' size). The seconds spent copying are counted apart, per thread
(`setup_seconds`): the loop takes them out of the round's measured draft time, from which the scheduler prices a
draft step.

The draft (`draft_matmul`): it only proposes. Greedy identity rests on the target's own argmax, and speculative
sampling on the draft's probabilities as computed for the proposal, whatever their last rounding bits.

The target (`verify_matmul`): only its verify forwards, those that score drafted candidates, and only on the
caller's thread inside `verifying()`. Those forwards already take another product than the target alone's
one-token steps (torch's few-row product is not its one-row one), so the target's verify rounds its last bits
differently from its AR steps whichever product runs: measured on the real pair's target (float32, 2 threads),
logits of a 2-8-token verify differed from one-token steps by at most 1.7-2.4e-5 with `linear` and 1.3-3.3e-5
transposed, the argmax the same. Its one-token steps, its prompt prefill and plain batched decoding keep
transformers' own product, bit for bit. On a 2-vCPU AMD EPYC the 1.5B target verified 4 tokens in 0.35 s
transposed against 0.84 s (a one-token step: 0.38 s), which is what makes SD pay at batch 1 on such a CPU.
"auto" times the target's products at its first verify that scores candidates (`_VerifyLimit`), not when the call
starts: a call that only runs AR rounds (a first call on prompts where the draft helps little) never pays the timing,
about 0.25 s of the real pair's first call. Those seconds count as setup too: the verify's measured time leaves them out.

"auto"'s verdicts are remembered on disk (`<cache>/matmul/<key>.json`, keyed on the machine and the versions of
hf_ssd, torch, transformers and Python; off with HF_SSD_NO_PROFILE=1, as profiles are), so that later processes on
the machine skip the timings: 0.3-0.4 s of a first call with the real pair. Delete the folder to time them again.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
import types
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..scheduling import profile

MAX_ROWS = 8  # above this the stock kernel is as fast (measured: 1.1x at 8 rows, equal at 16)
TIMED_ROWS = (1, 4)  # the draft's usual steps: one trunk row, a few branches
VERIFY_ROWS = (4,)  # a batch-1 verify of 3 candidates (the target's product is timed there) ...
VERIFY_TIMED_LAYERS = 2  # ... on 2 layers: the 1.5B target's 4 took 0.32-0.40 s at 2 and 4 rows, paid by a first call
# ... and then at this many: where also faster there, verifies up to it take the product (long SD drafts, B = 2-4).
# Measured on a 2-vCPU AMD EPYC: the 1.5B target's 16-token verify 0.84 s against 1.10 s.
VERIFY_WIDE_ROWS = 16
TIMED_LAYERS = 4  # distinct weights, so that the timing streams them from memory as a real step does
TIMED_MIN_PARAMS = 1 << 20  # smaller weights keep the transposed product untimed: microsecond timings are noise
HALF_ROWS = 1  # float16 copies serve one-row products only (slower than the transposed product at 2 and 4 rows)

_lock = threading.Lock()
# model -> [calls using it, {module: forward}], one registry per role (a draft that is the target is both)
_active = {"draft": weakref.WeakKeyDictionary(), "verify": weakref.WeakKeyDictionary()}
_verifying = threading.local()  # .on: this thread runs a verify forward (`verifying`)
# layer -> ((weight's data_ptr, version), its float16 copy): made at the layer's first one-row half product
_halves: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_setup = threading.local()  # .seconds: one-time work inside this thread's forwards (`setup_seconds`)


def _transposed_forward(self: torch.nn.Linear, x: torch.Tensor, max_rows: int = MAX_ROWS) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or rows > max_rows or x.dtype != self.weight.dtype or x.device != self.weight.device:
        return F.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:  # one row is a matrix-vector product either way; two rows take the fast path
        flat = torch.cat([flat, torch.zeros_like(flat)])
    y = torch.mm(self.weight, flat.t()).t()[:rows].contiguous()
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], self.weight.shape[0])


def _half_weight(layer: torch.nn.Linear) -> torch.Tensor:
    """`layer`'s weight in float16, copied once and again only after the weight changed (in place or replaced)."""
    w = layer.weight
    stamp = (w.data_ptr(), w._version)
    entry = _halves.get(layer)
    if entry is None or entry[0] != stamp:
        start = time.perf_counter()
        entry = _halves[layer] = (stamp, w.detach().to(torch.float16))
        count_setup(time.perf_counter() - start)
    return entry[1]


def count_setup(seconds: float) -> None:
    _setup.seconds = setup_seconds() + seconds


def setup_seconds() -> float:
    """Seconds this thread has spent on one-time work inside forwards: float16 copies (`_half_weight`) and the
    timing of the target's verify product (`_VerifyLimit`). A timed stretch subtracts what it grew by, so that
    one-time work prices neither a draft step nor a verify. Per thread: a speculation job's draft steps are timed on
    its own thread while the caller's verify may be timing products."""
    return getattr(_setup, "seconds", 0.0)


def _half_product(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """x @ W^T with float16 operands (a copy of W) and the result in x's dtype; None where it overflowed."""
    y = F.linear(x.to(torch.float16), _half_weight(self)).to(x.dtype)
    if not bool(torch.isfinite(y).all()):  # float16 tops out at 65504: the caller recomputes in x's dtype
        return None
    return y if self.bias is None else y + self.bias


def _draft_forward(self: torch.nn.Linear, x: torch.Tensor, half: bool = False, transposed: bool = True) -> torch.Tensor:
    """A draft layer: one-row products with the float16 copy where `half`, up to MAX_ROWS rows transposed where
    `transposed`, else transformers' own."""
    if half and x.numel() == x.shape[-1] and x.dtype == self.weight.dtype and x.device == self.weight.device:
        y = _half_product(self, x)
        if y is not None:
            return y
    if transposed:
        return _transposed_forward(self, x)
    return F.linear(x, self.weight, self.bias)


def _verify_forward(self: torch.nn.Linear, x: torch.Tensor, max_rows: int | Callable[[], int] = MAX_ROWS
                    ) -> torch.Tensor:
    """A target layer: the transposed product inside `verifying()` on this thread (up to `max_rows` tokens in
    all; a callable gives that limit at the first verify, 0 for none), else transformers' own."""
    if getattr(_verifying, "on", False):
        limit = max_rows if isinstance(max_rows, int) else max_rows()
        if limit:
            return _transposed_forward(self, x, limit)
    return F.linear(x, self.weight, self.bias)


class _VerifyLimit:
    """The largest verify (tokens in all) that takes the transposed product on one target's layers under "auto",
    timed at the first verify forward that asks (`_verify_limit`); once per process and thread count, as every
    verdict (a round of an option with fewer threads verifies with fewer). Its seconds count as this thread's setup
    (`setup_seconds`). A speculation job may be drafting on another thread meanwhile: both products are timed
    interleaved, so that load weighs on both."""

    def __init__(self, layers: list[torch.nn.Linear]):
        self.layers, self.limits, self.lock = layers, {}, threading.Lock()

    def __call__(self) -> int:
        threads = torch.get_num_threads()
        limit = self.limits.get(threads)
        if limit is None:
            with self.lock:
                start = time.perf_counter()
                limit = self.limits[threads] = _verify_limit(self.layers)  # at once where timed already
                count_setup(time.perf_counter() - start)
        return limit


def _verify_limit(layers: list[torch.nn.Linear], timing: bool = True) -> int | None:
    """The verify limit for `layers` under "auto": 0 where the transposed product did not win at VERIFY_ROWS,
    else VERIFY_WIDE_ROWS where it won there too, else MAX_ROWS. Without `timing`, None where a verdict it needs
    has not been timed yet in this process."""
    pays = transposed_pays(layers, VERIFY_ROWS, small=False, count=VERIFY_TIMED_LAYERS, timing=timing)
    if not pays:
        return None if pays is None else 0
    wide = transposed_pays(layers, (VERIFY_WIDE_ROWS,), small=False, count=VERIFY_TIMED_LAYERS, timing=timing)
    return None if wide is None else VERIFY_WIDE_ROWS if wide else MAX_ROWS


@contextlib.contextmanager
def verifying(on: bool = True):
    """The caller's thread runs a verify forward (`on`): the target's layers patched by `verify_matmul` take the
    transposed product. Other threads (a speculation job) and other forwards are untouched."""
    before = getattr(_verifying, "on", False)
    _verifying.on = on
    try:
        yield
    finally:
        _verifying.on = before


def wanted(mode: str, module: torch.nn.Module) -> bool:
    """Whether `module` may get another product under `mode` ("auto", "transposed", "half" or "stock")."""
    if type(module) is not torch.nn.Linear or mode == "stock":  # subclasses (quantized layers) keep their own
        return False
    w = module.weight
    if w.device.type != "cpu" or not w.dtype.is_floating_point:
        return False
    return mode != "auto" or w.dtype == torch.float32  # auto: the measured case only


_verdicts: dict = {}  # "shape/dtype/threads/rows timed" -> whether that product ran faster (`_verdict`)
_read: set = set()  # the verdict files this process has read (`_remembered`)


def _commonest(layers: list[torch.nn.Linear], count: int) -> list[torch.nn.Linear]:
    """Up to `count` of `layers` of their commonest weight shape by parameters: what a timing samples."""
    weight = {}
    for m in layers:
        weight[tuple(m.weight.shape)] = weight.get(tuple(m.weight.shape), 0) + m.weight.numel()
    shape = max(weight, key=weight.get)
    return [m for m in layers if tuple(m.weight.shape) == shape][:count]


@torch.no_grad()
def transposed_pays(layers: list[torch.nn.Linear], rows: tuple[int, ...] = TIMED_ROWS, small: bool = True,
                    count: int = TIMED_LAYERS, timing: bool = True) -> bool | None:
    """Whether the transposed product beats `linear` on this CPU for `layers`' commonest weight shape (by
    parameters), timed once per process and thread count over up to `count` of those layers at `rows` rows, the
    best of three passes of each; a tie keeps `linear`. Weights under TIMED_MIN_PARAMS are not timed: the answer
    is `small`. Without `timing`, None where it has not been timed yet."""
    if not layers:
        return False
    sample = _commonest(layers, count)
    if sample[0].weight.numel() < TIMED_MIN_PARAMS:  # cheap either way: a stable choice for tiny models
        return small
    return _verdict(_key(sample, ",".join(map(str, rows))),
                    (lambda: _time_products(sample, rows) == "transposed") if timing else None)


@torch.no_grad()
def half_pays(layers: list[torch.nn.Linear]) -> bool:
    """Whether one-row products with float16 copies beat both float32 products on this CPU for `layers`' commonest
    weight shape, timed once per process and thread count as `transposed_pays` times; tiny weights: no."""
    if not layers:
        return False
    sample = _commonest(layers, TIMED_LAYERS)
    if sample[0].weight.numel() < TIMED_MIN_PARAMS:
        return False

    def measure() -> bool:
        pays = _time_products(sample, (HALF_ROWS,), half=True) == "half"
        if not pays:  # the timing's copies serve nothing
            for m in sample:
                _halves.pop(m, None)
        return pays

    return _verdict(_key(sample, "half"), measure)


def _key(sample: list[torch.nn.Linear], timed: str) -> str:
    w = sample[0].weight
    return f"{'x'.join(map(str, w.shape))}/{str(w.dtype).removeprefix('torch.')}/{torch.get_num_threads()}/{timed}"


def _verdict(key: str, measure: Callable[[], bool] | None) -> bool | None:
    """The verdict of `key`: this process's, else one remembered on disk (`_remembered`), else `measure()`'s, then
    remembered; None without `measure` where there is none yet."""
    if key not in _verdicts:
        path = _remembered()
        if key not in _verdicts:
            if measure is None:
                return None
            _verdicts[key] = measure()
            if path is not None:
                with contextlib.suppress(OSError):
                    profile.write_atomic(path, {"verdicts": {**_on_disk(path), key: _verdicts[key]}})
    return _verdicts[key]


def _remembered() -> Path | None:
    """The verdict file of this machine and these versions, read into `_verdicts` once per process (a verdict
    this process timed stays); None with profiles off (HF_SSD_NO_PROFILE=1, as in the test suite)."""
    if not profile.enabled():
        return None
    path = profile.cache_file("matmul", {"machine": profile.machine(), "versions": profile.versions()})
    if path not in _read:
        _read.add(path)
        for k, v in _on_disk(path).items():
            _verdicts.setdefault(k, v)
    return path


def _on_disk(path: Path) -> dict:
    """The verdicts a file holds ({} where it is missing or damaged)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        saved = json.loads(path.read_text(encoding="utf-8")).get("verdicts", {})
        return {k: v for k, v in saved.items() if isinstance(k, str) and isinstance(v, bool)}
    return {}


def _time_products(sample: list[torch.nn.Linear], timed_rows: tuple[int, ...] = TIMED_ROWS,
                   half: bool = False) -> str:
    """"transposed" or "linear" (or "half", with `half`): which took less time in all over `timed_rows` (best of 3
    passes after a warm one, which also makes the float16 copies)."""
    products = {"linear": lambda m, x: F.linear(x, m.weight, m.bias), "transposed": _transposed_forward}
    if half:
        products["half"] = _half_product
    total = dict.fromkeys(products, 0.0)
    for rows in timed_rows:
        x = torch.randn(rows, sample[0].in_features, generator=torch.Generator().manual_seed(rows),  # not the
                        dtype=sample[0].weight.dtype).to(sample[0].weight.device)  # caller's RNG: sampling is seeded
        passes = {name: [] for name in products}
        for _ in range(4):
            for name, product in products.items():  # interleaved, so drift weighs on both
                start = time.perf_counter()
                for m in sample:
                    product(m, x)
                passes[name].append(time.perf_counter() - start)
        for name, seconds in passes.items():
            total[name] += min(seconds[1:])
    return min(total, key=total.get)  # a tie keeps the first: linear


@contextlib.contextmanager
def draft_matmul(draft: torch.nn.Module | None, mode: str, target: torch.nn.Module | None = None):
    """For one generate call: the draft's CPU linear layers use the transposed product, and in one-row steps
    float16 copies of their weights where that pays ("auto" times both) or `mode` is "half" (see module doc).

    Layers the draft shares with `target` (a draft that is the target, or reuses its head) are left alone.
    Concurrent calls on one draft share the patch; the last to leave restores each layer's own forward.
    """
    if draft is None or mode == "stock":
        yield 0
        return

    def plan():
        shared = {id(m) for m in target.modules()} if target is not None else set()
        found = [m for m in draft.modules() if wanted(mode, m) and id(m) not in shared]
        if mode == "auto":
            half, transposed = half_pays(found), transposed_pays(found)
        else:
            half, transposed = mode == "half", True
        if not (half or transposed):
            return [], None
        return found, functools.partial(_draft_forward, half=half, transposed=transposed)

    with _patched("draft", draft, plan) as n:
        yield n


@contextlib.contextmanager
def verify_matmul(target: torch.nn.Module, mode: str):
    """For one generate call: the target's CPU linear layers take the transposed product in its verify forwards
    (`verifying`), where "auto" timed it faster at VERIFY_ROWS rows (see module doc), in verifies of up to
    MAX_ROWS tokens in all, or VERIFY_WIDE_ROWS where it also timed faster there; tiny weights keep `linear`.
    Not timed yet in this process: the layers are patched, and the first verify times them (`_VerifyLimit`).
    Concurrent calls on one target share the patch, as `draft_matmul`'s do."""
    if mode == "stock":
        yield 0
        return

    def plan():
        found = [m for m in target.modules() if wanted(mode, m)]
        if mode == "transposed":
            return found, functools.partial(_verify_forward, max_rows=VERIFY_WIDE_ROWS)
        limit = _verify_limit(found, timing=False)
        if limit == 0:
            return [], None
        return found, functools.partial(_verify_forward, max_rows=_VerifyLimit(found) if limit is None else limit)

    with _patched("verify", target, plan) as n:
        yield n


@contextlib.contextmanager
def _patched(role: str, model: torch.nn.Module, plan: Callable[[], tuple[list, Callable]]):
    """`plan()`'s (layers, forward): `forward` on those layers of `model` while any call of this role uses it,
    then each layer's own again."""
    active = _active[role]
    with _lock:
        entry = active.get(model)
        if entry is None:
            saved = {}
            layers, forward = plan()
            for m in layers:
                saved[m] = m.__dict__.get("forward")  # an instance-level forward someone set: put back
                m.forward = types.MethodType(forward, m)
            entry = active[model] = [0, saved]
        entry[0] += 1
    try:
        yield len(entry[1])
    finally:
        with _lock:
            entry[0] -= 1
            if entry[0] == 0:
                for m, own in entry[1].items():
                    if own is None:
                        m.__dict__.pop("forward", None)
                    else:
                        m.forward = own
                active.pop(model, None)
