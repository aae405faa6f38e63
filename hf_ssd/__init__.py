"""hf_ssd: Speculative Speculative Decoding for Hugging Face Transformers.

    import hf_ssd
    hf_ssd.enable(target)
    out = target.generate(**inputs, assistant_model=draft, ssd_config=hf_ssd.SSDConfig(gamma=4))
    print(hf_ssd.last_stats(target).summary())

The engine's layers are folders: `loop` (the decoding loops: hf_ssd's own for batches, and one prompt's
inside transformers' assisted decoding), `speculation` (the outcome model, fan-outs, the background job and its
cache), `drafting` (the draft's forwards, dynamic and static) and `scheduling` (measured costs and the choice
of option); beside them `config`, `integration` (`enable` and the `generate` wrapper), `layouts` and `stats`.
Tooling lives in subpackages the engine never imports: `hf_ssd.models` (the default real pair, tiny and
synthetic pairs), `hf_ssd.bench` (benchmark, prompts, metric, timeline plots) and `hf_ssd.cli` (the `hf-ssd`
command).
"""

import importlib

from .config import SSDConfig, SSDConfigError
from .drafting.drafter import UnsupportedDraftError
from .drafting.graphs import GraphCaptureError
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
    "profile": "hf_ssd.scheduling.profile",  # engine, not tooling: the tuning profile (`hf_ssd.profile.ignored()`, `save`)
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
__version__ = "0.2.0"
