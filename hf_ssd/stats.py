"""Per-call statistics of SSD: what users watch (hit rate, acceptance, bubble ratio) and the time split."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time covered by both interval lists (each list sorted and non-overlapping)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


@dataclass
class SSDStats:
    """Statistics of one SSD `generate` call.

    `bubble_ratio` is the share of wall time in which the verifier or the speculator sat idle waiting on the
    other (1 - time both were busy / wall time): 1.0 for strictly alternating SD, towards 0 for full overlap.

    Scheduling: `options` maps each option that produced a round's candidates ("ssd(b=8,g=4)", "sd(g=4)",
    "ar") to {"rounds", "seconds"}; `explored_rounds` counts rounds run to measure an option rather than because
    it was predicted best (`explored_seconds`: their time); `predicted_tokens_per_second` is what the cost
    model predicted for the rounds it decided (compare `tokens_per_second`); `cost_model` is the measured model
    at the end of the call.
    `profile`: the tuning profile (hf_ssd/scheduling/profile.py) the pair's estimates were loaded from in this process, or
    None when they were measured here from the priors.
    """

    rounds: int = 0
    new_tokens: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    partial_hits: int = 0
    fallbacks: dict = field(default_factory=dict)
    outcomes_predicted: int = 0
    branches_drafted: int = 0
    # Calibration of the outcome predictor: per lookup, the predicted probability that the cache holds the real
    # outcome (the summed probabilities of that round's entries), binned, against how often it did.
    predicted_hits: float = 0.0
    hit_calibration_bins: dict = field(default_factory=dict)  # bin (0..4, by predicted probability) -> [n, predicted sum, hits]
    wall_time: float = 0.0  # what the caller waited for, from entering generate to its return
    # Of wall_time: before transformers' generate began (input checks; on a draft's first call, its probe, whose
    # first forwards also fault its weights into memory).
    setup_time: float = 0.0
    verify_time: float = 0.0
    speculate_time: float = 0.0
    fallback_draft_time: float = 0.0
    target_wait_time: float = 0.0
    overlap_time: float = 0.0
    draft_forwards: int = 0
    layout: str = ""
    batch_size: int = 1
    rows: list = field(default_factory=list)  # batched calls: per row new tokens, rounds, acceptance
    draft_path: str = ""  # "batched" (hf_ssd's loop), "plain batched"; one-prompt path: "dynamic", "static", "static+graphs"
    schedule: str = ""
    options: dict = field(default_factory=dict)
    explored_rounds: int = 0
    explored_seconds: float = 0.0  # the explored rounds' time
    # Rounds run as the target alone because the pair has not drafted yet and learning would not fit
    # `SSDConfig.warmup_budget` (schedule.Scheduler.warmup_fits); True in `warming_up`: still so at the end.
    warmup_rounds: int = 0
    warming_up: bool = False
    predicted_tokens: float = 0.0
    predicted_seconds: float = 0.0
    cost_model: dict = field(default_factory=dict)
    profile: str | None = None
    timeline: list = field(default_factory=list, repr=False)
    intervals: dict = field(default_factory=dict, repr=False)  # busy (start, end) lists: verify/speculate/fallback

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.accepted_tokens / self.rounds if self.rounds else 0.0

    @property
    def lookups(self) -> int:
        return self.cache_hits + self.cache_misses

    @property
    def hit_rate(self) -> float:
        return self.cache_hits / self.lookups if self.lookups else 0.0

    @property
    def predicted_hit_rate(self) -> float:
        """Mean predicted hit probability over lookups (compare `hit_rate`)."""
        return self.predicted_hits / self.lookups if self.lookups else 0.0

    def add_lookup(self, predicted: float, hit: bool) -> None:
        predicted = min(1.0, max(0.0, predicted))
        self.predicted_hits += predicted
        entry = self.hit_calibration_bins.setdefault(min(4, int(predicted * 5)), [0, 0.0, 0])
        entry[0] += 1
        entry[1] += predicted
        entry[2] += int(hit)

    def hit_calibration(self) -> list[dict]:
        """Per bin of predicted hit probability: lookups, mean predicted, observed hit rate."""
        return [{"bin": f"{b / 5:.1f}-{(b + 1) / 5:.1f}", "lookups": n, "predicted": p / n, "observed": h / n}
                for b, (n, p, h) in sorted(self.hit_calibration_bins.items())]

    @property
    def bubble_ratio(self) -> float:
        return 1.0 - self.overlap_time / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def predicted_tokens_per_second(self) -> float:
        return self.predicted_tokens / self.predicted_seconds if self.predicted_seconds > 0 else 0.0

    def add_round(self, option: str, seconds: float, prediction=None, explored: bool = False) -> None:
        entry = self.options.setdefault(option, {"rounds": 0, "seconds": 0.0})
        entry["rounds"] += 1
        entry["seconds"] += seconds
        self.explored_rounds += int(explored)
        self.explored_seconds += seconds if explored else 0.0
        if prediction is not None:
            self.predicted_tokens += prediction.tokens
            self.predicted_seconds += prediction.seconds

    def option_shares(self) -> list[tuple[str, int, float]]:
        """(option, rounds, share of round time), most time first."""
        total = sum(e["seconds"] for e in self.options.values()) or 1.0
        rows = [(name, e["rounds"], e["seconds"] / total) for name, e in self.options.items()]
        return sorted(rows, key=lambda r: -r[2])

    def schedule_summary(self) -> str:
        if not self.options:
            return f"schedule {self.schedule}: no rounds"
        parts = ", ".join(f"{name} {share:.0%}" for name, _, share in self.option_shares()[:3])
        more = f" (+{len(self.options) - 3} more)" if len(self.options) > 3 else ""
        pred = f", predicted {self.predicted_tokens_per_second:.2f} tok/s" if self.predicted_seconds > 0 else ""
        return f"schedule {self.schedule}: {parts}{more} of round time{pred}"

    def finalize(self, wall: tuple[float, float], verify: list, speculate: list) -> None:
        """Derive the time split from the busy intervals of verifier and speculator."""
        self.wall_time = wall[1] - wall[0]
        self.verify_time = _length(verify)
        self.speculate_time = _length(speculate)
        self.overlap_time = _overlap(sorted(verify), sorted(speculate))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("timeline")
        d.pop("intervals")
        for name in ("acceptance_rate", "mean_accepted_length", "hit_rate", "bubble_ratio", "tokens_per_second",
                     "predicted_tokens_per_second", "predicted_hit_rate"):
            d[name] = getattr(self, name)
        d["hit_calibration"] = self.hit_calibration()
        return d

    def summary(self) -> str:
        setup = ""
        if self.setup_time >= max(0.5, 0.05 * self.wall_time):  # worth saying: a first call's probe, mostly
            setup = f", {self.setup_time:.2f}s of it set-up before decoding"
        # A call that never drafted (a warm-up, plain batched decoding) has no rates to show: 0% would read as a
        # draft that failed.
        acceptance = (f"acceptance {self.acceptance_rate:.1%} (mean {self.mean_accepted_length:.2f}/round)"
                      if self.proposed_tokens else "acceptance n/a (nothing drafted)")
        hits = (f"hit rate {self.hit_rate:.1%} ({self.cache_hits}/{self.lookups}, predicted "
                f"{self.predicted_hit_rate:.1%})" if self.lookups else "hit rate n/a (no cache lookups)")
        return (
            f"{self.new_tokens} tokens in {self.wall_time:.2f}s ({self.tokens_per_second:.2f} tok/s{setup}) | "
            f"{acceptance} | {hits} | bubble ratio {self.bubble_ratio:.1%} | "
            f"{self.schedule_summary()}{self._profile_summary()}{self._warmup_summary()}"
        )

    def _warmup_summary(self) -> str:
        if not self.warming_up:
            return ""
        return (f" | warm-up: the target alone, {self.warmup_rounds} rounds (learning whether drafting pays would "
                "cost more than SSDConfig.warmup_budget of decode time so far; later or longer calls learn, "
                "`hf-ssd tune` skips it)")

    def _profile_summary(self) -> str:
        if not self.profile:
            return ""
        return f" | profile loaded ({os.path.basename(self.profile)})"
