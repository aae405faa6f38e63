"""`SSDConfig`: every knob of Speculative Speculative Decoding, validated on construction."""

from __future__ import annotations

import difflib
import functools
from dataclasses import asdict, dataclass, fields
from typing import Literal

FALLBACKS = ("sd", "short", "ar", "ngram")
FANOUTS = ("geometric", "calibrated")
LAYOUTS = ("auto", "thread", "stream", "device", "inline")
SCHEDULES = ("auto", "fixed")
DRAFT_MATMULS = ("auto", "transposed", "half", "stock")
VERIFY_MATMULS = ("auto", "transposed", "stock")


class SSDConfigError(ValueError):
    """An invalid `SSDConfig` value; the message names the field and what to change."""


class SSDConfigFieldError(SSDConfigError, TypeError):
    """An `SSDConfig` field that does not exist (a TypeError too, as for any unknown keyword argument)."""


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SSDConfigError(f"SSDConfig.{name} must be an int, got {type(value).__name__} ({value!r}).")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise SSDConfigError(f"SSDConfig.{name} must be {bound}, got {value}.")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SSDConfigError(f"SSDConfig.{name} must be one of {list(choices)}, got {value!r}.")


@dataclass
class SSDConfig:
    """Configuration of SSD, passed as `model.generate(..., ssd_config=SSDConfig(...))`.

    Args:
        gamma: number of draft tokens proposed per round (the draft length).
        fanout: `"calibrated"` (default; measured 1-16 points higher hit rate than "geometric" at equal budget on
            the default pair, docs/performance.md) or `"geometric"` to split `fanout_budget` across acceptance lengths k = 0..gamma in proportion to
            the probability of each k under the measured acceptance rate; `"calibrated"` to give the budget to
            the most likely outcomes overall, with P(accept) at each position learned online as a function of
            the draft's probability of the token it drafted (`hf_ssd/speculation/predictor.py`); or an explicit list of
            gamma + 1 ints (the number of bonus tokens to pre-draft for each k).
        fanout_budget: total number of predicted outcomes per round for the geometric allocation. `None`
            picks by layout: 8 where the speculator has a GPU (batched branches are nearly free there), 1 on CPU
            (each extra branch slows every draft step; measured best on the 2-core reference machine).
        max_outcomes: outcome-space truncation: keep at most this many most likely outcomes per round
            (`None`: the fan-out budget, or the sum of an explicit fan-out list).
        cache_size: capacity of the speculation cache (entries a row's job may pre-draft); never exceeded.
        fallback: what a cache miss does: `"sd"` drafts gamma tokens now, `"short"` drafts `fallback_gamma`
            tokens now, `"ar"` proposes nothing this round, `"ngram"` proposes a prompt-lookup continuation.
            Left unset with `schedule="auto"`, a miss drafts the length the scheduler's cost model finds best
            (from 1 to gamma; short where hit rounds are much faster than drafting, docs/scheduling.md).
        fallback_gamma: draft length of the `"short"` fallback (default: gamma // 2, at least 1). Given without
            `fallback`, it selects `fallback="short"`; with another fallback it is an error (it would be ignored).
        ngram_size: longest n-gram matched by the `"ngram"` fallback.
        saguaro_c: Saguaro sampling constant in [0, 1): when sampling, the draft probabilities of the top
            fan-out tokens are scaled by C before drafting, so that a rejection's residual lands on tokens the
            cache holds. `None` drafts from the plain draft distribution. Exact either way; no effect in greedy.
        initial_acceptance: acceptance-rate prior used before any round was verified.
        warmup_budget: with `schedule="auto"`, how much learning whether drafting pays may cost a pair with no
            measurements yet, as a share of its decode time. Until the predicted cost of learning at its worst (the
            draft reading the context, then a few drafting rounds that accept nothing) fits within this share of
            the pair's decode time so far plus the call's, rounds run the target alone (AR), so a short first call
            is not slowed by exploring (docs/scheduling.md, "Warm-up"). A tuning profile (`hf-ssd tune`) starts a
            process past the warm-up. `None`: learn in the first call, whatever it costs.
        layout: where the speculator runs: `"auto"`, `"thread"` (CPU thread), `"stream"` (own CUDA stream on
            the target's GPU), `"device"` (draft on its own device), `"inline"` (no overlap; for comparison).
        cpu_threads: torch intra-op threads for each of verifier and speculator on CPU (`None`: the caller's
            `torch.get_num_threads()`, all cores by default).
        hit_rate_warning: warn when a call's cache hit rate is below this (0 disables).
        record_timeline: keep per-round timing events in the stats (for `hf_ssd.plot_timeline`).
        static_draft: draft with preallocated KV caches and fixed one-token step shapes (`hf_ssd/drafting/static.py`)
            instead of growing DynamicCaches. `None`: on when the draft is on CUDA (where graphs need it), off on
            CPU. Drafts it cannot drive (sliding-window, ALiBi, flash attention) use the dynamic path, logged.
        cuda_graphs: capture each static draft step once as a CUDA graph and replay it. `None`: on for CUDA
            drafts on the static path. `True` turns the static path on; on CPU it then runs without graphs;
            on CUDA a failed capture raises (with `None` it is logged and the step runs eagerly).
        schedule: `"auto"` (default) picks, every round, the option with the best predicted tokens/s from costs
            measured online (overlapped SSD at some fan-out budget and gamma, plain speculative decoding, or the
            target alone); values set explicitly here are kept as constraints (docs/scheduling.md).
            `"fixed"` always runs overlapped SSD with the values above (the budget default picked by layout).
        draft_matmul: how the draft's `nn.Linear` layers multiply on CPU during the call (`hf_ssd/drafting/matmul.py`).
            `"auto"` (default): float32 CPU layers compute few-row products as (W @ x^T)^T where that is faster on
            this CPU, timed once per process on the draft's layers (on a 2-vCPU AMD EPYC 2.8-4.7x as fast as
            `linear` for 1-4 rows, on a 2-vCPU Intel Xeon half as fast), and one-row steps (batch-1 drafting) with
            float16 copies of the weights where those timed faster still (on the AMD EPYC the real pair's draft
            stepped in 58 ms against 113 ms; the copies, half the float32 weights' size, live as long as the draft);
            `"transposed"`: the transposed product for every floating-point CPU layer, untimed; `"half"`: that, and
            one-row steps in float16, untimed; `"stock"`: the draft runs as given. Restored when the call ends. The
            draft only proposes, so none of these changes what is generated.
        verify_matmul: the same for the target's `nn.Linear` layers, in its verify forwards only (those that score
            drafted candidates, up to 8 tokens in all, 16 where also faster there; `hf_ssd/drafting/matmul.py`).
            `"auto"` (default): float32 CPU layers where the transposed product timed faster at 4 rows on this CPU
            (on a 2-vCPU AMD EPYC the 1.5B target verified 4 tokens in 0.35 s against 0.84 s, about one one-token
            step); `"transposed"`: untimed, up to 16 tokens; `"stock"`: transformers' product. A verify already
            rounds its last bits unlike the target's one-token steps with either product; those steps, the prompt's
            prefill and plain batched decoding always keep transformers' product. hf_ssd's loop only: the one-prompt settings that run transformers'
            assisted loop (`static_draft`, `cuda_graphs`) refuse `"transposed"`.

    `pipeline_depth` and `eviction` (pre-drafting rounds beyond the one being verified) were removed in 0.2.0:
    passing either raises an error that says why (`REMOVED`).
    """

    gamma: int = 4
    fanout: Literal["geometric", "calibrated"] | list[int] = "calibrated"
    fanout_budget: int | None = None
    max_outcomes: int | None = None
    cache_size: int = 64
    fallback: Literal["sd", "short", "ar", "ngram"] = "sd"
    fallback_gamma: int | None = None
    ngram_size: int = 3
    saguaro_c: float | None = None
    initial_acceptance: float = 0.7
    warmup_budget: float | None = 0.03
    layout: Literal["auto", "thread", "stream", "device", "inline"] = "auto"
    cpu_threads: int | None = None
    hit_rate_warning: float = 0.6
    record_timeline: bool = False
    static_draft: bool | None = None
    cuda_graphs: bool | None = None
    schedule: Literal["auto", "fixed"] = "auto"
    draft_matmul: Literal["auto", "transposed", "half", "stock"] = "auto"
    verify_matmul: Literal["auto", "transposed", "stock"] = "auto"

    def __post_init__(self) -> None:
        self.validate()

    def __setattr__(self, name, value) -> None:
        # After construction, assigning gamma counts as setting it explicitly (a constraint for the scheduler).
        if name == "gamma" and "_set_fields" in self.__dict__:
            self.__dict__["_set_fields"] = self.__dict__["_set_fields"] | {"gamma"}
        object.__setattr__(self, name, value)

    def passed(self, name: str) -> bool:
        """Whether the caller passed this field to the constructor (or assigned gamma since)."""
        return name in self.__dict__.get("_set_fields", frozenset())

    def is_set(self, name: str) -> bool:
        """Whether the user chose this value (the scheduler keeps it) or left the default (the scheduler may tune).

        `gamma` counts as set when passed to the constructor or assigned; `fallback` when it or `fallback_gamma`
        was passed to the constructor; the fan-out when it is a list or `fanout_budget` is not None; the layout
        when it is not "auto"; `cpu_threads` when not None.
        """
        if name == "gamma":
            return self.passed("gamma")
        if name == "fallback":  # passed to the constructor (either field): the scheduler keeps that fallback
            return self.passed("fallback") or self.passed("fallback_gamma")
        if name == "fanout":
            return isinstance(self.fanout, list)
        if name == "fanout_budget":
            return self.fanout_budget is not None
        if name == "layout":
            return self.layout != "auto"
        if name == "cpu_threads":
            return self.cpu_threads is not None
        raise ValueError(f"SSDConfig.is_set: unknown or untracked field {name!r}")

    def validate(self) -> None:
        _check_int("gamma", self.gamma, 1, 64)
        if isinstance(self.fanout, str):
            _check_choice("fanout", self.fanout, FANOUTS)
        elif isinstance(self.fanout, (list, tuple)):
            if len(self.fanout) != self.gamma + 1:
                raise SSDConfigError(
                    f"SSDConfig.fanout as a list needs gamma + 1 = {self.gamma + 1} entries (one per acceptance "
                    f"length k = 0..gamma), got {len(self.fanout)}."
                )
            for i, f in enumerate(self.fanout):
                _check_int(f"fanout[{i}]", f, 0)
            self.fanout = list(self.fanout)
        else:
            raise SSDConfigError(
                f"SSDConfig.fanout must be 'geometric', 'calibrated' or a list of ints, got {type(self.fanout).__name__}."
            )
        if self.fanout_budget is not None:
            _check_int("fanout_budget", self.fanout_budget, 0, 4096)
        if self.max_outcomes is not None:
            _check_int("max_outcomes", self.max_outcomes, 0, 4096)
        _check_int("cache_size", self.cache_size, 1)
        _check_choice("fallback", self.fallback, FALLBACKS)
        if self.fallback_gamma is not None:
            _check_int("fallback_gamma", self.fallback_gamma, 1, self.gamma)
            if self.fallback != "short":
                raise SSDConfigError(
                    f"SSDConfig.fallback_gamma is the draft length of fallback='short', but fallback is "
                    f"{self.fallback!r}, which would ignore it. Use fallback='short' (or leave fallback unset), or "
                    "remove fallback_gamma."
                )
        _check_int("ngram_size", self.ngram_size, 1, 32)
        if self.saguaro_c is not None:
            if isinstance(self.saguaro_c, bool) or not isinstance(self.saguaro_c, (int, float)):
                raise SSDConfigError(f"SSDConfig.saguaro_c must be a float in [0, 1) or None, got {self.saguaro_c!r}.")
            if not 0.0 <= float(self.saguaro_c) < 1.0:
                raise SSDConfigError(
                    f"SSDConfig.saguaro_c must be in [0, 1) (1 would be plain sampling: use None), got {self.saguaro_c}."
                )
        for name in ("initial_acceptance", "hit_rate_warning"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise SSDConfigError(f"SSDConfig.{name} must be a float in [0, 1], got {value!r}.")
        if self.warmup_budget is not None and (
                isinstance(self.warmup_budget, bool) or not isinstance(self.warmup_budget, (int, float))
                or not 0.0 < self.warmup_budget <= 1.0):
            raise SSDConfigError(f"SSDConfig.warmup_budget must be a float in (0, 1] (a share of decode time) or None "
                                 f"(learn at once), got {self.warmup_budget!r}.")
        _check_choice("layout", self.layout, LAYOUTS)
        if self.cpu_threads is not None:
            _check_int("cpu_threads", self.cpu_threads, 1, 1024)
        if not isinstance(self.record_timeline, bool):
            raise SSDConfigError(f"SSDConfig.record_timeline must be a bool, got {self.record_timeline!r}.")
        for name in ("static_draft", "cuda_graphs"):
            if not any(getattr(self, name) is v for v in (None, True, False)):  # 1 == True: check identity
                raise SSDConfigError(f"SSDConfig.{name} must be True, False or None (auto), got {getattr(self, name)!r}.")
        if self.cuda_graphs is True and self.static_draft is False:
            raise SSDConfigError("SSDConfig.cuda_graphs=True needs the static draft path: CUDA graphs replay fixed "
                                 "shapes. Remove static_draft=False (or set cuda_graphs=False).")
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("draft_matmul", self.draft_matmul, DRAFT_MATMULS)
        _check_choice("verify_matmul", self.verify_matmul, VERIFY_MATMULS)

    def resolved_budget(self, on_gpu: bool) -> tuple[int, int]:
        """(fan-out budget, max outcomes) with the `None` defaults filled in for this placement."""
        budget = self.fanout_budget
        if budget is None:
            budget = 8 if on_gpu else 1
        limit = self.max_outcomes
        if limit is None:
            limit = sum(self.fanout) if isinstance(self.fanout, list) else budget
        return budget, limit

    def resolved_draft_path(self, draft_on_cuda: bool) -> tuple[bool, bool]:
        """(static draft path, CUDA graphs) with the `None` defaults filled in for where the draft runs."""
        if self.static_draft is not None:
            static = self.static_draft
        else:
            static = self.cuda_graphs is True or draft_on_cuda
        return static, static and draft_on_cuda and self.cuda_graphs is not False

    @property
    def effective_fallback_gamma(self) -> int:
        return self.fallback_gamma if self.fallback_gamma is not None else max(1, self.gamma // 2)

    def to_dict(self) -> dict:
        return asdict(self)


# Fields that were removed, and why: passing one says so (and what to do) instead of "unexpected argument".
_DEPTH_GONE = ("pre-drafting more than one round ahead never beat SSDConfig() as it comes, which schedules gamma "
               "and fan-out for the round being verified (simulated device, the harnesses built for depth > 1: "
               "0.90-0.96x; docs/performance.md, \"Pipeline depth > 1\")")
REMOVED = {
    "pipeline_depth": f"SSDConfig.pipeline_depth was removed in hf_ssd 0.2.0: {_DEPTH_GONE}. Remove the argument "
                      "(the speculator pre-drafts the round after the one being verified).",
    "eviction": f"SSDConfig.eviction was removed in hf_ssd 0.2.0 with pipeline_depth, the only setting where it acted: "
                f"{_DEPTH_GONE}. Remove the argument (a round's entries never exceed cache_size).",
}


def _unknown_field_message(name: str) -> str:
    if name in REMOVED:
        return REMOVED[name]
    names = [f.name for f in fields(SSDConfig)]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else f" The fields are: {', '.join(names)}."
    return f"SSDConfig() got an unexpected keyword argument {name!r}.{hint}"


def _check_field_names(init):
    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        known = SSDConfig.__dataclass_fields__
        for name in kwargs:
            if name not in known:
                raise SSDConfigFieldError(_unknown_field_message(name))
        init(self, *args, **kwargs)

    return checked


# The generated __init__ would raise a bare TypeError; this one also says which field was meant.
SSDConfig.__init__ = _check_field_names(SSDConfig.__init__)
_dataclass_init = SSDConfig.__init__


@functools.wraps(_dataclass_init)
def _init_tracking_set_fields(self, *args, **kwargs):
    # Which fields the caller passed: the scheduler treats those as constraints. (A copy made with
    # dataclasses.replace passes every field, so it counts gamma as set.)
    passed = {f.name for f in fields(SSDConfig)[: len(args)]} | set(kwargs)
    if kwargs.get("fallback_gamma") is not None and "fallback" not in passed:
        kwargs["fallback"] = "short"  # the only fallback that reads it: asking for its length asks for it
    self.__dict__["_set_fields"] = frozenset()
    _dataclass_init(self, *args, **kwargs)
    self.__dict__["_set_fields"] = frozenset(passed)


SSDConfig.__init__ = _init_tracking_set_fields
