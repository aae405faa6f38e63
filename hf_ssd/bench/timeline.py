"""A picture of one SSD generation: when the target verified, when the speculator drafted, hits and misses.

Inputs are the per-round events of `SSDStats.timeline` (recorded with `SSDConfig(record_timeline=True)`:
t_request, t_return, t_verified, hit, n_candidates, accepted) and, when available, the busy intervals of the
speculator's background jobs and of the fallback drafts (`SSDStats.intervals`):

    target.generate(..., ssd_config=SSDConfig(record_timeline=True))
    plot_timeline(hf_ssd.last_stats(target), "timeline.png")
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Colors: target work, speculation overlapped with it, drafting on the critical path, idle waits.
VERIFY, SPECULATE, FALLBACK, WAIT = "#1f77b4", "#2ca02c", "#d62728", "#bbbbbb"


@dataclass
class Intervals:
    """Busy intervals (perf_counter seconds) of one SSD call, as kept in `SSDStats.intervals`."""

    verify: list[tuple[float, float]] = field(default_factory=list)
    speculate: list[tuple[float, float]] = field(default_factory=list)  # background speculation jobs
    fallback: list[tuple[float, float]] = field(default_factory=list)  # drafts on the critical path (misses)

    @classmethod
    def from_stats(cls, stats) -> Intervals:
        found = getattr(stats, "intervals", None) or {}
        return cls(**{k: list(found.get(k, [])) for k in ("verify", "speculate", "fallback")})


def _intervals_of(stats, intervals: Intervals | None) -> Intervals:
    return intervals if intervals is not None else Intervals.from_stats(stats)


def plot_timeline(stats, path, intervals: Intervals | None = None, title: str | None = None) -> str:
    """Draw the rounds of one SSD call into `path` (PNG). Needs `SSDConfig(record_timeline=True)`.

    Lanes: the target (verify bars, annotated with accepted/proposed; grey = target waiting for candidates),
    the speculator (green: background speculation jobs; red: fallback drafts after a miss, on the critical
    path), and one marker per round (filled green: cache hit; red cross: miss).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = list(getattr(stats, "timeline", None) or [])
    if not events:
        raise ValueError("no timeline events: run generate with SSDConfig(record_timeline=True)")
    iv = _intervals_of(stats, intervals)
    t0 = min([e["t_request"] for e in events] + [s for s, _ in iv.speculate + iv.fallback])

    def ms(t: float) -> float:
        return (t - t0) * 1e3

    end = max([e.get("t_verified", e["t_return"]) for e in events] + [e for _, e in iv.speculate + iv.fallback])
    fig, ax = plt.subplots(figsize=(min(24, max(10.0, 6 + 0.25 * len(events))), 3.8))
    lanes = {"target": 2.0, "speculator": 1.0, "cache": 0.2}
    annotate = len(events) <= 60
    for e in events:
        t_req, t_ret = ms(e["t_request"]), ms(e["t_return"])
        if t_ret > t_req:  # the target had no candidates yet: waiting on the speculator / fallback
            ax.broken_barh([(t_req, t_ret - t_req)], (lanes["target"] - 0.3, 0.6), color=WAIT)
        if "t_verified" in e:
            width = ms(e["t_verified"]) - t_ret
            ax.broken_barh([(t_ret, width)], (lanes["target"] - 0.3, 0.6), color=VERIFY, edgecolor="white")
            if annotate:
                ax.text(t_ret + width / 2, lanes["target"] + 0.38, f"{e.get('accepted', 0)}/{e['n_candidates']}",
                        ha="center", va="bottom", fontsize=7)
        if e.get("round", 2) == 1:
            continue  # the first round has nothing to look up: no hit/miss marker
        hit = e.get("hit", False)
        ax.plot([t_req], [lanes["cache"]], marker="o" if hit else "x", color=SPECULATE if hit else FALLBACK,
                markersize=6, linestyle="none")
    for s, e in iv.speculate:
        ax.broken_barh([(ms(s), ms(e) - ms(s))], (lanes["speculator"] - 0.3, 0.6), color=SPECULATE, alpha=0.8)
    for s, e in iv.fallback:
        ax.broken_barh([(ms(s), ms(e) - ms(s))], (lanes["speculator"] - 0.3, 0.6), color=FALLBACK, alpha=0.9)
    ax.set_yticks(list(lanes.values()), ["target\n(verify)", "speculator\n(draft)", "cache"])
    ax.set_ylim(-0.3, 2.8)
    ax.set_xlim(0, ms(end) * 1.01 + 1e-6)
    ax.set_xlabel("time since the first round (ms)")
    hits = sum(1 for e in events if e.get("hit"))
    ax.set_title(title or f"SSD timeline: {len(events)} rounds, {hits} cache hits, layout {getattr(stats, 'layout', '?')}")
    handles = [
        Patch(color=VERIFY, label="target verifies (k accepted / proposed)"),
        Patch(color=WAIT, label="target waits for candidates"),
        Patch(color=SPECULATE, label="speculation job (overlapped)"),
        Patch(color=FALLBACK, label="fallback draft (miss, or first round)"),
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
