#!/usr/bin/env python
"""Overlapped vs non-overlapped SSD on one SYNTHETIC pair: what the layouts buy, with AR and SD for reference.

Same pair, same prompts, greedy: AR (target alone), SD (transformers assisted generation, constant
num_assistant_tokens=gamma (or each of --sd-tokens), confidence threshold 0; --sd-defaults adds the stock
settings), SSD with layout="inline" (speculation on the critical path), SSD with layout="auto" (thread on CPU,
stream on one GPU), with --draft-paths one "auto" row per draft path (dynamic DynamicCache drafter, static
eager, static with CUDA graphs), optionally SSD "device" (draft on a second GPU, or on the CPU next to a GPU
target with --cpu-draft) and thread-layout variants with --cpu-threads. --timeline PNG draws one call of the
last SSD row (hf_ssd.plot_timeline); --profile JSON writes a torch profiler (chrome) trace of one such call.
Every method's greedy output is compared with AR's. The models are random (hf_ssd.models.synthetic): the numbers
say how fast the layouts are, nothing about text quality, and every table is labelled SYNTHETIC.

    python scripts/layout_bench.py --device cpu --shape tiny --prompts 2 --max-new-tokens 32
    python scripts/layout_bench.py --device cuda --shape 1b-8b --prompts 4 --max-new-tokens 128
    python scripts/layout_bench.py --device cpu --shape tiny --draft-paths dynamic,static
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import dataclass, field

import torch

import hf_ssd
from hf_ssd.models.synthetic import LABEL, parse_pair, random_prompts, synthetic_pair

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Method:
    name: str
    kind: str  # "ar" | "sd" | "ssd"
    draft: object = None
    config: hf_ssd.SSDConfig | None = None
    tokens: int = 0
    seconds: float = 0.0
    identical: int = 0
    runs: int = 0
    first_diff: list = field(default_factory=list)  # first differing position per non-identical prompt
    stats: dict = field(default_factory=dict)  # summed SSDStats counters
    layout: str = ""
    draft_path: str = ""
    sd: dict | None = None  # SD only: generation-config fields of the draft (None: transformers' defaults)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(method: Method, target, ids: torch.Tensor, max_new_tokens: int, gamma: int) -> torch.Tensor:
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
    if method.kind == "ar":
        return target.generate(ids, **kwargs)
    if method.kind == "sd":
        gc = method.draft.generation_config
        if not hasattr(method.draft, "_bench_sd_defaults"):  # before any row changes them
            method.draft._bench_sd_defaults = {k: getattr(gc, k) for k in SD_FIELDS}
        for k, v in (method.sd or method.draft._bench_sd_defaults).items():
            setattr(gc, k, v)
        return target.generate(ids, assistant_model=method.draft, **kwargs)
    return target.generate(ids, assistant_model=method.draft, ssd_config=method.config, **kwargs)


SD_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def sd_settings(tokens: int) -> dict:
    return dict(zip(SD_FIELDS, (tokens, "constant", 0.0)))


# Rows of --draft-paths: the SSDConfig switches of each draft path.
DRAFT_PATHS = {"dynamic": dict(static_draft=False), "static": dict(static_draft=True, cuda_graphs=False),
               "graphs": dict(cuda_graphs=True)}
PATH_NAMES = {"dynamic": "dynamic", "static": "static eager", "graphs": "static graphs"}

COUNTERS = ("rounds", "new_tokens", "proposed_tokens", "accepted_tokens", "cache_hits", "cache_misses",
            "wall_time", "verify_time", "speculate_time", "target_wait_time", "overlap_time")


def add_stats(method: Method, st: hf_ssd.SSDStats) -> None:
    d = st.to_dict()
    for k in COUNTERS:
        method.stats[k] = method.stats.get(k, 0) + d[k]
    method.layout = st.layout
    method.draft_path = st.draft_path


def derived(method: Method) -> dict:
    s = method.stats
    out = {
        "method": method.name,
        "layout": method.layout or "-",
        "draft_path": method.draft_path or "-",
        "tokens": method.tokens,
        "seconds": method.seconds,
        "tok_s": method.tokens / method.seconds if method.seconds else 0.0,
        "identical": f"{method.identical}/{method.runs}",
        "first_diff": method.first_diff,
    }
    if s:
        out.update(
            acceptance=s["accepted_tokens"] / s["proposed_tokens"] if s["proposed_tokens"] else 0.0,
            hit_rate=s["cache_hits"] / (s["cache_hits"] + s["cache_misses"]) if s["cache_hits"] + s["cache_misses"]
            else 0.0,
            bubble=1 - s["overlap_time"] / s["wall_time"] if s["wall_time"] else 0.0,
            verify_s=s["verify_time"], speculate_s=s["speculate_time"], wait_s=s["target_wait_time"],
            rounds=s["rounds"],
        )
    return out


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(rows: list[dict], title: str) -> str:
    inline = next((r for r in rows if r["method"] == "SSD inline"), None)
    lines = [
        f"**{title}**",
        "",
        "| method | layout | draft path | tok/s | vs inline | acceptance | hit rate | bubble | verify s | speculate s "
        "| wait s | = AR |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['tok_s'] / inline['tok_s']:.2f}x" if inline and inline["tok_s"] else "-"
        lines.append(
            f"| {r['method']} | {r['layout']} | {r.get('draft_path', '-')} | {r['tok_s']:.1f} | {ratio} | "
            f"{fmt(r.get('acceptance'), '.1%')} | {fmt(r.get('hit_rate'), '.1%')} | {fmt(r.get('bubble'), '.1%')} | "
            f"{fmt(r.get('verify_s'), '.2f')} | {fmt(r.get('speculate_s'), '.2f')} | {fmt(r.get('wait_s'), '.2f')} | "
            f"{r['identical']} |"
        )
    lines.append("")
    lines.append(f"({LABEL} models: random weights; speed and SSD statistics only. 'vs inline' = tok/s over SSD "
                 "layout=inline; bubble = share of wall time verifier and speculator were not both busy.)")
    return "\n".join(lines)


def build_methods(args, target, draft, device: torch.device) -> list[Method]:
    def cfg(**kw) -> hf_ssd.SSDConfig:
        return hf_ssd.SSDConfig(gamma=args.gamma, fanout_budget=args.fanout_budget, hit_rate_warning=0.0, **kw)

    methods: list[Method] = []
    if not args.no_baselines:
        methods.append(Method("AR", "ar"))
        if args.sd_defaults:  # the draft's own generation config, untouched: transformers' defaults
            methods.append(Method("SD (transformers defaults)", "sd", draft))
        for n in args.sd_tokens or [args.gamma]:
            methods.append(Method(f"SD ({n} tokens, threshold 0)", "sd", draft, sd=sd_settings(n)))
    methods.append(Method("SSD inline", "ssd", draft, cfg(layout="inline")))
    auto = "stream" if device.type == "cuda" else "thread"
    if not args.draft_paths:
        methods.append(Method("SSD auto", "ssd", draft, cfg(layout="auto")))
    for path in args.draft_paths:
        if path == "graphs" and device.type != "cuda":
            print(f"[{LABEL}] note: --draft-paths graphs needs CUDA; skipped on {device}", flush=True)
            continue
        methods.append(Method(f"SSD {auto} {PATH_NAMES[path]}", "ssd", draft, cfg(layout="auto", **DRAFT_PATHS[path])))
    for n in args.cpu_threads:
        if device.type == "cpu":
            methods.append(Method(f"SSD thread cpu_threads={n}", "ssd", draft, cfg(layout="thread", cpu_threads=n)))
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        other = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
        methods.append(Method(f"SSD device (draft {other})", "ssd", copy.deepcopy(draft).to(other),
                              cfg(layout="device")))
    if args.cpu_draft and device.type == "cuda":
        cpu_draft = copy.deepcopy(draft).to("cpu", torch.float32)
        methods.append(Method("SSD device (draft cpu)", "ssd", cpu_draft, cfg(layout="device")))
    return methods


def pictures(args, target, method: Method, ids: torch.Tensor, device: torch.device) -> None:
    """One more call of `method`: its per-round timeline (PNG) and/or a profiler trace (chrome JSON)."""
    config = copy.copy(method.config)
    config.record_timeline = True
    method = copy.copy(method)
    method.config = config
    if args.timeline:
        run_once(method, target, ids, args.max_new_tokens, args.gamma)
        try:
            hf_ssd.plot_timeline(hf_ssd.last_stats(target), args.timeline,
                                 title=f"{LABEL} {method.name}: {args.max_new_tokens} new tokens")
            print(f"[{LABEL}] timeline of {method.name!r} -> {args.timeline}", flush=True)
        except ImportError as err:  # matplotlib is optional
            print(f"[{LABEL}] no timeline picture ({err})", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            run_once(method, target, ids, min(16, args.max_new_tokens), args.gamma)
            sync(device)
        if args.profile.endswith(".gz"):  # traces of a big model are large; perfetto reads .json.gz
            import gzip
            import tempfile

            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                prof.export_chrome_trace(tmp.name)
                with open(tmp.name, "rb") as src, gzip.open(args.profile, "wb") as dst:
                    dst.write(src.read())
        else:
            prof.export_chrome_trace(args.profile)
        print(f"[{LABEL}] profiler trace of {method.name!r} ({min(16, args.max_new_tokens)} tokens) -> "
              f"{args.profile} (open in chrome://tracing or ui.perfetto.dev)", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default=None, help="synthetic pair: 'tiny' or '<draft>-<target>' (e.g. 1b-8b); "
                   "default tiny on cpu, 1b-8b on cuda")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--fanout-budget", type=int, default=8)
    p.add_argument("--agreement", type=float, default=0.8, help="per-token draft/target greedy agreement")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--vocab-size", type=int, default=None, help="default 32000 (4096 for the tiny pair)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-draft", action="store_true", help="on cuda: also run layout=device with the draft on CPU")
    p.add_argument("--cpu-threads", default="", help="on cpu: comma list of SSDConfig.cpu_threads to try with "
                   "layout=thread (e.g. 1,2)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads for the whole run")
    p.add_argument("--no-baselines", action="store_true", help="skip AR and SD (greedy check then uses inline)")
    p.add_argument("--sd-tokens", default="", help="comma list of num_assistant_tokens for the SD rows (constant "
                   "schedule, threshold 0); default: gamma")
    p.add_argument("--sd-defaults", action="store_true", help="add an SD row with transformers' default settings")
    p.add_argument("--draft-paths", default="", help="comma list of dynamic,static,graphs: one SSD layout=auto row "
                   "per draft path (default: one row with the default path)")
    p.add_argument("--timeline", default=None, help="PNG: hf_ssd.plot_timeline of one call of the last SSD row")
    p.add_argument("--profile", default=None, help="JSON: torch profiler chrome trace of one call of the last SSD "
                   "row (CUDA kernels per stream show the overlap)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.cpu_threads = [int(x) for x in args.cpu_threads.split(",") if x.strip()]
    args.sd_tokens = [int(x) for x in args.sd_tokens.split(",") if x.strip()]
    args.draft_paths = [x.strip() for x in args.draft_paths.split(",") if x.strip()]
    bad = [x for x in args.draft_paths if x not in DRAFT_PATHS]
    if bad:
        p.error(f"--draft-paths: unknown {bad}; choose from {sorted(DRAFT_PATHS)}")

    if args.device == "cuda" and not torch.cuda.is_available():
        print("layout_bench: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    shape = args.shape or ("1b-8b" if device.type == "cuda" else "tiny")
    draft_shape, target_shape = parse_pair(shape)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    vocab = args.vocab_size or (4096 if shape == "tiny" else 32000)

    t0 = time.perf_counter()
    target, draft = synthetic_pair(target_shape, draft_shape, agreement=args.agreement, dtype=dtype, device=device,
                                   seed=args.seed, vocab_size=vocab)
    info = target.synthetic_info
    print(info.describe(), flush=True)
    print(f"[{LABEL}] built in {time.perf_counter() - t0:.1f}s (init {info.init_seconds:.1f}s, calibration "
          f"{info.calibration_seconds:.1f}s)", flush=True)
    hf_ssd.enable(target)
    methods = build_methods(args, target, draft, device)
    prompts = random_prompts(args.prompts, args.prompt_len, vocab, seed=args.seed + 7)

    # Warm-up: kernels, allocator, threads and streams, so the first timed call is not an outlier.
    warm = prompts[0][:, : min(8, args.prompt_len)].to(device)
    for m in methods:
        run_once(m, target, warm, min(8, args.max_new_tokens), args.gamma)
    sync(device)

    reference: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        ids = prompt.to(device)
        for m in methods:  # interleaved per prompt, so drift in machine load hits every method alike
            sync(device)
            start = time.perf_counter()
            out = run_once(m, target, ids, args.max_new_tokens, args.gamma)
            sync(device)
            m.seconds += time.perf_counter() - start
            seq = out[0].tolist()
            m.tokens += len(seq) - ids.shape[1]
            if m.kind == "ssd":
                add_stats(m, hf_ssd.last_stats(target))
            if len(reference) <= i:
                reference.append(seq)  # AR when baselines run, else the first SSD method
            ref = reference[i]
            m.runs += 1
            if seq == ref:
                m.identical += 1
            else:
                m.first_diff.append(next((j for j, (a, b) in enumerate(zip(seq, ref)) if a != b), min(len(seq),
                                                                                                         len(ref))))
        print(f"[{LABEL}] prompt {i + 1}/{len(prompts)} done", flush=True)

    rows = [derived(m) for m in methods]
    for r in rows:
        if r["first_diff"]:
            print(f"[{LABEL}] note: {r['method']} differs from {'AR' if not args.no_baselines else 'the first method'} "
                  f"at token positions {r['first_diff']} (near-ties flip in low precision; float64 is exact)")
    title = (f"{LABEL} layout bench: {target_shape} target / {draft_shape} draft, {str(dtype).replace('torch.', '')} "
             f"on {device}, agreement {info.measured_agreement:.2f}, gamma {args.gamma}, {args.prompts} prompts x "
             f"{args.max_new_tokens} new tokens, torch threads {torch.get_num_threads()}")
    ssd = [m for m in methods if m.kind == "ssd"]
    if (args.timeline or args.profile) and ssd:
        pictures(args, target, ssd[-1], prompts[0].to(device), device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": LABEL, "synthetic": info.to_dict(), "args": vars(args), "rows": rows}, f, indent=2)
    print()
    print(markdown(rows, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
