"""`hf-ssd bench`: AR, transformers assisted generation and SSD compared in one run on the same prompts.

Methods (all through `target.generate`, timed as the wall time of each call, tok/s = new tokens / seconds):
- `ar`: the target alone.
- `assisted`: transformers assisted generation with the draft's own generation defaults.
- `assisted_g{g}`: assisted generation tuned like SD in the paper: num_assistant_tokens=g, no confidence early
  exit (assistant_confidence_threshold=0), constant schedule.
- `ssd_g{g}`: SSD with `layout="auto"`; `ssd_g{g}_inline`: the same with `layout="inline"` (no overlap), whose
  ratio to `ssd_g{g}` is the effect of the layout alone.

Greedy outputs of every method must be token-identical to `ar`; this is checked with the project's `evaluate`
metric (`hf_ssd/bench/metrics/ssd_match.py`, loaded from the local file) and a mismatch is reported loudly.

Batches (`batch_sizes`, `hf-ssd bench --batch-sizes 1,4,16`): the methods above run at B = 1 only. At each
B > 1 the dataset's prompts, in the same order, are grouped into batches of B (left-padded, `batched.py`) and
two methods run over the same batches: `target_batched` (the target's own batched `generate`) and `ssd`
(`SSDConfig()` with the bench's SSD options, through hf_ssd's batched loop). Each is warmed up once at each B.
Their throughput is the dataset's: all rows' new tokens / all the calls' wall time; the report gives SSD /
target batched per B (at B = 1 from `ar` and `ssd`), the options SSD's scheduler chose, and, greedy, each
row of SSD against the same row of the target's batched generate (mismatches are reported like the others).

Predicted speedup (the paper's timing model, fed with this run's own measurements). Per round, SD costs
T_draft(gamma) + T_verify; SSD costs max(T_v, T_s) on a cache hit (speculation overlapped with verification)
and T_fb + T_v on a miss (fallback draft on the critical path). With E = mean accepted + 1 tokens per round:

    predicted SSD speedup over AR = E / (h * max(T_v, T_s) + (1 - h) * (T_fb + T_v)) * T_ar_token

h = measured cache hit rate, T_v = mean verify time per round (candidates returned -> outcome known),
T_s = mean speculation job time, T_fb = mean fallback draft time, T_ar_token = AR seconds per token.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import SSDConfig
from ..integration import enable, last_stats
from .batched import chunks, generate_batch, pad_token_id
from .prompts import encode_prompt, extract_number, load_prompts
from .timeline import Intervals

METRIC_PATH = str(Path(__file__).with_name("metrics") / "ssd_match.py")
FORMULA = (
    "predicted SSD speedup over AR = E / (h·max(T_v, T_s) + (1−h)·(T_fb + T_v)) · T_ar_token, with E = mean accepted "
    "tokens per round + 1, h = cache hit rate, T_v = mean verify time per round, T_s = mean speculation job time, "
    "T_fb = mean fallback draft time, T_ar_token = AR seconds per token, all measured in this run (paper's model: "
    "an SD round costs T_draft(γ) + T_verify; an SSD round costs max(T_v, T_s) on a hit, T_fb + T_v on a miss)"
)
SAMPLE_TEMPERATURE = 0.7


def load_metric():
    """The project's exact-match metric, from the file shipped in the package (never from the Hub)."""
    import evaluate

    return evaluate.load(METRIC_PATH)


# ----------------------------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "ar" | "assisted" | "assisted_tuned" | "ssd"
    gamma: int | None = None
    layout: str | None = None


def bench_methods(gammas: list[int], inline_gamma: int | None = None) -> list[Method]:
    methods = [Method("ar", "ar"), Method("assisted", "assisted")]
    methods += [Method(f"assisted_g{g}", "assisted_tuned", g) for g in gammas]
    methods.append(Method("ssd", "ssd", None, "auto"))  # SSDConfig() as it comes: the scheduler picks
    methods += [Method(f"ssd_g{g}", "ssd", g, "auto") for g in gammas]
    if inline_gamma is None:
        inline_gamma = 4 if 4 in gammas else gammas[len(gammas) // 2]
    methods.append(Method(f"ssd_g{inline_gamma}_inline", "ssd", inline_gamma, "inline"))
    return methods


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Set torch's intra-op threads for the block (None: leave them) and restore them afterwards."""
    if not n:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def assistant_settings(draft, **values):
    """Set fields of the draft's generation config (read by assisted generation) for the block only."""
    gc = draft.generation_config
    before = {k: getattr(gc, k, None) for k in values}
    for k, v in values.items():
        setattr(gc, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(gc, k, v)


@dataclass
class CallResult:
    tokens: list[int]
    seconds: float
    stats: object = None  # SSDStats for SSD calls
    intervals: Intervals | None = None


class Runner:
    """Runs one method on one prompt; everything else (models, SSD options) is fixed for the whole bench."""

    def __init__(self, target, draft, ssd_options: dict | None = None, pad: int | None = None):
        self.target = enable(target)
        self.draft = draft
        self.ssd_options = dict(ssd_options or {})
        self.device = target.device
        self.eos = target.generation_config.eos_token_id
        self.pad = pad_token_id(target) if pad is None else pad

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def call(self, method: Method, ids: list[int], max_new_tokens: int, do_sample: bool, seed: int) -> CallResult:
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        kwargs = {"max_new_tokens": max_new_tokens, "do_sample": do_sample,
                  "attention_mask": torch.ones_like(input_ids)}
        if do_sample:
            kwargs["temperature"] = SAMPLE_TEMPERATURE
        settings = contextlib.nullcontext()
        if method.kind != "ar":
            kwargs["assistant_model"] = self.draft
        if method.kind == "assisted_tuned":
            settings = assistant_settings(self.draft, num_assistant_tokens=method.gamma,
                                          assistant_confidence_threshold=0.0,
                                          num_assistant_tokens_schedule="constant")
        elif method.kind == "ssd":
            options = {**self.ssd_options, "layout": method.layout, "record_timeline": True, "hit_rate_warning": 0.0}
            if method.gamma is not None:
                options["gamma"] = method.gamma
            kwargs["ssd_config"] = SSDConfig(**options)
        torch.manual_seed(seed)  # same seed for every method: sampled runs differ only by the method
        with settings, torch.inference_mode():
            self._sync()
            start = time.perf_counter()
            out = self.target.generate(input_ids, **kwargs)
            self._sync()
            seconds = time.perf_counter() - start
        tokens = out[0, len(ids):].tolist()
        if method.kind != "ssd":
            return CallResult(tokens, seconds)
        stats = last_stats(self.target)
        return CallResult(tokens, seconds, stats, Intervals.from_stats(stats))

    def call_batch(self, kind: str, batch: list[list[int]], max_new_tokens: int, do_sample: bool,
                   seed: int) -> BatchResult:
        """One left-padded generate call over `batch`: `kind` "target_batched" (the target alone) or "ssd"."""
        kwargs = {"max_new_tokens": max_new_tokens, "do_sample": do_sample}
        if do_sample:
            kwargs["temperature"] = SAMPLE_TEMPERATURE
        if kind == "ssd":
            kwargs.update(assistant_model=self.draft,
                          ssd_config=SSDConfig(**{**self.ssd_options, "hit_rate_warning": 0.0}))
        elif kind != "target_batched":
            raise ValueError(f"unknown batched method {kind!r}")
        torch.manual_seed(seed)
        tokens, seconds = generate_batch(self.target, batch, self.pad, **kwargs)
        return BatchResult(tokens, seconds, last_stats(self.target) if kind == "ssd" else None)


@dataclass
class BatchResult:
    tokens: list[list[int]]  # per row
    seconds: float  # the call's wall time
    stats: object = None


BATCHED_METHODS = ("target_batched", "ssd")


class _Throughput:
    """Dataset throughput of a run's calls (`tokens`: new tokens per row, `seconds`: wall time per call)."""

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0


@dataclass
class BatchRun(_Throughput):
    """One batched method at one batch size over a dataset: every row's tokens, every call's seconds and stats."""

    kind: str
    batch_size: int
    tokens: list[list[int]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # rows of each call
    stats: list = field(default_factory=list)

    def add(self, r: BatchResult) -> None:
        self.tokens += r.tokens
        self.seconds.append(r.seconds)
        self.rows.append(len(r.tokens))
        if r.stats is not None:
            self.stats.append(r.stats)

    @classmethod
    def from_method_run(cls, kind: str, run: MethodRun) -> BatchRun:
        """B = 1: a method of the bench itself (`ar`, `ssd`), one prompt per call."""
        return cls(kind, 1, list(run.tokens), list(run.seconds), [1] * len(run.tokens), list(run.stats))

    def options(self) -> dict:
        """The rounds and round seconds of each option SSD's scheduler ran, over all calls."""
        out: dict = {}
        for st in self.stats:
            for name, o in st.options.items():
                entry = out.setdefault(name, {"rounds": 0, "seconds": 0.0})
                entry["rounds"] += o["rounds"]
                entry["seconds"] += o["seconds"]
        return out

    def option_shares(self) -> list[tuple[str, int, float]]:
        """(option, rounds, share of round time), most time first (as `SSDStats.option_shares`)."""
        options = self.options()
        total = sum(o["seconds"] for o in options.values()) or 1.0
        return sorted(((n, o["rounds"], o["seconds"] / total) for n, o in options.items()), key=lambda r: -r[2])


# ----------------------------------------------------------------------------------------------- aggregation


@dataclass
class MethodRun(_Throughput):
    """All calls of one method on one dataset in one decoding mode."""

    method: Method
    tokens: list[list[int]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    stats: list = field(default_factory=list)
    intervals: list = field(default_factory=list)

    def add(self, r: CallResult) -> None:
        self.tokens.append(r.tokens)
        self.seconds.append(r.seconds)
        if r.stats is not None:
            self.stats.append(r.stats)
            self.intervals.append(r.intervals or Intervals())

    def ssd_numbers(self) -> dict:
        """Acceptance, hit rate, bubble ratio and the timing terms of the paper's model, over all prompts."""
        if not self.stats:
            return {}
        s = self.stats

        def total(name):
            return sum(getattr(x, name) for x in s)

        def mean(values):
            return sum(values) / len(values) if values else 0.0

        rounds, proposed, accepted = total("rounds"), total("proposed_tokens"), total("accepted_tokens")
        hits, misses, wall, overlap = total("cache_hits"), total("cache_misses"), total("wall_time"), total("overlap_time")
        t_verify = [e["t_verified"] - e["t_return"] for x in s for e in x.timeline if "t_verified" in e]
        t_spec = [b - a for iv in self.intervals for a, b in iv.speculate]
        t_fb = [b - a for iv in self.intervals for a, b in iv.fallback]
        return {
            "rounds": rounds,
            "proposed_tokens": proposed,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_accepted": accepted / rounds if rounds else 0.0,
            "cache_hits": hits,
            "cache_misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "bubble_ratio": 1.0 - overlap / wall if wall > 0 else 0.0,
            "T_v": mean(t_verify),
            "T_s": mean(t_spec),
            "T_fb": mean(t_fb),
            "layout_resolved": s[0].layout,
        }


def predicted_speedups(ssd: dict, t_ar_token: float) -> tuple[float | None, float | None]:
    """(SSD, SD) speedups over AR predicted by the paper's model from measured terms (see module docstring)."""
    if not ssd or ssd.get("rounds", 0) == 0 or t_ar_token <= 0:
        return None, None
    e = ssd["mean_accepted"] + 1
    h, t_v, t_s, t_fb = ssd["hit_rate"], ssd["T_v"], ssd["T_s"], ssd["T_fb"]
    ssd_round = h * max(t_v, t_s) + (1 - h) * (t_fb + t_v)
    sd_round = t_fb + t_v  # with the "sd" fallback, a miss drafts gamma tokens like plain SD does
    return (e / ssd_round * t_ar_token if ssd_round > 0 else None, e / sd_round * t_ar_token if sd_round > 0 else None)


# ----------------------------------------------------------------------------------------------- the bench


def environment(target, draft, device, dtype) -> dict:
    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "dtype": str(dtype),
        "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "target": getattr(target.config, "_name_or_path", "") or type(target).__name__,
        "draft": getattr(draft.config, "_name_or_path", "") or type(draft).__name__,
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    import transformers

    from .. import __version__

    env["transformers"] = transformers.__version__
    env["hf_ssd"] = __version__
    return env


def run_bench(
    target,
    draft,
    tokenizer,
    datasets: list[str],
    out_dir: str | Path,
    num_prompts: int = 10,
    max_new_tokens: int = 128,
    modes: tuple[str, ...] = ("greedy", "sample"),
    gammas: tuple[int, ...] = (2, 4, 6),
    ssd_options: dict | None = None,
    seed: int = 0,
    chat: str = "auto",
    max_prompt_tokens: int | None = None,
    warmup_tokens: int = 8,
    progress: bool = True,
    batch_sizes: tuple[int, ...] = (1,),
) -> dict:
    """Run every method on every (dataset, mode), write results.json, results.md and plots into `out_dir`.

    `batch_sizes`: the bench's methods run when 1 is among them; each B > 1 runs the batched methods (module
    docstring)."""
    from tqdm.auto import tqdm

    batch_sizes = tuple(sorted(set(batch_sizes)))
    if not batch_sizes or batch_sizes[0] < 1:
        raise ValueError(f"batch sizes must be at least 1, got {list(batch_sizes)}")
    batched_sizes = [b for b in batch_sizes if b > 1]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runner = Runner(target, draft, ssd_options, pad_token_id(target, tokenizer))
    methods = bench_methods(list(gammas)) if 1 in batch_sizes else []
    metric = load_metric()
    sets = []
    for spec in datasets:
        name, ds = load_prompts(spec, num_prompts, seed=seed + 42)
        encoded = []
        for row in ds:
            ids = encode_prompt(row["prompt"], row["kind"], tokenizer, chat)
            encoded.append(ids[-max_prompt_tokens:] if max_prompt_tokens else ids)
        sets.append((name, ds, encoded))

    calls = len(modes) * sum((len(methods) * (len(e) + 1)  # +1: each method's warm-up
                              + len(BATCHED_METHODS) * sum(len(chunks(e, b)) + 1 for b in batched_sizes))
                             for _, _, e in sets)
    estimate = estimate_seconds(runner, sets, methods, modes, max_new_tokens, warmup_tokens, seed, batched_sizes)
    batched_note = f" + target batched and SSD at B = {_ints(batched_sizes)}" if batched_sizes else ""
    print(f"[hf-ssd] bench: {len(sets)} dataset(s) x {'+'.join(modes)} x {len(methods)} methods{batched_note}, "
          f"{sum(len(e) for _, _, e in sets)} prompts in all, {max_new_tokens} new tokens each ({calls} calls); "
          f"estimated {_duration(estimate)} on this machine", flush=True)
    rows, greedy_check, accuracy, cutoffs = [], {}, {}, {}
    batched_rows, batched_check = [], {}
    bench_start = time.perf_counter()
    for name, ds, encoded in sets:
        for mode in modes:
            do_sample = mode == "sample"
            runs: dict[str, MethodRun] = {}
            total = len(methods) * len(encoded) + len(BATCHED_METHODS) * len(batched_sizes) * len(encoded)
            bar = tqdm(total=total, desc=f"{name}/{mode}", disable=not progress, leave=False)
            for method in methods:
                runner.call(method, encoded[0], min(warmup_tokens, max_new_tokens), do_sample, seed)  # warm-up
                run = runs[method.name] = MethodRun(method)
                for i, ids in enumerate(encoded):
                    run.add(runner.call(method, ids, max_new_tokens, do_sample, seed + i))
                    bar.update(1)
            by_size: dict[int, dict[str, BatchRun]] = {}
            if methods:
                by_size[1] = {"target_batched": BatchRun.from_method_run("target_batched", runs["ar"]),
                              "ssd": BatchRun.from_method_run("ssd", runs["ssd"])}
            for b in batched_sizes:
                groups = chunks(encoded, b)  # the prompts in order, b per call
                for kind in BATCHED_METHODS:
                    runner.call_batch(kind, groups[0], min(warmup_tokens, max_new_tokens), do_sample, seed)  # warm-up
                    brun = by_size.setdefault(b, {})[kind] = BatchRun(kind, b)
                    for j, group in enumerate(groups):
                        brun.add(runner.call_batch(kind, group, max_new_tokens, do_sample, seed + j * b))
                        bar.update(len(group))
            bar.close()
            if methods:
                rows += summarize(name, mode, runs)
                if mode == "greedy":
                    greedy_check[name] = check_identical(metric, runs)
                if tokenizer is not None and any(k == "math" for k in ds["kind"]):
                    accuracy.setdefault(name, {})[mode] = answer_accuracy(metric, runs, ds, tokenizer)
                cutoffs.setdefault(name, {})[mode] = cut_off(runs, max_new_tokens, runner.eos)
            if batched_sizes:
                batched_rows += summarize_batched(name, mode, by_size)
                if mode == "greedy":
                    batched_check[name] = check_batched(metric, by_size, runs.get("ar"))
    elapsed = time.perf_counter() - bench_start

    mismatched = {d: [m for m, r in c.items() if r["num_mismatches"]] for d, c in greedy_check.items()}
    for d, checks in batched_check.items():
        mismatched.setdefault(d, []).extend(f"ssd_b{b}" for b, c in checks.items()
                                            if c["ssd_vs_target_batched"]["num_mismatches"])
    mismatched = {d: ms for d, ms in mismatched.items() if ms}
    results = {
        "environment": environment(target, draft, runner.device, next(target.parameters()).dtype),
        "settings": {
            "datasets": [s[0] for s in sets], "num_prompts": num_prompts, "max_new_tokens": max_new_tokens,
            "prompts_per_dataset": {s[0]: len(s[2]) for s in sets},
            "estimated_seconds": estimate, "elapsed_seconds": elapsed,
            "modes": list(modes), "gammas": list(gammas), "sample_temperature": SAMPLE_TEMPERATURE, "seed": seed,
            "batch_sizes": list(batch_sizes),
            "chat": chat, "max_prompt_tokens": max_prompt_tokens, "ssd_options": dict(ssd_options or {}),
            "methods": [m.__dict__ for m in methods],
        },
        "results": rows,
        "greedy_check": greedy_check,
        "greedy_identical": not mismatched,
        "greedy_mismatches": mismatched,
        "gsm_accuracy": accuracy,
        "cut_off": cutoffs,
        "layout_effect": layout_effect(rows),
        "batched": batched_rows,
        "batched_check": batched_check,
        "formula": FORMULA,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    markdown = render_markdown(results)
    (out_dir / "results.md").write_text(markdown, encoding="utf-8")
    results["plots"] = write_plots(results, out_dir)
    if mismatched:
        banner = "!" * 78
        print(f"{banner}\nGREEDY MISMATCH: these methods did not reproduce the target's greedy output: "
              f"{mismatched}\n{banner}", file=sys.stderr)
    return results


def _ints(values) -> str:
    return ",".join(map(str, values))


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def estimate_seconds(runner, sets, methods, modes, max_new_tokens, warmup_tokens, seed, batched_sizes=()) -> float:
    """Rough wall time of the whole bench, from short timed AR calls on the first prompt.

    A 1-token call (after one to warm up) measures the prompt's prefill and the fixed cost of a call; a
    (1 + n)-token call adds n decode steps. Every method is counted at AR's speed (the others are about as
    fast or faster), so this is a rough upper estimate; batched methods too, as if each row ran alone (a
    batched step costs less than its rows' steps one by one)."""
    if not sets or not sets[0][2]:
        return 0.0
    probe = sets[0][2][0]
    ar = Method("ar", "ar")
    n = max(1, min(warmup_tokens, max_new_tokens))
    runner.call(ar, probe, 1, False, seed)  # warm-up: first-call costs are not the bench's
    t_call = runner.call(ar, probe, 1, False, seed).seconds
    longer = runner.call(ar, probe, 1 + n, False, seed)
    per_token = max(0.0, longer.seconds - t_call) / max(1, len(longer.tokens) - 1)
    calls = len(modes) * len(methods) * sum(len(e) + 1 for _, _, e in sets)  # +1: each method's warm-up
    tokens = len(modes) * len(methods) * sum(len(e) * max_new_tokens + warmup_tokens for _, _, e in sets)
    for b in batched_sizes:  # per row: its prefill and its tokens; per call: the rows of its warm-up
        calls += len(modes) * len(BATCHED_METHODS) * sum(len(e) + min(b, len(e)) for _, _, e in sets)
        tokens += len(modes) * len(BATCHED_METHODS) * sum(len(e) * max_new_tokens + min(b, len(e)) * warmup_tokens
                                                          for _, _, e in sets)
    return calls * t_call + tokens * per_token


def cut_off(runs: dict[str, MethodRun], max_new_tokens: int, eos) -> dict[str, int]:
    """Per method: outputs that stopped at max_new_tokens without EOS (their final answer may be missing)."""
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()
    return {name: sum(1 for t in run.tokens if len(t) >= max_new_tokens and not (eos & set(t[-1:])))
            for name, run in runs.items()}


def summarize(dataset: str, mode: str, runs: dict[str, MethodRun]) -> list[dict]:
    ar = runs["ar"]
    ar_tps = ar.tokens_per_second
    t_ar_token = ar.total_seconds / ar.new_tokens if ar.new_tokens else 0.0
    best_assisted = max((r.tokens_per_second for r in runs.values() if r.method.kind.startswith("assisted")), default=0.0)
    rows = []
    for name, run in runs.items():
        m = run.method
        row = {
            "dataset": dataset, "mode": mode, "method": name, "kind": m.kind, "gamma": m.gamma, "layout": m.layout,
            "batch_size": 1, "prompts": len(run.tokens), "new_tokens": run.new_tokens, "seconds": run.total_seconds,
            "tokens_per_second": run.tokens_per_second,
            "speedup_vs_ar": run.tokens_per_second / ar_tps if ar_tps else None,
            "speedup_vs_best_assisted": run.tokens_per_second / best_assisted if best_assisted else None,
            "per_prompt": [{"new_tokens": len(t), "seconds": s} for t, s in zip(run.tokens, run.seconds)],
        }
        if m.kind == "ssd":
            ssd = run.ssd_numbers()
            row.update(ssd)
            pred_ssd, pred_sd = predicted_speedups(ssd, t_ar_token)
            # The model assumes overlap; for the inline layout it is reported for reference only.
            row["predicted_speedup"] = pred_ssd
            row["predicted_sd_speedup"] = pred_sd
        rows.append(row)
    return rows


def summarize_batched(dataset: str, mode: str, by_size: dict[int, dict[str, BatchRun]]) -> list[dict]:
    """One row per (batch size, batched method): dataset throughput, SSD / target batched, SSD's options."""
    rows = []
    for b, runs in sorted(by_size.items()):
        base = runs["target_batched"].tokens_per_second
        for kind, run in runs.items():
            row = {
                "dataset": dataset, "mode": mode, "batch_size": b, "method": kind,
                "from_method": ({"target_batched": "ar", "ssd": "ssd"}[kind] if b == 1 else None),
                "prompts": len(run.tokens), "batches": len(run.seconds), "rows_per_batch": run.rows,
                "new_tokens": run.new_tokens, "seconds": run.total_seconds,
                "tokens_per_second": run.tokens_per_second,
                "ratio_vs_target_batched": run.tokens_per_second / base if base else None,
                "per_batch": [{"rows": n, "seconds": s} for n, s in zip(run.rows, run.seconds)],
            }
            if kind == "ssd":
                proposed = sum(st.proposed_tokens for st in run.stats)
                accepted = sum(st.accepted_tokens for st in run.stats)
                row.update({
                    "rounds": sum(st.rounds for st in run.stats), "proposed_tokens": proposed,
                    "accepted_tokens": accepted, "acceptance_rate": accepted / proposed if proposed else None,
                    "options": run.options(), "option_shares": [list(x) for x in run.option_shares()],
                })
            rows.append(row)
    return rows


def check_batched(metric, by_size: dict[int, dict[str, BatchRun]], ar: MethodRun | None) -> dict:
    """Per B > 1: SSD's rows against the same rows of the target's batched generate (an SSD mismatch when they
    differ) and, for reference, the target's batched rows against the target alone (`ar`, when it ran): padding
    and batched kernels can change the target's own output in reduced precision."""
    out = {}
    for b, runs in sorted(by_size.items()):
        if b == 1:
            continue
        reference = runs["target_batched"].tokens
        out[b] = {
            "ssd_vs_target_batched": metric.compute(predictions=runs["ssd"].tokens, references=reference),
            "target_batched_vs_target_alone": (metric.compute(predictions=reference, references=ar.tokens)
                                               if ar is not None else None),
        }
    return out


def check_identical(metric, runs: dict[str, MethodRun]) -> dict:
    """Per method: the ssd_match metric of its greedy outputs against the target alone (`ar`)."""
    reference = runs["ar"].tokens
    return {
        name: metric.compute(predictions=run.tokens, references=reference)
        for name, run in runs.items()
        if name != "ar" and reference
    }


def answer_accuracy(metric, runs: dict[str, MethodRun], ds, tokenizer) -> dict:
    """GSM exact match: final number of each method's answer vs the reference's final number."""
    refs = [extract_number(r) for r in ds["reference"]]
    out = {}
    for name, run in runs.items():
        preds = [extract_number(tokenizer.decode(t, skip_special_tokens=True)) for t in run.tokens]
        if preds:
            out[name] = metric.compute(predictions=preds, references=refs)["exact_match"]
    return out


def layout_effect(rows: list[dict]) -> list[dict]:
    """tok/s of SSD with the auto layout over the same SSD inline (no overlap): the gain from overlap alone."""
    effects = []
    for r in rows:
        if r["kind"] == "ssd" and r["layout"] == "inline":
            auto = next((a for a in rows if a["kind"] == "ssd" and a["layout"] == "auto" and a["gamma"] == r["gamma"]
                         and a["dataset"] == r["dataset"] and a["mode"] == r["mode"]), None)
            if auto is not None and r["tokens_per_second"] > 0:
                effects.append({"dataset": r["dataset"], "mode": r["mode"], "gamma": r["gamma"],
                                "layout": auto.get("layout_resolved", "auto"),
                                "ratio": auto["tokens_per_second"] / r["tokens_per_second"]})
    return effects


# ----------------------------------------------------------------------------------------------- reports


def _f(value, fmt: str = "{:.2f}", none: str = "—") -> str:
    return none if value is None else fmt.format(value)


def render_markdown(results: dict) -> str:
    env, st = results["environment"], results["settings"]
    n_prompts = st.get("prompts_per_dataset", {})
    counts = ", ".join(f"{d}: {n} prompt{'s' if n != 1 else ''}" for d, n in n_prompts.items()) or \
        f"{st['num_prompts']} prompts per dataset"
    modes = " and ".join(
        "greedy" if m == "greedy" else f"sampling at T={st['sample_temperature']} with fixed seeds" for m in st["modes"]
    )
    timing = ""
    if st.get("elapsed_seconds") is not None:
        timing = f" · ran {_duration(st['elapsed_seconds'])} (estimated {_duration(st.get('estimated_seconds', 0))})"
    lines = [
        "# hf-ssd benchmark",
        "",
        f"target `{env['target']}` · draft `{env['draft']}` · {env['device']} {env['dtype']} · "
        f"{env['torch_threads']} torch threads · torch {env['torch']} · transformers {env['transformers']} · "
        f"{env['machine']} ({env['cpu_count']} CPUs){' · ' + env['cuda_device'] if env.get('cuda_device') else ''}",
        f"{counts} · max_new_tokens {st['max_new_tokens']} · {modes} · {env['date']}{timing}",
        "",
    ]
    header = ("| method | tok/s | speedup vs AR | speedup vs best assisted | acceptance | hit rate | bubble ratio "
              "| predicted speedup¹ |")
    for dataset in st["datasets"]:
        for mode in st["modes"]:
            rows = [r for r in results["results"] if r["dataset"] == dataset and r["mode"] == mode]
            if not rows:
                continue
            lines += [f"## {dataset} · {mode}", "", header, "|" + "---|" * 8]
            for r in rows:
                pct = "{:.1%}"
                lines.append(
                    f"| {r['method']} | {_f(r['tokens_per_second'])} | {_f(r['speedup_vs_ar'], '{:.2f}×')} | "
                    f"{_f(r['speedup_vs_best_assisted'], '{:.2f}×')} | {_f(r.get('acceptance_rate'), pct)} | "
                    f"{_f(r.get('hit_rate'), pct)} | {_f(r.get('bubble_ratio'), pct)} | "
                    f"{_f(r.get('predicted_speedup'), '{:.2f}×')} |"
                )
            lines.append("")
    lines += render_batched(results)
    lines += ["## Greedy losslessness (token-identical to the target alone)", ""]
    for dataset, checks in results["greedy_check"].items():
        bad = {m: c for m, c in checks.items() if c["num_mismatches"]}
        if bad:
            for m, c in bad.items():
                lines.append(f"- **MISMATCH** {dataset} · {m}: {c['num_mismatches']} prompt(s) differ "
                             f"(indices {c['mismatch_indices']}, first divergence at tokens "
                             f"{[f for f in c['first_divergence'] if f >= 0]})")
        else:
            lines.append(f"- {dataset}: all {len(checks)} methods token-identical to AR ✔")
    for dataset, by_size in results.get("batched_check", {}).items():
        for b, c in by_size.items():
            ssd, alone = c["ssd_vs_target_batched"], c.get("target_batched_vs_target_alone")
            if ssd["num_mismatches"]:
                lines.append(f"- **MISMATCH** {dataset} · SSD at B={b}: {ssd['num_mismatches']} row(s) differ from "
                             f"the target's batched generate (rows {ssd['mismatch_indices']}, first divergence at "
                             f"tokens {[f for f in ssd['first_divergence'] if f >= 0]})")
            else:
                lines.append(f"- {dataset} · B={b}: SSD token-identical to the target's batched generate on all "
                             f"{len(ssd['first_divergence'])} rows ✔")
            if alone is not None and alone["num_mismatches"]:
                lines.append(f"  - (the target's batched generate itself differs from the target alone on "
                             f"{alone['num_mismatches']} row(s): padding / batched kernels in reduced precision; "
                             "not an SSD mismatch)")
    if not results["greedy_check"] and not results.get("batched_check"):
        lines.append("- (no greedy mode in this run)")
    lines.append("")
    if results["gsm_accuracy"]:
        names = list(dict.fromkeys(n for by_mode in results["gsm_accuracy"].values()
                                   for acc in by_mode.values() for n in acc))
        cut = results.get("cut_off", {})
        lines += ["## Final-answer exact match (numeric)", "", "| dataset | mode | " + " | ".join(names) + " |",
                  "|" + "---|" * (len(names) + 2)]
        flagged = False
        for dataset, by_mode in results["gsm_accuracy"].items():
            for mode, acc in by_mode.items():
                cells = []
                for n in names:
                    c = cut.get(dataset, {}).get(mode, {}).get(n, 0)
                    flagged |= c > 0
                    cells.append(_f(acc.get(n), "{:.1%}") + (f" ({c} cut²)" if c else ""))
                lines.append(f"| {dataset} | {mode} | " + " | ".join(cells) + " |")
        lines.append("")
        if flagged:
            lines += [f"² outputs that stopped at max_new_tokens={st['max_new_tokens']} before the end of sequence: "
                      "their final answer was cut off, so the exact match above understates the models. Raise "
                      "--max-new-tokens (e.g. 256) to measure accuracy.", ""]
    if results["layout_effect"]:
        lines += ["## Layout effect (SSD auto layout over SSD inline, same gamma)", ""]
        for e in results["layout_effect"]:
            lines.append(f"- {e['dataset']} · {e['mode']} · gamma {e['gamma']}: {e['layout']} / inline = {e['ratio']:.2f}×")
        lines.append("")
    if results["results"]:
        lines += [f"¹ {results['formula']}. Shown for every SSD row; it assumes overlap, so for the inline row it is "
                  "an upper bound, not a prediction.", ""]
    return "\n".join(lines)


def _options_text(shares, top: int = 3) -> str:
    if not shares:
        return "—"
    return ", ".join(f"{name} {rounds} ({share:.0%})" for name, rounds, share in shares[:top])


def render_batched(results: dict) -> list[str]:
    """The batched section: per (dataset, mode), one line per batch size (only when a B > 1 ran)."""
    rows = results.get("batched") or []
    if not any(r["batch_size"] > 1 for r in rows):
        return []
    st = results["settings"]
    defaults = SSDConfig()
    given = {k: v for k, v in (st.get("ssd_options") or {}).items() if getattr(defaults, k, v) != v}
    config = "SSDConfig(" + ", ".join(f"{k}={v!r}" for k, v in given.items()) + ")"
    above = "; B = 1: the `ar` and `ssd` rows above" if 1 in st.get("batch_sizes", []) else ""
    lines = ["## Batched: dataset throughput (all rows' new tokens / all wall time)", "",
             f"B prompts per generate call: the prompts in order, grouped into batches of B, left-padded; each method "
             f"warmed up once at each B. target batched = the target's own batched `generate`; SSD = `{config}` "
             f"(B > 1: hf_ssd's batched loop{above}).", ""]
    header = ("| B | calls × rows | target batched tok/s | SSD tok/s | SSD / target batched | SSD acceptance "
              "| SSD options (rounds, share of round time) |")
    for dataset in st["datasets"]:
        for mode in st["modes"]:
            sel = [r for r in rows if r["dataset"] == dataset and r["mode"] == mode]
            if not sel:
                continue
            lines += [f"### {dataset} · {mode}", "", header, "|" + "---|" * 7]
            for b in sorted({r["batch_size"] for r in sel}):
                by = {r["method"]: r for r in sel if r["batch_size"] == b}
                t, ssd = by["target_batched"], by["ssd"]
                sizes = sorted(set(ssd["rows_per_batch"]), reverse=True)
                shape = f"{ssd['batches']} × {'/'.join(map(str, sizes))}"
                lines.append(f"| {b} | {shape} | {_f(t['tokens_per_second'])} | {_f(ssd['tokens_per_second'])} | "
                             f"{_f(ssd['ratio_vs_target_batched'], '{:.2f}×')} | "
                             f"{_f(ssd.get('acceptance_rate'), '{:.1%}')} | {_options_text(ssd.get('option_shares'))} |")
            lines.append("")
    return lines


def write_plots(results: dict, out_dir: Path) -> list[str]:
    """tok_s.png, ssd_hit_acceptance.png, speedup_vs_gamma.png; see `figures`."""
    return [_save(fig, out_dir / f"{name}.png") for name, fig in figures(results).items()]


def _sample_size(results: dict, rows: list[dict]) -> str:
    st = results["settings"]
    per = st.get("prompts_per_dataset") or {d: st["num_prompts"] for d in st["datasets"]}
    prompts = ", ".join(f"{d} {n}" for d, n in per.items())
    rounds = sum(r.get("rounds", 0) for r in rows if r["kind"] == "ssd")
    return f"prompts: {prompts}; {st['max_new_tokens']} new tokens each; {rounds} SSD rounds in all"


def figures(results: dict) -> dict:
    """The bench's plots as matplotlib figures. Every y axis starts at zero, every baseline is shown (AR,
    assisted defaults and the best assisted setting), and each title says how many prompts and rounds the
    figure rests on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["results"]
    groups = [(d, m) for d in results["settings"]["datasets"] for m in results["settings"]["modes"]]
    figs = {}
    if any(r["batch_size"] > 1 for r in results.get("batched") or []):
        figs["batched_tok_s"] = _batched_figure(results, groups, plt)
    groups = [g for g in groups if any(r["dataset"] == g[0] and r["mode"] == g[1] for r in rows)]
    if not rows:  # only batch sizes above 1 ran
        return figs
    size = _sample_size(results, rows)

    # 1. tok/s by method, one bar per (dataset, mode).
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(methods) * max(1, len(groups)) / 2), 4.2))
    width = 0.8 / max(1, len(groups))
    for gi, (d, m) in enumerate(groups):
        by = {r["method"]: r["tokens_per_second"] for r in rows if r["dataset"] == d and r["mode"] == m}
        ax.bar([i + gi * width for i in range(len(methods))], [by.get(x, 0) for x in methods], width, label=f"{d} · {m}")
    ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(methods))], methods, rotation=30, ha="right")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Throughput by method\n({size})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    figs["tok_s"] = fig

    # 2. SSD hit rate and acceptance by dataset.
    ssd_methods = [x for x in methods if any(r["method"] == x and r["kind"] == "ssd" for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    width = 0.8 / max(1, len(ssd_methods))
    for ax, key, title in ((axes[0], "hit_rate", "cache hit rate"), (axes[1], "acceptance_rate", "acceptance rate")):
        for mi, name in enumerate(ssd_methods):
            by = {(r["dataset"], r["mode"]): r.get(key, 0) for r in rows if r["method"] == name}
            ax.bar([i + mi * width for i in range(len(groups))], [by.get(g, 0) for g in groups], width, label=name)
        ax.set_xticks([i + width * (len(ssd_methods) - 1) / 2 for i in range(len(groups))],
                      [f"{d}\n{m}" for d, m in groups])
        ax.set_ylim(0, 1.05)
        ax.set_title(f"SSD {title}")
    axes[0].legend(fontsize=8)
    fig.suptitle(size, fontsize=9)
    fig.tight_layout()
    figs["ssd_hit_acceptance"] = fig

    # 3. Speedup over AR by gamma (bars, so one gamma reads as well as several), with the gamma-free baselines
    #    as lines: AR itself, assisted with its defaults, and the best assisted setting of the run.
    gammas = sorted({r["gamma"] for r in rows if r["gamma"] is not None})
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(5.5 * max(1, len(groups)), 5.0), squeeze=False,
                             sharey=True)
    series = (
        ("assisted_tuned", None, "speedup_vs_ar", "assisted (γ tokens, threshold 0)"),
        ("ssd", "auto", "speedup_vs_ar", "SSD measured"),
        ("ssd", "auto", "predicted_speedup", "SSD predicted"),
        ("ssd", "inline", "speedup_vs_ar", "SSD inline (no overlap)"),
    )
    width = 0.8 / len(series)
    for ax, (d, m) in zip(axes[0], groups):
        sel = [r for r in rows if r["dataset"] == d and r["mode"] == m]
        for si, (kind, layout, key, label) in enumerate(series):
            by = {r["gamma"]: r.get(key) for r in sel if r["kind"] == kind and r["layout"] == layout}
            xs = [gi + si * width for gi, g in enumerate(gammas) if by.get(g) is not None]
            ys = [by[g] for g in gammas if by.get(g) is not None]
            if ys:
                ax.bar(xs, ys, width, label=label, hatch="//" if key == "predicted_speedup" else None,
                       alpha=0.6 if key == "predicted_speedup" else 1.0)
        ax.axhline(1.0, color="black", lw=1.0, label="AR (target alone)")
        defaults = [r["speedup_vs_ar"] for r in sel if r["kind"] == "assisted" and r.get("speedup_vs_ar")]
        if defaults:
            ax.axhline(defaults[0], color="tab:grey", ls="--", lw=1.2, label="assisted (defaults)")
        best = max((r["speedup_vs_ar"] for r in sel if r["kind"].startswith("assisted") and r.get("speedup_vs_ar")),
                   default=None)
        default_ssd = [r["speedup_vs_ar"] for r in sel if r["kind"] == "ssd" and r["gamma"] is None]
        if default_ssd and default_ssd[0]:
            ax.axhline(default_ssd[0], color="tab:orange", ls="-.", lw=1.5, label="SSD default (scheduled)")
        if best is not None:
            ax.axhline(best, color="tab:red", ls=":", lw=1.5, label="best assisted")
        ax.set_xticks([gi + width * (len(series) - 1) / 2 for gi in range(len(gammas))], [str(g) for g in gammas])
        ax.set_xlabel("gamma")
        ax.set_ylabel("speedup over AR")
        # Lines (baselines) do not always widen the autoscaled range: fit every value drawn, from zero.
        drawn = [1.0] + [r.get(k) or 0.0 for r in rows for k in ("speedup_vs_ar", "predicted_speedup")]
        ax.set_ylim(0, 1.1 * max(drawn))
        ax.set_title(f"{d} · {m}")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    fig.suptitle(size, fontsize=9)
    fig.tight_layout()
    figs["speedup_vs_gamma"] = fig
    return figs


def _batched_figure(results: dict, groups: list, plt):
    """Dataset throughput of the target's batched generate and SSD at each batch size, one panel per group."""
    rows = results["batched"]
    groups = [g for g in groups if any(r["dataset"] == g[0] and r["mode"] == g[1] for r in rows)]
    st = results["settings"]
    per = st.get("prompts_per_dataset") or {d: st["num_prompts"] for d in st["datasets"]}
    rounds = sum(r.get("rounds", 0) for r in rows if r["method"] == "ssd")
    size = (f"prompts: {', '.join(f'{d} {n}' for d, n in per.items())}; {st['max_new_tokens']} new tokens each; "
            f"{rounds} SSD rounds in all (batched rounds count once per call)")
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(5.5 * max(1, len(groups)), 4.4), squeeze=False,
                             sharey=True)
    for ax, (d, m) in zip(axes[0], groups):
        sel = [r for r in rows if r["dataset"] == d and r["mode"] == m]
        sizes = sorted({r["batch_size"] for r in sel})
        for k, (method, label) in enumerate((("target_batched", "target's own batched generate"),
                                             ("ssd", "SSD (SSDConfig())"))):
            by = {r["batch_size"]: r["tokens_per_second"] for r in sel if r["method"] == method}
            ax.bar([i + k * 0.4 for i in range(len(sizes))], [by.get(b, 0) for b in sizes], 0.4, label=label)
        ax.set_xticks([i + 0.2 for i in range(len(sizes))], [str(b) for b in sizes])
        ax.set_xlabel("batch size B")
        ax.set_ylabel("tokens / s (all rows)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{d} · {m}")
        ax.legend(fontsize=8)
    fig.suptitle(f"Batched throughput\n({size})", fontsize=9)
    fig.tight_layout()
    return fig


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
