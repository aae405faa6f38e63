#!/usr/bin/env python
"""Dynamic vs static draft path, SSD layout="inline" (no overlap, so the draft's own cost shows), SYNTHETIC pair.

Greedy, same prompts for both paths, interleaved repetitions (the first is warm-up), median tok/s and the draft
time (speculation jobs + fallback drafts) per repetition. Add --device cuda for the graphs path as well.

    python scripts/draft_path_timing.py --shape small-tiny --budget 1
    python scripts/draft_path_timing.py --device cuda --shape 1b-8b --dtype bfloat16 --budget 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import hf_ssd
from hf_ssd.models.synthetic import LABEL, random_prompts, synthetic_pair

PATHS = {"dynamic": dict(static_draft=False), "static": dict(static_draft=True, cuda_graphs=False),
         "graphs": dict(cuda_graphs=True)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--shape", default="small-tiny", help="'<target>-<draft>' synthetic shapes")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--budget", type=int, default=1, help="SSDConfig.fanout_budget")
    p.add_argument("--agreement", type=float, default=0.9)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=4, help="repetitions, the first one is warm-up")
    p.add_argument("--vocab-size", type=int, default=4096)
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny models: intra-op threads only add spin-waits on a shared machine
    target_shape, draft_shape = args.shape.split("-")
    target, draft = synthetic_pair(target_shape, draft_shape, agreement=args.agreement, dtype=DTYPES[args.dtype],
                                   device=args.device, vocab_size=args.vocab_size)
    hf_ssd.enable(target)
    prompts = [x.to(args.device) for x in random_prompts(args.prompts, 64, args.vocab_size, seed=7)]
    paths = [k for k in PATHS if k != "graphs" or args.device == "cuda"]
    speed: dict = {k: [] for k in paths}
    drafting: dict = {k: [] for k in paths}
    used: dict = {}
    for rep in range(args.reps):
        for name in paths:
            cfg = hf_ssd.SSDConfig(layout="inline", hit_rate_warning=0.0, fanout_budget=args.budget, **PATHS[name])
            tokens, seconds, draft_s = 0, 0.0, 0.0
            for ids in prompts:
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                      assistant_model=draft, ssd_config=cfg)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                seconds += time.perf_counter() - t0
                tokens += out.shape[1] - ids.shape[1]
                st = hf_ssd.last_stats(target)
                draft_s += st.speculate_time + st.fallback_draft_time
                used[name] = st.draft_path
            if rep:
                speed[name].append(tokens / seconds)
                drafting[name].append(draft_s)
    print(f"{LABEL} {args.shape} {args.dtype} on {args.device}, fanout_budget {args.budget}, SSD inline, "
          f"{args.prompts} prompts x {args.max_new_tokens} tokens, median of {args.reps - 1}")
    for name in paths:
        print(f"  {name:8s} ({used[name]}): {statistics.median(speed[name]):7.1f} tok/s, draft time "
              f"{statistics.median(drafting[name]):.3f} s (runs {[round(x) for x in speed[name]]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
