"""hf_ssd: Speculative Speculative Decoding for Hugging Face Transformers.

    import hf_ssd
    hf_ssd.enable(target)
    out = target.generate(**inputs, assistant_model=draft, ssd_config=hf_ssd.SSDConfig(gamma=4))
    print(hf_ssd.last_stats(target).summary())

The modules directly in `hf_ssd/` are the engine (config, integration, generator, speculator, drafter, kvcache,
probe, static_draft, graphs, outcomes, predictor, fanout, cache, fallback, layouts, stats, and the measured-cost
scheduler: schedule, costs). Tooling lives in subpackages the engine never imports:
`hf_ssd.models` (the default real pair, tiny and synthetic pairs), `hf_ssd.bench` (benchmark, prompts, metric,
timeline plots) and `hf_ssd.cli` (the `hf-ssd` command).
"""

import importlib

from .config import SSDConfig, SSDConfigError
from .drafter import UnsupportedDraftError
from .graphs import GraphCaptureError
from .integration import SSDUsageError, disable, enable, is_enabled, last_stats
from .layouts import LayoutError
from .stats import SSDStats

# Tooling reachable from the top level without importing it (and matplotlib, datasets, ...) up front.
_LAZY_MODULES = {
    "pairs": "hf_ssd.models.pairs",
    "fetch": "hf_ssd.models.fetch",
    "synthetic": "hf_ssd.models.synthetic",
    "tiny": "hf_ssd.models.tiny",
    "models": "hf_ssd.models",
    "bench": "hf_ssd.bench",
    "profile": "hf_ssd.profile",  # engine, not tooling: the tuning profile (`hf_ssd.profile.ignored()`, `save`)
}


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        return importlib.import_module(_LAZY_MODULES[name])
    if name == "plot_timeline":
        from .bench.timeline import plot_timeline

        return plot_timeline
    raise AttributeError(f"module 'hf_ssd' has no attribute {name!r}")


__all__ = [
    "SSDConfig",
    "SSDConfigError",
    "SSDStats",
    "SSDUsageError",
    "UnsupportedDraftError",
    "GraphCaptureError",
    "LayoutError",
    "disable",
    "enable",
    "is_enabled",
    "last_stats",
    "plot_timeline",
]
__version__ = "0.1.0"
