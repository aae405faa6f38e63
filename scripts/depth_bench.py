#!/usr/bin/env python
"""Pipeline depth on the SIMULATED device (issue 12): does pre-drafting more than one round ahead pay? Prints
numbers; not a test.

The tiny pair (hf_ssd.models.tiny) with every forward padded to a fixed wall time by sleeping (off-core: a host
waiting on an accelerator; batching free). SSD runs with a fixed configuration (schedule="fixed", so the depth
is the only difference between rows) at pipeline_depth 1, 2, 3, and the best of transformers' assisted settings
on the same harness for reference. Greedy; every output is compared with the target alone.

    python scripts/depth_bench.py                       # gamma 8, draft step 1/12 of a verify, budget 4, cache 12
    python scripts/depth_bench.py --draft-ms 20 --gamma 4
    python scripts/depth_bench.py --default --schedule auto   # the depths against SSDConfig() as it comes
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import hf_ssd
from hf_ssd import SSDConfig
from hf_ssd.bench.runner import assistant_settings


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--verify-ms", type=float, default=120.0, help="simulated target forward")
    p.add_argument("--draft-ms", type=float, default=10.0, help="simulated draft forward (any batch width)")
    p.add_argument("--gamma", type=int, default=8)
    p.add_argument("--budget", type=int, default=4, help="fanout_budget: branches per level")
    p.add_argument("--cache-size", type=int, default=12)
    p.add_argument("--depths", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    p.add_argument("--eviction", default="probability")
    p.add_argument("--noise", type=float, default=0.003, help="tiny draft weight noise (agreement)")
    p.add_argument("--skip-baselines", action="store_true", help="SSD rows only (exploring settings)")
    p.add_argument("--schedule", default="fixed", choices=("fixed", "auto"),
                   help="auto: the depths with every other knob at its default (the scheduler picks gamma and budget)")
    p.add_argument("--default", action="store_true", help="also SSDConfig() as it comes (depth 1, hf_ssd's loop)")
    args = p.parse_args()

    from hf_ssd.models.simulated import DeviceCost, simulate_device
    from hf_ssd.models.tiny import tiny_pair

    torch.set_num_threads(1)
    target, draft, _ = tiny_pair(seed=0, noise=args.noise)
    for m in (target, draft):  # every call runs its full length
        m.generation_config.eos_token_id = None
    hf_ssd.enable(target)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target.config.vocab_size, (1, 12), generator=g) for _ in range(args.prompts)]
    refs = [target.generate(x, max_new_tokens=args.max_new_tokens, do_sample=False)[0, 12:].tolist() for x in prompts]
    simulate_device(target, DeviceCost(args.verify_ms / 1000))
    simulate_device(draft, DeviceCost(args.draft_ms / 1000))
    print(f"SIMULATED device (off-core, batching free): verify {args.verify_ms:.0f} ms, draft step {args.draft_ms:.1f} ms; "
          f"gamma {args.gamma}, budget {args.budget}, cache_size {args.cache_size}, eviction {args.eviction}; "
          f"{args.prompts} prompts x {args.max_new_tokens} tokens, greedy, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")

    def run(kw, settings=contextlib.nullcontext):
        tokens, seconds, outs, stats = 0, 0.0, [], []
        for x in prompts:
            with settings(), torch.inference_mode():
                t0 = time.perf_counter()
                out = target.generate(x, max_new_tokens=args.max_new_tokens, do_sample=False,
                                      attention_mask=torch.ones_like(x), **kw)
                seconds += time.perf_counter() - t0
            outs.append(out[0, 12:].tolist())
            tokens += out.shape[1] - 12
            if "ssd_config" in kw:
                stats.append(hf_ssd.last_stats(target))
        return tokens / seconds, outs == refs, stats

    best = float("nan")
    if not args.skip_baselines:
        rate_ar, same, _ = run({})
        print(f"  {'AR':<26} {rate_ar:7.2f} tok/s  greedy {'identical' if same else 'DIFFERENT (bug)'}")
        best = 0.0
    for n in [] if args.skip_baselines else sorted({4, 6, 8, args.gamma}):
        def settings(n=n):
            return assistant_settings(draft, num_assistant_tokens=n, assistant_confidence_threshold=0.0,
                                      num_assistant_tokens_schedule="constant")

        rate, same, _ = run({"assistant_model": draft}, settings)
        best = max(best, rate)
        print(f"  {f'assisted {n} tokens':<26} {rate:7.2f} tok/s  greedy {'identical' if same else 'DIFFERENT (bug)'}")
    base = None
    rows = ([("SSDConfig()", SSDConfig(hit_rate_warning=0.0))] if args.default else []) + [
        (f"SSD depth {depth}",
         SSDConfig(gamma=args.gamma, fanout_budget=args.budget, cache_size=args.cache_size, schedule="fixed",
                   layout="thread", eviction=args.eviction, pipeline_depth=depth, hit_rate_warning=0.0)
         if args.schedule == "fixed" else
         SSDConfig(pipeline_depth=depth, eviction=args.eviction if depth > 1 else "probability", hit_rate_warning=0.0))
        for depth in args.depths]
    for name, cfg in rows:
        run({"assistant_model": draft, "ssd_config": cfg})  # warm-up
        rate, same, stats = run({"assistant_model": draft, "ssd_config": cfg})
        base = base or rate
        hits = sum(s.cache_hits for s in stats)
        lookups = sum(s.lookups for s in stats)
        by_depth: dict = {}
        ev: dict = {}
        for s in stats:
            for d, n in s.hits_by_depth.items():
                by_depth[d] = by_depth.get(d, 0) + n
            for d, n in s.evictions_by_depth.items():
                ev[d] = ev.get(d, 0) + n
        predicted = sum(s.predicted_hits for s in stats) / max(1, lookups)
        rounds = sum(s.rounds for s in stats)
        acc = sum(s.accepted_tokens for s in stats) / max(1, rounds)
        proposed = sum(s.proposed_tokens for s in stats) / max(1, rounds)
        print(f"  {name:<26} {rate:7.2f} tok/s  greedy {'identical' if same else 'DIFFERENT (bug)'} | "
              f"{rate / base:.2f}x the first row, {rate / best:.2f}x best assisted | hit rate {hits / max(1, lookups):.1%} "
              f"(predicted {predicted:.1%}) | hits by depth {dict(sorted(by_depth.items()))} | "
              f"evictions {sum(ev.values())} {dict(sorted(ev.items()))} | proposed/round {proposed:.2f}, "
              f"accepted/round {acc:.2f}")


if __name__ == "__main__":
    main()
