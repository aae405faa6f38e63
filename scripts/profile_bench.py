#!/usr/bin/env python
"""Tuning profile benchmark (issue 20): does a profile written by `hf-ssd tune` remove the first call's
exploration penalty? Prints numbers; not a test.

Three kinds of fresh processes each run one 64-token greedy `generate` with the default SSDConfig() on the same
prompt, as `hf-ssd generate --prompt "def fibonacci(n):" --max-new-tokens 64` does (models loaded by the same
code, same torch threads):

  (a) cold:    no profile (HF_SSD_NO_PROFILE=1): the first call explores every option family;
  (b) profile: after `hf-ssd tune` wrote the pair's profile: the first call starts from it;
  (c) warm:    no profile; the process first runs the pair on another prompt (--warm-prompt), then the timed
               call (a process that has run the pair, but not on this very text, whose acceptance it would
               otherwise have learned already).

Only the generate call is timed (not the model load). Each kind runs --repeats times, interleaved (a, b, c, a,
b, c, ...); it prints every run, the median tok/s of each kind and the ratios b/c and a/c (the issue's "done
when": b/c >= 1 within noise). The profile goes to a temporary directory (HF_SSD_PROFILES), so the user's profiles
are untouched, unless --profiles names one.

    python scripts/profile_bench.py --tiny                      # smoke check, ~1 minute
    flock /tmp/realpair.lock python scripts/profile_bench.py    # the default pair: tune ~3-6 min + 9 processes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "PROFILE_BENCH "


def child(args) -> None:
    """One process of kind args.child: load the pair as `hf-ssd generate` does, run the call(s), print JSON."""
    import torch

    import hf_ssd
    from hf_ssd import SSDConfig
    from hf_ssd.cli import _prompt_ids, _torch_threads, build_parser, load_models

    argv = ["generate", "--prompt", args.prompt, "--max-new-tokens", str(args.max_new_tokens)]
    argv += ["--tiny"] if args.tiny else []
    argv += ["--threads", str(args.threads)] if args.threads else []
    gen_args = build_parser().parse_args(argv)
    with _torch_threads(gen_args.threads or (1 if gen_args.tiny else None)):
        target, draft, tokenizer = load_models(gen_args)
        hf_ssd.enable(target)
        ids = _prompt_ids(gen_args, tokenizer)
        input_ids = torch.tensor([ids], dtype=torch.long, device=target.device)
        kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "attention_mask": torch.ones_like(input_ids),
                  "assistant_model": draft, "ssd_config": SSDConfig()}
        if args.tiny:  # the random tiny pair stops early; the real pair writes its 64 tokens
            kwargs["min_new_tokens"] = args.max_new_tokens
        if args.child == "warm":  # the pair has run in this process, on other text
            warm_args = build_parser().parse_args(["generate", "--prompt", args.warm_prompt] + argv[3:])
            warm_ids = torch.tensor([_prompt_ids(warm_args, tokenizer)], dtype=torch.long, device=target.device)
            with torch.inference_mode():
                target.generate(warm_ids, **{**kwargs, "attention_mask": torch.ones_like(warm_ids)})
        with torch.inference_mode():
            start = time.perf_counter()
            out = target.generate(input_ids, **kwargs)
            seconds = time.perf_counter() - start
        stats = hf_ssd.last_stats(target)
        new = out.shape[1] - len(ids)
        print(MARK + json.dumps({
            "kind": args.child, "tokens": new, "seconds": seconds, "tok_s": new / seconds,
            "options": len(stats.options), "explored_rounds": stats.explored_rounds, "rounds": stats.rounds,
            "profile": stats.profile, "torch_threads": torch.get_num_threads(),
        }), flush=True)


def run_child(kind: str, args, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--prompt", args.prompt, "--warm-prompt", args.warm_prompt,
           "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--threads", str(args.threads)] if args.threads else []
    if kind != "profile":
        env = {**env, "HF_SSD_NO_PROFILE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{kind} process failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(MARK):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the random tiny pair (smoke check) instead of the default pair")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--warm-prompt", default="def quicksort(xs):", help="(c): the prompt of the untimed first call")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: as hf-ssd: torch's; 1 with --tiny)")
    p.add_argument("--repeats", type=int, default=3, help="processes of each kind (interleaved)")
    p.add_argument("--profiles", default=None,
                   help="profile directory (HF_SSD_PROFILES) to write and read (default: a temporary one)")
    p.add_argument("--tune-args", default="", help="extra arguments for `hf-ssd tune`, e.g. '--num-prompts 1'")
    p.add_argument("--child", choices=("cold", "profile", "warm"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0

    tmp = None
    if args.profiles is None:
        tmp = tempfile.TemporaryDirectory(prefix="hf_ssd_profiles_")
        args.profiles = tmp.name
    env = {**os.environ, "HF_SSD_PROFILES": args.profiles,
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    env.pop("HF_SSD_NO_PROFILE", None)
    tune = [sys.executable, "-m", "hf_ssd.cli", "tune", "--no-progress", *args.tune_args.split()]
    tune += ["--tiny"] if args.tiny else []
    tune += ["--threads", str(args.threads)] if args.threads else []
    print(f"$ HF_SSD_PROFILES={args.profiles} {' '.join(tune[1:])}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(tune, env=env, capture_output=True, text=True)
    tune_s = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"hf-ssd tune failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    written = [line for line in done.stdout.splitlines() if line.startswith(("recommended:", "tuning profile"))]
    print(f"tune: {tune_s:.0f} s; " + " | ".join(written), flush=True)

    runs: dict[str, list[dict]] = {"cold": [], "profile": [], "warm": []}
    print(f"\n{'run':<4} {'kind':<8} {'tok/s':>8} {'tokens':>6} {'options':>7} {'explored':>8} {'rounds':>6}  profile")
    for r in range(args.repeats):
        for kind in runs:
            res = run_child(kind, args, env)
            runs[kind].append(res)
            prof = Path(res["profile"]).name if res["profile"] else "-"
            print(f"{r + 1:<4} {kind:<8} {res['tok_s']:>8.2f} {res['tokens']:>6} {res['options']:>7} "
                  f"{res['explored_rounds']:>8} {res['rounds']:>6}  {prof}", flush=True)
    if not all(res["profile"] for res in runs["profile"]):
        print("WARNING: a (b) process did not load the profile (see its stats); the comparison is void")
    med = {kind: statistics.median(r["tok_s"] for r in rs) for kind, rs in runs.items()}
    print(f"\nmedian tok/s over {args.repeats} processes each ({args.max_new_tokens}-token greedy generate, "
          f"{'tiny pair' if args.tiny else 'default pair'}, {runs['warm'][0]['torch_threads']} torch threads):")
    labels = {"cold": "(a) fresh, no profile", "profile": "(b) fresh, with profile", "warm": "(c) warm process"}
    for kind, label in labels.items():
        print(f"  {label:<26} {med[kind]:8.2f}")
    print(f"  b/c = {med['profile'] / med['warm']:.3f}   a/c = {med['cold'] / med['warm']:.3f}   "
          f"(b/c >= 1: no exploration penalty left)")
    per_run = [f"{b['tok_s'] / c['tok_s']:.2f}" for b, c in zip(runs["profile"], runs["warm"])]
    print(f"  b/c per repeat: {', '.join(per_run)}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
