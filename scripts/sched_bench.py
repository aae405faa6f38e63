#!/usr/bin/env python
"""Measured-cost scheduling benchmarks (issue 8, "Done when" 1 and 2). Prints numbers; not a test.

--sim: a SIMULATED device (hf_ssd.models.simulated) around the tiny pair: every forward takes a configured
       wall time; a draft step is a quarter of a verify. Off-core (sleeping, batching free): default
       SSDConfig() against transformers' assisted settings (defaults; 4 and 6 tokens, threshold 0) on the same
       harness, and the options the scheduler chose. On-core (busy CPU, each extra branch costs more): the
       options chosen (plain SD expected).
--real: the real pair (Qwen2.5-Coder 1.5B / 0.5B) on this CPU, greedy and T=0.7, HumanEval and GSM prompts:
       AR, assisted defaults, assisted 4 and 6 tokens (threshold 0), each at its best torch thread count (probed
       on the first prompt at 1 and 2 threads), against the default SSDConfig(). Wrap in
       `flock /tmp/realpair.lock` on shared machines (one real-pair process at a time). --with-stock adds
       SSDConfig(draft_matmul="stock"): the default's draft runs faster CPU products than the assisted
       baselines' draft (hf_ssd/drafting/matmul.py); this separates that from the scheduler.

    python scripts/sched_bench.py --sim
    flock /tmp/realpair.lock python scripts/sched_bench.py --real --prompts 3 --max-new-tokens 64

Every method is warmed up once before timing (SSD's scheduler keeps its estimates across calls, so the timed
calls start informed, as a second call in any program does). Ratios are within one run. Greedy outputs of every
method are compared with the target alone.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import hf_ssd
from hf_ssd import SSDConfig
from hf_ssd.bench.runner import assistant_settings, torch_threads

ASSISTED = {  # name -> draft generation_config overrides (None: the draft's defaults)
    "assisted": None,
    "assisted_4": {"num_assistant_tokens": 4, "assistant_confidence_threshold": 0.0,
                   "num_assistant_tokens_schedule": "constant"},
    "assisted_6": {"num_assistant_tokens": 6, "assistant_confidence_threshold": 0.0,
                   "num_assistant_tokens_schedule": "constant"},
}


def draft_settings(draft, values):
    return assistant_settings(draft, **(values or {}))


def threads(n):
    return torch_threads(n)


def run(method, target, draft, ids, new, sample, seed=0):
    """(new tokens, seconds, stats or None) of one generate call of `method`."""
    kw = {"max_new_tokens": new, "do_sample": sample, "attention_mask": torch.ones_like(ids)}
    if sample:
        kw["temperature"] = 0.7
    settings = contextlib.nullcontext()
    if method in ASSISTED:
        kw["assistant_model"] = draft
        settings = draft_settings(draft, ASSISTED[method])
    elif method == "ssd":
        kw.update(assistant_model=draft, ssd_config=SSDConfig(hit_rate_warning=0.0))
    elif method == "ssd_stock":  # the same, with the draft's stock CPU products (draft_matmul="stock")
        kw.update(assistant_model=draft, ssd_config=SSDConfig(hit_rate_warning=0.0, draft_matmul="stock"))
    torch.manual_seed(seed)
    with settings, torch.inference_mode():
        start = time.perf_counter()
        out = target.generate(ids, **kw)
        seconds = time.perf_counter() - start
    return out[0, ids.shape[1]:].tolist(), seconds, hf_ssd.last_stats(target) if method.startswith("ssd") else None


def measure(method, target, draft, prompts, new, sample):
    tokens, seconds, outs, shares = 0, 0.0, [], {}
    rounds = proposed = accepted = 0
    for ids in prompts:
        out, s, stats = run(method, target, draft, ids, new, sample)
        tokens, seconds = tokens + len(out), seconds + s
        outs.append(out)
        if stats is not None:
            for name, e in stats.options.items():
                shares[name] = shares.get(name, 0.0) + e["seconds"]
            rounds, proposed, accepted = rounds + stats.rounds, proposed + stats.proposed_tokens, accepted + stats.accepted_tokens
    if rounds:  # what SSDConfig() proposed and got accepted per round (the scheduler's draft lengths)
        shares["_per_round"] = (proposed / rounds, accepted / rounds)
    return tokens / seconds, outs, shares


def fmt_shares(shares):
    shares = dict(shares)
    per_round = shares.pop("_per_round", None)
    total = sum(shares.values()) or 1.0
    top = sorted(shares.items(), key=lambda kv: -kv[1])[:4]
    text = ", ".join(f"{name} {s / total:.0%}" for name, s in top)
    if per_round:
        text += f" | per round: {per_round[0]:.2f} proposed, {per_round[1]:.2f} accepted"
    return text


# ----- simulated device ------------------------------------------------------------------------------------------


def sim_bench(args):
    from hf_ssd.models.simulated import DeviceCost, simulate_device, unsimulate
    from hf_ssd.models.tiny import tiny_pair
    from hf_ssd.scheduling.costs import reset_estimates

    torch.set_num_threads(1)
    target, draft, _ = tiny_pair(seed=0, noise=args.sim_noise)
    for m in (target, draft):  # every call runs its full length: timings compare like with like
        m.generation_config.eos_token_id = None
    hf_ssd.enable(target)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target.config.vocab_size, (1, 12), generator=g) for _ in range(args.prompts)]
    refs = [target.generate(p, max_new_tokens=args.max_new_tokens, do_sample=False)[0, 12:].tolist()
            for p in prompts]
    v = args.sim_verify_ms / 1000
    print(f"SIMULATED device: verify {v * 1e3:.0f} ms, draft step {v / 4 * 1e3:.1f} ms (a quarter), tiny pair "
          f"(draft noise {args.sim_noise}), {args.prompts} prompts x {args.max_new_tokens} tokens, greedy")
    for on_core in (False, True):
        reset_estimates(target)
        simulate_device(target, DeviceCost(v, 0.0, 0.0, on_core))
        simulate_device(draft, DeviceCost(v / 4, 0.0, v / 8 if on_core else 0.0, on_core))
        label = "on-core (shared CPU, each extra branch +1/2 step)" if on_core else "off-core (sleep, batching free)"
        methods = ["ar", *ASSISTED, "ssd"]
        rates = {}
        for m in methods:
            run(m, target, draft, prompts[0], args.max_new_tokens, False)  # warm-up (and SSD's first estimates)
            rate, outs, shares = measure(m, target, draft, prompts, args.max_new_tokens, False)
            rates[m] = rate
            same = "identical" if outs == refs else "DIFFERENT (bug)"
            extra = f" | options by round time: {fmt_shares(shares)}" if shares else ""
            print(f"  {label:<50} {m:<12} {rate:8.2f} tok/s  greedy {same}{extra}")
        best = max(ASSISTED, key=rates.get)
        print(f"  -> default SSDConfig() / best assisted ({best}) = {rates['ssd'] / rates[best]:.2f}x, "
              f"/ AR = {rates['ssd'] / rates['ar']:.2f}x")
        unsimulate(target)
        unsimulate(draft)


# ----- real pair -------------------------------------------------------------------------------------------------


def real_bench(args):
    from hf_ssd.bench.prompts import encode_prompt, load_prompts
    from hf_ssd.models.pairs import load_default_pair

    t0 = time.perf_counter()
    target, draft, tok = load_default_pair()
    hf_ssd.enable(target)
    print(f"real pair loaded in {time.perf_counter() - t0:.0f}s; torch threads available: {torch.get_num_threads()}")
    sets = {}
    for name in args.datasets:
        _, ds = load_prompts(name, args.prompts)
        sets[name] = [torch.tensor([encode_prompt(r["prompt"], r["kind"], tok)]) for r in ds]
    warm = sets[args.datasets[0]][0]
    baselines = ["ar", *ASSISTED]
    for sample in (False, True) if args.modes == "both" else (args.modes == "sample",):
        mode = "T=0.7" if sample else "greedy"
        # Best thread count per baseline, probed on one prompt (SSD runs at the default: all cores per side).
        best_threads = {}
        for m in baselines:
            probe = {}
            for n in (1, 2):
                with threads(n):
                    run(m, target, draft, warm, 8, sample)
                    _, s, _ = run(m, target, draft, warm, args.probe_tokens, sample)
                probe[n] = s
            best_threads[m] = min(probe, key=probe.get)
            print(f"[{mode}] {m}: probe seconds by threads {probe} -> {best_threads[m]} threads")
        ssds = ["ssd", "ssd_stock"] if args.with_stock else ["ssd"]
        for m in ssds:
            run(m, target, draft, warm, args.max_new_tokens, sample)  # warm-up: first estimates of this mode
        for name, prompts in sets.items():
            rates, outs = {}, {}
            for m in baselines:
                with threads(best_threads[m]):
                    rates[m], outs[m], _ = measure(m, target, draft, prompts, args.max_new_tokens, sample)
            if args.with_stock:
                rates["ssd_stock"], outs["ssd_stock"], stock_shares = measure("ssd_stock", target, draft, prompts,
                                                                              args.max_new_tokens, sample)
            rates["ssd"], outs["ssd"], shares = measure("ssd", target, draft, prompts, args.max_new_tokens, sample)
            best = max(ASSISTED, key=rates.get)
            print(f"[{mode}] {name} ({len(prompts)} prompts x {args.max_new_tokens} tokens): " +
                  ", ".join(f"{m} {r:.2f}" for m, r in rates.items()) + " tok/s")
            print(f"[{mode}] {name}: SSDConfig() = {rates['ssd'] / rates[best]:.3f}x best assisted ({best}), "
                  f"{rates['ssd'] / rates['ar']:.3f}x AR | options by round time: {fmt_shares(shares)}")
            if args.with_stock:
                print(f"[{mode}] {name}: SSDConfig(draft_matmul='stock') = "
                      f"{rates['ssd_stock'] / rates[best]:.3f}x best assisted, {rates['ssd_stock'] / rates['ar']:.3f}x AR; "
                      f"draft_matmul's share: {rates['ssd'] / rates['ssd_stock']:.3f}x | {fmt_shares(stock_shares)}")
            if not sample:
                same = all(outs[m] == outs["ar"] for m in outs)
                print(f"[{mode}] {name}: greedy outputs identical across methods: {same}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sim", action="store_true", help="run the simulated-device benchmark")
    p.add_argument("--real", action="store_true", help="run the real-pair benchmark (minutes; ~10 GB RAM)")
    p.add_argument("--prompts", type=int, default=3, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--datasets", type=lambda s: s.split(","), default=["humaneval", "gsm"])
    p.add_argument("--modes", choices=("greedy", "sample", "both"), default="both")
    p.add_argument("--with-stock", action="store_true",
                   help="also time SSDConfig(draft_matmul='stock'): the scheduler's gain without the draft's faster "
                        "CPU products")
    p.add_argument("--probe-tokens", type=int, default=32, help="new tokens of the thread-count probe")
    p.add_argument("--sim-verify-ms", type=float, default=40.0, help="simulated verify time")
    p.add_argument("--sim-noise", type=float, default=0.003, help="tiny draft weight noise (agreement)")
    args = p.parse_args()
    if not (args.sim or args.real):
        p.error("choose --sim and/or --real")
    if args.sim:
        sim_bench(args)
    if args.real:
        real_bench(args)


if __name__ == "__main__":
    main()
