#!/usr/bin/env python
"""Batch 1 where the draft helps little: the default SSDConfig() in a process's FIRST call and in later calls,
against the best of the target alone and transformers' assisted settings. Prints numbers; not a test.

Prompts: the first half of the source of functions from Python's standard library (raw code, no chat template),
where the real pair's draft agrees with the target less than on HumanEval. Greedy.

Order, in one fresh process with no tuning profile (HF_SSD_NO_PROFILE=1 is set here):
1. both models' kernels warmed by a 2-token `generate` each (first-use costs are not SSD's);
2. **first call**: SSDConfig() on prompt 0 (its scheduler knows nothing yet: it is in its warm-up, and the
   draft's probe runs, since HF_SSD_NO_PROFILE=1 also turns off remembered probe verdicts);
3. the baselines on prompt 0 (they keep no state: their first call is any call), each at its best torch thread
   count, probed at 1 and 2 threads on prompt 0 (--probe-tokens);
4. **later calls**: every method on every prompt, the method order rotating per prompt.
Ratios are within this one run. Every greedy output is compared with the target alone.

    flock /tmp/realpair.lock python scripts/first_call_bench.py                  # 3 prompts x 48 tokens
    python scripts/first_call_bench.py --tiny --prompts 2 --max-new-tokens 8     # smoke check

--assisted: the SSD calls run the one-prompt path (loop/assisted.py) instead of hf_ssd's own loop, which every
batch size runs by default.

--processes N: first calls only, over N fresh processes (one first call is a single sample, and this machine's
speed moves by 10% within minutes). Each child loads the pair, warms both models' kernels as in 1., then makes the
first call of each method (SSDConfig(), the target alone, assisted generation with the draft's defaults) on one
prompt, in an order rotated per process: process i runs prompt (i // 3) mod --prompts with rotation i mod 3, so 9
processes run every prompt in every order. A process's first generate of 48 tokens runs a few seconds slower than
its second whatever the method (measured: the target alone 25.6-27.5 s first against 22.7-22.8 s second), so the
report gives each method's seconds by its position in the process (first, second, third), beside its seconds
over all processes.

Each child also times the target's own forwards (hooks on the target model: on CPU they return when done) and
reports each call's seconds outside them: the set-up, the probe, the draft's work, the loop. Where SSD's call ran
as many target forwards as the target alone's (every round AR, as on these prompts), the two calls did the same
forward work, and the machine's speed, which moves by 10% between calls, can be taken out of the comparison: the
"same-forwards" ratio is the target alone's seconds over (its forward seconds + SSD's seconds outside them),
summed over the processes.

    flock /tmp/realpair.lock python scripts/first_call_bench.py --processes 9      # ~19 minutes

--remembered (with --processes): what a later program on the machine gets. The children keep what hf_ssd remembers
on disk (the draft's probe verdict, "auto"'s matmul verdicts; no tuning profile, which only `hf-ssd tune` writes), in
a fresh temporary folder that one SSD call of a priming child fills first.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REMEMBERED_ENV = "FIRST_CALL_BENCH_REMEMBERED"  # set by --remembered for its children: keep hf_ssd's disk memory
if not os.environ.get(REMEMBERED_ENV):
    os.environ["HF_SSD_NO_PROFILE"] = "1"  # a first call that knows nothing: what a new program gets

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_ssd  # noqa: E402
from hf_ssd import SSDConfig  # noqa: E402
from hf_ssd.bench.runner import assistant_settings, torch_threads  # noqa: E402

BASELINES = {  # name -> draft generation_config overrides for assisted generation (None: the target alone)
    "target": None,
    "assisted": {},
    "assisted_4": {"num_assistant_tokens": 4, "assistant_confidence_threshold": 0.0,
                   "num_assistant_tokens_schedule": "constant"},
}


def stdlib_prompts(n: int) -> list[str]:
    import bisect
    import difflib
    import fnmatch
    import shlex
    import textwrap

    functions = [textwrap.TextWrapper._wrap_chunks, shlex.shlex.read_token, fnmatch.translate,
                 difflib.SequenceMatcher.find_longest_match, bisect.insort_right]
    out = []
    for f in functions[:n]:
        lines = inspect.getsource(f).splitlines(keepends=True)
        out.append("".join(lines[: max(4, len(lines) // 2)]))
    return out


HOOKS: dict = {}  # --assisted: the SSD calls' `_ssd_hooks`
FORWARDS = {"seconds": 0.0, "count": 0, "start": None}  # the target's forwards in the current call (`timed_forwards`)


def timed_forwards(model) -> None:
    """Count and time `model`'s forwards (the top-level module's: one per decoding step or verify)."""
    def pre(module, args):
        FORWARDS["start"] = time.perf_counter()

    def post(module, args, out):
        FORWARDS["seconds"] += time.perf_counter() - FORWARDS["start"]
        FORWARDS["count"] += 1

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post)


def call(method, target, draft, ids, new):
    kw = {"max_new_tokens": new, "do_sample": False, "attention_mask": torch.ones_like(ids)}
    settings = contextlib.nullcontext()
    if method == "ssd":
        kw.update(assistant_model=draft, ssd_config=SSDConfig(hit_rate_warning=0.0), _ssd_hooks=dict(HOOKS))
    elif BASELINES[method] is not None:
        kw["assistant_model"] = draft
        settings = assistant_settings(draft, **BASELINES[method])
    FORWARDS.update(seconds=0.0, count=0)
    with settings, torch.inference_mode():
        start = time.perf_counter()
        out = target.generate(ids, **kw)
        seconds = time.perf_counter() - start
    return out[0, ids.shape[1]:].tolist(), seconds, hf_ssd.last_stats(target) if method == "ssd" else None


def describe(stats) -> str:
    shares = ", ".join(f"{name} {share:.0%}" for name, _, share in stats.option_shares()[:3])
    acc = stats.accepted_tokens / stats.proposed_tokens if stats.proposed_tokens else 0.0
    return (f"{stats.rounds} rounds, {stats.explored_rounds} explored, acceptance {acc:.0%}, "
            f"hit rate {stats.hit_rate:.0%} of {stats.lookups} | {shares}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny random pair (smoke check; speeds mean nothing)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--probe-tokens", type=int, default=24, help="new tokens of the baselines' thread probe")
    p.add_argument("--assisted", action="store_true",
                   help="SSD calls run the one-prompt path (transformers' assisted loop with hf_ssd's candidate "
                        "generator) instead of hf_ssd's own loop, the default")
    p.add_argument("--processes", type=int, default=0,
                   help="first calls only, each method's in each of this many fresh processes (see above)")
    p.add_argument("--remembered", action="store_true",
                   help="with --processes: the children keep hf_ssd's disk memory, primed by one SSD call (see above)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # --processes: the methods' order in one child
    p.add_argument("--prompt-index", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.assisted:
        HOOKS["loop"] = "assisted"
    if args.processes:
        return first_calls(args)
    if args.tiny:
        from hf_ssd.models.tiny import tiny_pair

        target, draft, tok = tiny_pair()
        torch.set_num_threads(1)
    else:
        from hf_ssd.models.pairs import load_default_pair

        target, draft, tok = load_default_pair(dtype=torch.float32, device=torch.device("cpu"))
    hf_ssd.enable(target)
    for m in (target, draft):  # every call runs its full length: timings compare like with like
        m.generation_config.eos_token_id = None
    prompts = [torch.tensor([tok(t).input_ids]) for t in stdlib_prompts(args.prompts)]
    new = args.max_new_tokens
    if args.child:
        prompts = [prompts[args.prompt_index % len(prompts)]]
    with torch.inference_mode():  # 1. first-use costs of both models' kernels
        for m in (target, draft):
            m.generate(prompts[0], max_new_tokens=2, do_sample=False, attention_mask=torch.ones_like(prompts[0]))
    if args.child:  # --processes: each method's first call in this process
        timed_forwards(target)
        outs, seconds, inside = {}, {}, {}
        for m in args.child.split(","):
            outs[m], seconds[m], _ = call(m, target, draft, prompts[0], new)
            inside[m] = (FORWARDS["seconds"], FORWARDS["count"])
        assert all(o == outs["target"] for o in outs.values()), "a method differs from the target alone"
        print(json.dumps({"seconds": seconds, "forwards": inside, "threads": torch.get_num_threads()}))
        return

    reference = call("target", target, draft, prompts[0], new)[0]  # prompt 0's greedy output, the target alone
    first_out, first_s, first_stats = call("ssd", target, draft, prompts[0], new)  # 2. the first call
    threads = {}
    for m in BASELINES:  # 3. the baselines' thread counts and their prompt-0 time
        probe = {}
        for n in (1, 2):
            with torch_threads(n):
                probe[n] = call(m, target, draft, prompts[0], args.probe_tokens)[1]
        threads[m] = min(probe, key=probe.get)
    first_base = {}
    for m in BASELINES:
        with torch_threads(threads[m]):
            out, first_base[m], _ = call(m, target, draft, prompts[0], new)
        assert out == reference, f"{m} differs from the target alone"
    assert first_out == reference, "SSD's first call differs from the target alone"

    totals = {m: 0.0 for m in (*BASELINES, "ssd")}  # 4. later calls
    later_stats = []
    methods = list(totals)
    for i, ids in enumerate(prompts):
        outs = {}
        for m in methods[i % len(methods):] + methods[: i % len(methods)]:
            with torch_threads(threads.get(m)):
                outs[m], s, stats = call(m, target, draft, ids, new)
            totals[m] += s
            if stats is not None:
                later_stats.append(stats)
        wrong = [m for m in methods if outs[m] != outs["target"]]
        assert not wrong, f"prompt {i}: {wrong} differ from the target alone"
    tokens = new * len(prompts)

    def best(times: dict) -> str:
        return min(BASELINES, key=times.get)

    print(f"{len(prompts)} stdlib prompts x {new} new tokens, greedy, {torch.get_num_threads()} torch threads "
          f"(baselines at their best: {threads}); outputs identical to the target alone")
    b = best(first_base)
    print(f"first call (prompt 0): SSD {new / first_s:.2f} tok/s, " +
          ", ".join(f"{m} {new / s:.2f}" for m, s in first_base.items()) +
          f" -> SSD / best ({b}) = {first_base[b] / first_s:.3f}x")
    print(f"  SSD's first call: {describe(first_stats)}")
    b = best(totals)
    print(f"later calls ({len(prompts)} prompts): " + ", ".join(f"{m} {tokens / s:.2f}" for m, s in totals.items()) +
          f" tok/s -> SSD / best ({b}) = {totals[b] / totals['ssd']:.3f}x")
    for stats in later_stats:
        print(f"  SSD: {describe(stats)}")


def first_calls(args) -> None:
    """--processes: every method's first call in each of N fresh processes, the order rotated per process."""
    methods = ["ssd", "target", "assisted"]
    totals, rows = dict.fromkeys(methods, 0.0), []
    at = [{m: {} for m in methods} for _ in methods]  # position -> method -> prompt -> seconds of each call
    same = [0.0, 0.0, 0]  # same-forwards processes: the target's seconds, its forwards' + SSD's outside, count
    env, memory = dict(os.environ), None
    if args.remembered:
        memory = tempfile.TemporaryDirectory(prefix="first_call_bench_")
        env.update({REMEMBERED_ENV: "1", "HF_SSD_NO_PROFILE": "0", "HF_SSD_PROFILES": f"{memory.name}/profiles"})

    def child(order: list[str], prompt: int, new: int) -> subprocess.CompletedProcess:
        cmd = [sys.executable, __file__, "--child", ",".join(order), "--prompt-index", str(prompt),
               "--prompts", str(args.prompts), "--max-new-tokens", str(new)]
        cmd += ["--tiny"] * args.tiny + ["--assisted"] * args.assisted
        return subprocess.run(cmd, capture_output=True, text=True, env=env)

    if args.remembered:
        done = child(["ssd", "target"], 0, 8)
        if done.returncode:
            sys.exit(f"the priming child failed:\n{done.stderr[-3000:]}")
        print(f"primed: {sorted(str(p.relative_to(memory.name)) for p in Path(memory.name).rglob('*.json'))}")
    for i in range(args.processes):
        order, prompt = methods[i % 3:] + methods[: i % 3], (i // 3) % args.prompts
        done = child(order, prompt, args.max_new_tokens)
        if done.returncode:
            sys.exit(f"child {i} failed:\n{done.stderr[-3000:]}")
        report = json.loads(done.stdout.strip().splitlines()[-1])
        seconds, threads, inside = report["seconds"], report["threads"], report["forwards"]
        outside = {m: seconds[m] - inside[m][0] for m in methods}
        if inside["ssd"][1] == inside["target"][1]:  # the same forward work: SSD's rounds were all AR
            same[0] += seconds["target"]
            same[1] += inside["target"][0] + outside["ssd"]
            same[2] += 1
        for m in methods:
            totals[m] += seconds[m]
        for pos, m in enumerate(order):
            at[pos][m].setdefault(prompt, []).append(seconds[m])
        best = min(("target", "assisted"), key=seconds.get)
        rows.append(seconds)
        print(f"process {i} (prompt {prompt}, order {' '.join(order)}): " +
              ", ".join(f"{m} {s:.2f}s" for m, s in seconds.items()) +
              f" -> SSD / best ({best}) = {seconds[best] / seconds['ssd']:.3f}x; target forwards: " +
              ", ".join(f"{m} {inside[m][1]} in {inside[m][0]:.2f}s" for m in methods) + "; outside them: " +
              ", ".join(f"{m} {outside[m]:.2f}s" for m in methods), flush=True)
    best = min(("target", "assisted"), key=totals.get)
    print(f"first calls over {args.processes} processes, {args.max_new_tokens} new tokens each, greedy, "
          f"{threads} torch threads; outputs identical to the target alone; hf_ssd's disk memory "
          f"{'kept (primed)' if args.remembered else 'off'}")
    print("summed seconds: " + ", ".join(f"{m} {s:.2f}" for m, s in totals.items()) +
          f" -> SSD / best ({best}) = {totals[best] / totals['ssd']:.3f}x")
    ratios = sorted(r[min(('target', 'assisted'), key=r.get)] / r["ssd"] for r in rows)
    print(f"per process SSD / best: {', '.join(f'{x:.3f}' for x in ratios)} (median {ratios[len(ratios) // 2]:.3f})")
    if same[2]:
        print(f"same-forwards ratio over the {same[2]} processes whose SSD call ran the target alone's forwards: "
              f"target alone {same[0]:.2f}s, its forwards + SSD's time outside them {same[1]:.2f}s -> "
              f"{same[0] / same[1]:.3f}x")
    # By position in the process (a process's first long generate is slower whatever the method): each method's
    # mean seconds per prompt, summed over the prompts where every method ran at that position.
    for pos, name in enumerate(("first", "second", "third")):
        shared = set.intersection(*(set(at[pos][m]) for m in methods))
        if shared:
            sums = {m: sum(sum(at[pos][m][p]) / len(at[pos][m][p]) for p in shared) for m in methods}
            best = min(("target", "assisted"), key=sums.get)
            print(f"{name} in their process (prompts {sorted(shared)}): " +
                  ", ".join(f"{m} {s:.2f}s" for m, s in sums.items()) +
                  f" -> SSD / best ({best}) = {sums[best] / sums['ssd']:.3f}x")


if __name__ == "__main__":
    main()
