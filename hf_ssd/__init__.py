"""hf_ssd: Speculative Speculative Decoding for Hugging Face Transformers.

    import hf_ssd
    hf_ssd.enable(target)
    out = target.generate(**inputs, assistant_model=draft, ssd_config=hf_ssd.SSDConfig(gamma=4))
    print(hf_ssd.last_stats(target).summary())
"""

from .config import SSDConfig, SSDConfigError
from .drafter import UnsupportedDraftError
from .integration import SSDUsageError, disable, enable, is_enabled, last_stats
from .layouts import LayoutError
from .stats import SSDStats
from .timeline import plot_timeline

__all__ = [
    "SSDConfig",
    "SSDConfigError",
    "SSDStats",
    "SSDUsageError",
    "UnsupportedDraftError",
    "LayoutError",
    "disable",
    "enable",
    "is_enabled",
    "last_stats",
    "plot_timeline",
]
__version__ = "0.1.0"
