#!/usr/bin/env python
"""One prompt at a time (B = 1) on the real pair: the default `SSDConfig()` of this checkout against that of an
older one (e.g. the commit before batched calls), each beside the target alone, in one run. Prints numbers; not
a test.

    git worktree add /tmp/old19 1fa3dde^          # the package as it was before issue 19
    flock /tmp/realpair.lock python scripts/b1_versions.py --old /tmp/old19

The prompts (--prompts, 16: half HumanEval, half GSM, from this checkout's hf_ssd.bench.prompts) are encoded once
here and given to one child process per checkout (old, then this one; --new-first: this one first; --rounds 2
repeats the pair of children in the other order), which puts its checkout first on sys.path, loads the pair,
warms each method up with --warmup-calls (2) calls of 16 tokens, then runs every prompt with the target alone
and with `SSDConfig()`, alternating which goes first (A B, B A, ...), greedy, --max-new-tokens (64) each, 2
torch threads. Every SSD output is compared with the target's (greedy: they must be identical). Reported per
child: tok/s of each method (all new tokens / all calls' wall time) and SSD / target; then this checkout's SSD
tok/s over the old one's. --verbose: per prompt, both methods' seconds and SSD's stats summary (which options
ran); --only old|new (or no --old): one checkout alone; --assisted: this checkout's SSD calls through the one-prompt
path (transformers' assisted loop with hf_ssd's candidate generator) instead of hf_ssd's own loop, the default.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", help="a checkout of an older hf_ssd (its root: the folder holding hf_ssd/); without it, "
                   "this checkout alone")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--warmup-calls", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="pairs of children (old, new; then new, old; ...)")
    p.add_argument("--new-first", action="store_true", help="start with this checkout (new, old; then old, new)")
    p.add_argument("--only", choices=("old", "new"), help="measure one checkout only")
    p.add_argument("--verbose", action="store_true", help="per call: each method's seconds and SSD's stats summary")
    p.add_argument("--assisted", action="store_true",
                   help="this checkout's SSD calls run the one-prompt path (the `loop` hook) instead of hf_ssd's own "
                        "loop, the default")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a checkout's root: run the measurement with it
    p.add_argument("--io", help=argparse.SUPPRESS)  # the child's prompts (in) and results (out), JSON
    return p.parse_args(argv)


def child(args) -> None:
    sys.path.insert(0, args.child)
    import torch

    import hf_ssd
    from hf_ssd import SSDConfig, integration
    from hf_ssd.models.pairs import load_default_pair

    for module in (hf_ssd, integration):  # a module the checkout lacks would come from the installed package
        assert Path(module.__file__).resolve().is_relative_to(Path(args.child).resolve()), module.__file__
    generator = integration.SSDCandidateGenerator  # the checkout's own, wherever its module lives
    if not hasattr(generator, "num_drafting_tokens"):
        # A checkout older than transformers 5.25's support: its assisted loop reads this before the first round
        # (to size a hybrid cache's recording; the real pair's cache is not hybrid, so any bound serves).
        generator.num_drafting_tokens = 16
    torch.set_num_threads(args.threads)
    io = json.loads(Path(args.io).read_text())
    target, draft, _ = load_default_pair(progress=False)
    hf_ssd.enable(target)

    def run(method: str, ids: list[int], new: int) -> tuple[list[int], float]:
        kwargs = {"max_new_tokens": new, "do_sample": False}
        if method == "ssd":
            kwargs.update(assistant_model=draft, ssd_config=SSDConfig(hit_rate_warning=0.0))
            if args.assisted:
                kwargs["_ssd_hooks"] = {"loop": "assisted"}
        x = torch.tensor([ids])
        start = time.perf_counter()
        out = target.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        return out[0, x.shape[1]:].tolist(), time.perf_counter() - start

    for method in ("target", "ssd"):
        for _ in range(args.warmup_calls):
            run(method, io["prompts"][0], 16)
    totals = {"target": [0, 0.0], "ssd": [0, 0.0]}
    mismatches = 0
    for i, ids in enumerate(io["prompts"]):
        order = ("target", "ssd") if i % 2 == 0 else ("ssd", "target")
        outs, times = {}, {}
        for method in order:
            outs[method], seconds = run(method, ids, args.max_new_tokens)
            times[method] = seconds
            totals[method][0] += len(outs[method])
            totals[method][1] += seconds
        mismatches += outs["ssd"] != outs["target"]
        if args.verbose:
            print(f"  prompt {i}: target {times['target']:.2f}s, ssd {times['ssd']:.2f}s "
                  f"({times['target'] / times['ssd']:.2f}x) | {hf_ssd.last_stats(target).summary()}", flush=True)
    io["result"] = {m: t / s for m, (t, s) in totals.items()} | {"mismatches": mismatches}
    Path(args.io).write_text(json.dumps(io))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from hf_ssd.bench.prompts import encode_prompt, load_prompts
    from hf_ssd.models.pairs import prepare_default_pair

    tok = AutoTokenizer.from_pretrained(prepare_default_pair(None, False)["target"], local_files_only=True)
    encoded = []
    for spec, n in (("humaneval", args.prompts - args.prompts // 2), ("gsm", args.prompts // 2)):
        if n:
            encoded += [encode_prompt(row["prompt"], row["kind"], tok) for row in load_prompts(spec, n)[1]]
    checkouts = {"old": str(Path(args.old).resolve()) if args.old else None, "new": str(ROOT)}
    order = []
    for r in range(args.rounds):
        order += ["old", "new"] if (r % 2 == 0) != args.new_first else ["new", "old"]
    if not args.old or args.only:  # one checkout alone
        order = [n for n in order if n == (args.only or "new")]
    results: dict[str, list[dict]] = {"old": [], "new": []}
    for name in order:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"prompts": encoded}, f)
        cmd = [sys.executable, __file__, "--child", checkouts[name], "--io", f.name,
               "--max-new-tokens", str(args.max_new_tokens), "--warmup-calls", str(args.warmup_calls),
               "--threads", str(args.threads)] + (["--verbose"] if args.verbose else []) + (
               ["--assisted"] if args.assisted and name == "new" else [])
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run(cmd, check=True, env=env)
        res = json.loads(Path(f.name).read_text())["result"]
        os.unlink(f.name)
        results[name].append(res)
        print(f"{name} ({checkouts[name]}): target {res['target']:.2f} tok/s, SSDConfig() {res['ssd']:.2f} tok/s "
              f"({res['ssd'] / res['target']:.2f}x), outputs differing from the target's: {res['mismatches']}",
              flush=True)
    print(f"\ncommand: python scripts/b1_versions.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"{args.prompts} prompts (HumanEval + GSM) x {args.max_new_tokens} new tokens, greedy, B = 1, "
          f"{args.threads} threads")
    mean = {n: {m: sum(r[m] for r in rs) / len(rs) for m in ("target", "ssd")} for n, rs in results.items() if rs}
    for n in mean:
        print(f"  {n}: target {mean[n]['target']:.2f} tok/s, SSD {mean[n]['ssd']:.2f} tok/s, "
              f"SSD / target {mean[n]['ssd'] / mean[n]['target']:.2f}x")
    if "old" not in mean:
        return 0
    print(f"  new SSD / old SSD: {mean['new']['ssd'] / mean['old']['ssd']:.2f}x; new (SSD / target) over old "
          f"(SSD / target): {(mean['new']['ssd'] / mean['new']['target']) / (mean['old']['ssd'] / mean['old']['target']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
