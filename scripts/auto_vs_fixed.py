#!/usr/bin/env python
"""Gap (b) of issue 19: `schedule="auto"` against every fixed SSD option on a simulated device whose latency
model is not the tests' (forwards cost more per token, and the draft's batched branches are not free).
Prints numbers; not a test.

    python scripts/auto_vs_fixed.py
    python scripts/auto_vs_fixed.py --target-ms 25 --target-token-ms 1.5 --draft-ms 8 --draft-row-ms 1

The tiny pair (draft noise --noise) with every forward padded off-core (slept, as a host waiting on an
accelerator) to: target base + per token x tokens; draft base + per token x tokens + per row x (rows - 1).
Fixed options: `SSDConfig(schedule="fixed", fanout="geometric", gamma=g, fanout_budget=b)` for every g in
--gammas and b in --budgets. Each method (auto included) starts from no estimates, runs --warmup-calls (2)
calls, then --prompts calls of --max-new-tokens greedy tokens; throughput is tokens / seconds over those calls.
Auto keeps its estimates across calls (as any later call in a program does): its first call is its warm-up
(the target alone until learning fits 3% of the decode time), its second learns; each call's rate is printed. Every output is compared
with the target alone. Ratios are within one run.
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_ssd
from hf_ssd import SSDConfig
from hf_ssd.models.simulated import DeviceCost, simulate_device
from hf_ssd.models.tiny import tiny_pair
from hf_ssd.scheduling.costs import reset_estimates


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--warmup-calls", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--noise", type=float, default=0.003, help="the tiny draft's weight noise (acceptance)")
    p.add_argument("--target-ms", type=float, default=25.0)
    p.add_argument("--target-token-ms", type=float, default=1.5, help="per input token of a target forward")
    p.add_argument("--draft-ms", type=float, default=8.0)
    p.add_argument("--draft-token-ms", type=float, default=0.5)
    p.add_argument("--draft-row-ms", type=float, default=1.0, help="per extra row (branch) of a draft forward")
    p.add_argument("--gammas", default="2,3,4,6")
    p.add_argument("--budgets", default="1,2,4,8,16")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    target, draft, _ = tiny_pair(seed=0, noise=args.noise)
    for m in (target, draft):  # every call runs its full length: timings compare like with like
        m.generation_config.eos_token_id = None
    hf_ssd.enable(target)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target.config.vocab_size, (1, 12), generator=g)
               for _ in range(args.prompts + args.warmup_calls)]
    refs = [target.generate(q, max_new_tokens=args.max_new_tokens, do_sample=False)[0, 12:].tolist() for q in prompts]
    ms = 1e-3
    simulate_device(target, DeviceCost(args.target_ms * ms, args.target_token_ms * ms))
    simulate_device(draft, DeviceCost(args.draft_ms * ms, args.draft_token_ms * ms, args.draft_row_ms * ms))
    print(f"SIMULATED device (off-core): target {args.target_ms:g} ms + {args.target_token_ms:g} ms/token; draft "
          f"{args.draft_ms:g} ms + {args.draft_token_ms:g} ms/token + {args.draft_row_ms:g} ms/extra row; tiny pair "
          f"(noise {args.noise}), {args.warmup_calls} warm-up + {args.prompts} calls x {args.max_new_tokens} tokens, greedy")

    def call(config, q):
        start = time.perf_counter()
        out = target.generate(q, max_new_tokens=args.max_new_tokens, do_sample=False, assistant_model=draft,
                              ssd_config=config)
        return out[0, 12:].tolist(), time.perf_counter() - start

    def measure(name, config):
        reset_estimates(target)  # each method learns from nothing (auto's warm-up call is its exploration)
        tokens, seconds, same, rates = 0, 0.0, True, []
        for i, (q, ref) in enumerate(zip(prompts, refs)):
            out, s = call(config, q)
            same, rates = same and out == ref, rates + [len(out) / s]
            if i >= args.warmup_calls:
                tokens, seconds = tokens + len(out), seconds + s
        stats = hf_ssd.last_stats(target)
        print(f"  {name:<22} {tokens / seconds:7.2f} tok/s  (calls: {' '.join(f'{r:.1f}' for r in rates)})  "
              f"acceptance {stats.acceptance_rate:.0%}  hit {stats.hit_rate:.0%}  "
              f"greedy {'identical' if same else 'DIFFERENT (bug)'}", flush=True)
        if config.schedule == "auto":  # what it chose in its last call, by share of round time
            total = sum(e["seconds"] for e in stats.options.values()) or 1.0
            top = sorted(stats.options.items(), key=lambda kv: -kv[1]["seconds"])[:4]
            print("    last call's options: " + ", ".join(f"{n} {e['seconds'] / total:.0%}" for n, e in top))
        return tokens / seconds, rates[0], same

    quiet = {"hit_rate_warning": 0.0}
    auto, auto_first, ok = measure("auto (SSDConfig())", SSDConfig(**quiet))
    fixed = {}
    for gamma in (int(x) for x in args.gammas.split(",")):
        for budget in (int(x) for x in args.budgets.split(",")):
            name = f"fixed b={budget} g={gamma}"
            cfg = SSDConfig(schedule="fixed", fanout="geometric", gamma=gamma, fanout_budget=budget, **quiet)
            fixed[name], _, same = measure(name, cfg)
            ok = ok and same
    best = max(fixed, key=fixed.get)
    print(f"-> auto / best fixed ({best}, {fixed[best]:.2f} tok/s) = {auto / fixed[best]:.3f}x "
          f"(first call {auto_first / fixed[best]:.3f}x); all outputs identical to the target: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
