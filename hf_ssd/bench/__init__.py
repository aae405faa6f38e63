"""Tooling around the engine: the benchmark harness, prompt sets, the local `evaluate` metric, timeline plots.

Nothing in the engine (`hf_ssd/*.py`) imports from here.
"""

from .runner import (
    FORMULA,
    METRIC_PATH,
    SAMPLE_TEMPERATURE,
    CallResult,
    Method,
    MethodRun,
    Runner,
    assistant_settings,
    bench_methods,
    check_identical,
    load_metric,
    predicted_speedups,
    render_markdown,
    run_bench,
    write_plots,
)

__all__ = [
    "FORMULA",
    "METRIC_PATH",
    "SAMPLE_TEMPERATURE",
    "CallResult",
    "Method",
    "MethodRun",
    "Runner",
    "assistant_settings",
    "bench_methods",
    "check_identical",
    "load_metric",
    "predicted_speedups",
    "render_markdown",
    "run_bench",
    "write_plots",
]
