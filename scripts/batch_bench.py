#!/usr/bin/env python
"""Batched throughput: the target's own batched `generate` against the default `SSDConfig()` (hf_ssd's batched
loop, hf_ssd/loop/batch.py) at B in {1, 2, 4, 8, 16}, and the two methods' peak memory at the largest B.
Prints numbers; not a test.

    python scripts/batch_bench.py                   # the real pair (Qwen2.5-Coder 1.5B / 0.5B Instruct)
    python scripts/batch_bench.py --sim             # the tiny pair on a SIMULATED device (see below)
    python scripts/batch_bench.py --tiny --prompts 4 --max-new-tokens 16 --batch-sizes 1,2,4   # smoke check
    python scripts/batch_bench.py --sim --batch-sizes 8 --no-memory --options 'ssd(b=16,g=4)'   # one fixed option
    python scripts/batch_bench.py --sim --batch-sizes 1 --no-memory --assisted     # one prompt, the one-prompt path

Prompts: --prompts (16) of HumanEval and GSM (hf_ssd.bench.prompts; half each, HumanEval first), greedy,
--max-new-tokens (64) each, --threads torch threads (2; 1 with --tiny/--sim). At each B the prompts, in the same order, are grouped
into batches of B (left-padded); each method is warmed up --warmup-calls (2) times at each B on the first batch
(SSD keeps its cost estimates across calls, so the timed calls start informed, as any later call in a program
does: at a new batch size its first call decodes plainly and measures that, its second runs the loop and measures
its speedup; later calls choose).
The timed calls alternate between the methods batch by batch, in the order A B, B A, A B, ... (a noisy machine's
drift, and whatever one call leaves the next, weigh on both alike).
Throughput is the dataset's: all rows' new tokens / all calls' wall time. Every SSD row is compared with the
same row of the target's batched generate (greedy: they must be identical).

--sim: target and draft of the tiny pair wrapped by hf_ssd.models.simulated.simulate_device with
DeviceCost(base_s=--target-ms / --draft-ms, per_row_s=0): every forward takes that long whatever its rows
(an idle accelerator: a batched forward costs about one row). The tuning profile is not read (the simulated
costs are not the tiny pair's). The simulation holds only while the tiny pair's real forwards are shorter than
the simulated times: the report counts the forwards that overran them (a busy machine), and warns. To keep it
so, --sim sets TRANSFORMERS_SDPA_FORCE_GQA=1 (attention over the draft's grouped key/value heads without copying
them per branch; see `load`).

Memory (at --memory-batch, default the largest B; --no-memory skips it): each method runs in its own fresh
process (this script with --memory-child): the target's batched generate, SSDConfig() as it chooses (in a fresh
process its first call at a batch size decodes plainly) and SSDConfig() with its loop forced (never plain batched
decoding): both models loaded and read once (a 1-token target call, a draft forward: weights mapped lazily from
disk are resident only once read, so a process that never ran the draft would not count its weights), then the
RSS high-water mark is
reset (Linux /proc/self/clear_refs) and the method runs over all batches; reported: the peak RSS minus the RSS
before (torch's CPU allocator keeps no peak statistics; RSS is what the process held), and on CUDA
torch.cuda.max_memory_allocated. Without a resettable high-water mark the delta of the process's max RSS
(getrusage) is reported instead, which counts only what exceeded the peak of loading.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hf_ssd  # noqa: E402
from hf_ssd import SSDConfig  # noqa: E402
from hf_ssd.bench.batched import chunks, generate_batch, greedy_matches, pad_token_id, ssd_ceiling  # noqa: E402
from hf_ssd.bench.prompts import encode_prompt, load_prompts  # noqa: E402

METHODS = ("target_batched", "ssd")
# Memory also of the loop itself: in a fresh process SSD's first call at a batch size decodes plainly (measuring).
MEMORY_METHODS = METHODS + ("ssd_loop",)
OVERRUNS: dict[str, list[int]] = {}  # --sim: model -> [forwards, forwards longer than the simulated time]
LABELS = {"target_batched": "target's own batched generate", "ssd": "SSDConfig() (as chosen)",
          "ssd_loop": "SSDConfig(), the loop forced"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--tiny", action="store_true", help="the tiny random pair (smoke check; its speeds mean nothing)")
    which.add_argument("--sim", action="store_true", help="the tiny pair on a simulated device (see the docstring)")
    p.add_argument("--prompts", type=int, default=16, help="prompts in all, half HumanEval, half GSM")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,2,4,8,16", help="comma-separated")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default 2 for the real pair, 1 for --tiny/--sim: the tiny pair's real "
                        "compute must stay far below the simulated times, and on a busy machine a second thread "
                        "only waits at every barrier)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="new tokens of each method's warm-up calls at each B")
    p.add_argument("--warmup-calls", type=int, default=2,
                   help="warm-up calls of each method at each B (SSD's first two calls at a new batch size measure "
                        "plain batched decoding, then its loop, to choose between them)")
    p.add_argument("--noise", type=float, default=0.01,
                   help="--tiny/--sim: the draft's weight noise (smaller: a closer draft, higher acceptance)")
    p.add_argument("--target-ms", type=float, default=40.0, help="--sim: milliseconds per target forward")
    p.add_argument("--draft-ms", type=float, default=10.0, help="--sim: milliseconds per draft forward")
    p.add_argument("--device", default="cpu", help="cpu or cuda (real pair)")
    p.add_argument("--dtype", default="auto",
                   help="auto: the real pair float32 on CPU, bfloat16 on CUDA; --sim float32; --tiny float64 (as the "
                        "tests build it); or float32, float64, ...")
    p.add_argument("--memory-batch", type=int, default=None, help="B of the memory measurement (default: the largest)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    p.add_argument("--memory-only", action="store_true", help="only the memory measurement (no throughput)")
    p.add_argument("--no-profile", action="store_true", help="do not read the pair's tuning profile")
    p.add_argument("--options", metavar="NAMES",
                   help="SSD restricted to these options, ';'-separated as the report names them (e.g. "
                        "'ssd(b=16,g=4);sd(g=3)'), with its loop forced (never plain batched decoding): fixed-option "
                        "runs to set beside the scheduler's choice (batch sizes > 1: the batch loop's options)")
    p.add_argument("--assisted", action="store_true",
                   help="B = 1 runs the one-prompt path (the candidate generator in transformers' assisted loop) "
                        "instead of hf_ssd's loop, which every batch size runs by default")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    p.add_argument("--memory-child", choices=MEMORY_METHODS, help=argparse.SUPPRESS)  # internal: one memory measurement
    args = p.parse_args(argv)
    args.batch_sizes = sorted({int(x) for x in args.batch_sizes.split(",") if x.strip()})
    if args.threads is None:
        args.threads = 1 if args.tiny or args.sim else 2
    if not args.batch_sizes or args.batch_sizes[0] < 1:
        p.error(f"--batch-sizes must be at least 1, got {args.batch_sizes}")
    if args.options is not None:
        args.options = [x.strip() for x in args.options.split(";") if x.strip()]
        known = batch_option_names()
        unknown = [x for x in args.options if x not in known]
        if unknown or not args.options:
            p.error(f"--options: unknown option(s) {unknown or args.options}; the batch loop's options are "
                    f"{', '.join(sorted(known))}")
    return args


def batch_option_names() -> set[str]:
    """Names of the options the batch loop may choose with SSDConfig() (any batch size)."""
    from hf_ssd.loop.batch import batch_options

    config = SSDConfig()
    options, _ = batch_options(config, config.resolved_budget(False)[0], {})
    return {o.name for o in options}


def ssd_hooks(args, method: str) -> dict | None:
    """`_ssd_hooks` of an SSD call: the loop forced for "ssd_loop" and with --options (then restricted to them)."""
    hooks = {}
    if method == "ssd_loop" or args.options:
        hooks["plain"] = False  # never plain batched decoding
    if args.options:
        hooks["options"] = lambda options: [o for o in options if o.name in args.options]
    if args.assisted:
        hooks["loop"] = "assisted"  # B = 1 through the one-prompt path
    return hooks or None


# ----------------------------------------------------------------------------------------------- setup


def load(args):
    """(target, draft, tokenizer, description)."""
    if args.tiny or args.sim:
        from hf_ssd.models.tiny import tiny_pair

        target, draft, tok = tiny_pair(noise=args.noise)
        if args.sim or args.dtype != "auto":
            # --sim: float32, so that the real compute of a job's wide steps stays under the simulated draft time
            # (float64 ran over it at 128 branches of ~200 tokens on these cores: 16 ms a step, 12 ms a copy of
            # the rows), which the simulation of an idle accelerator requires.
            dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
            target, draft = target.to(dtype), draft.to(dtype)
        desc = f"{target.config._name_or_path} / {draft.config._name_or_path} (weight noise {args.noise})"
        if args.sim:
            from hf_ssd.models.simulated import DeviceCost, simulate_device

            # A job's first step feeds some copies two or more tokens (rows the draft lags). For such blocks
            # transformers' SDPA repeats the draft's grouped key/value heads for every copy: 25-30 ms of real compute
            # at 128 copies on these cores, past the 10-ms simulated step, so that a row that missed kept missing
            # (a job with one step left its late branches empty) and one call in three ran 42-44 rounds where
            # others ran 37. Attending over the grouped heads directly (this switch) takes 6-8 ms: the simulation
            # stays one of the device it models.
            os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
            simulate_device(target, DeviceCost(base_s=args.target_ms / 1000, per_row_s=0.0))
            simulate_device(draft, DeviceCost(base_s=args.draft_ms / 1000, per_row_s=0.0))
            watch_overruns(target, "target", args.target_ms / 1000)
            watch_overruns(draft, "draft", args.draft_ms / 1000)
            desc += (f" on a SIMULATED device (target {args.target_ms:g} ms, draft {args.draft_ms:g} ms per forward, "
                     "any number of rows)")
        else:
            desc += " (random tiny pair: a smoke check, speeds mean nothing)"
    else:
        from hf_ssd.models.pairs import load_default_pair

        device = torch.device(args.device)
        dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if args.dtype == "auto" else \
            getattr(torch, args.dtype)
        target, draft, tok = load_default_pair(dtype=dtype, device=device)
        desc = f"{target.config._name_or_path} / {draft.config._name_or_path} (default pair)"
    hf_ssd.enable(target)
    dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
    n = torch.get_num_threads()
    return target, draft, tok, f"{desc} · {target.device} {dtype} · {n} torch thread{'s' if n != 1 else ''}"


def watch_overruns(model, name: str, seconds: float) -> None:
    """Count the simulated forwards that took longer than their simulated time (the real compute ran over it)."""
    inner = model.forward
    counts = OVERRUNS.setdefault(name, [0, 0])

    @functools.wraps(inner)  # keeps the signature, which transformers inspects
    def forward(*a, **k):
        start = time.perf_counter()
        out = inner(*a, **k)
        counts[0] += 1
        counts[1] += time.perf_counter() - start > 1.1 * seconds + 0.002
        return out

    model.forward = forward


def prompts(args, tok) -> tuple[list[list[int]], str]:
    n_code = args.prompts - args.prompts // 2
    out = []
    for spec, n in (("humaneval", n_code), ("gsm", args.prompts // 2)):
        if n:
            _, ds = load_prompts(spec, n)
            for row in ds:
                ids = encode_prompt(row["prompt"], row["kind"], tok)
                out.append(ids[-128:] if args.tiny or args.sim else ids)
    lengths = sorted(len(p) for p in out)
    return out, (f"{n_code} HumanEval + {args.prompts // 2} GSM prompts ({lengths[0]}-{lengths[-1]} tokens), "
                 f"{args.max_new_tokens} new tokens each, greedy")


def call(method: str, target, draft, group, pad, new: int, hooks: dict | None = None):
    kwargs = {"max_new_tokens": new, "do_sample": False}
    if method in ("ssd", "ssd_loop"):
        kwargs.update(assistant_model=draft, ssd_config=SSDConfig(hit_rate_warning=0.0))
        if hooks:
            kwargs["_ssd_hooks"] = hooks
    tokens, seconds = generate_batch(target, group, pad, **kwargs)
    return tokens, seconds, hf_ssd.last_stats(target) if method != "target_batched" else None


# ----------------------------------------------------------------------------------------------- throughput


def measure(args, target, draft, tok, encoded, plain_draft=None) -> list[dict]:
    """Throughput at each B; with `plain_draft` (--sim: the draft without its simulated device) also SSD's
    ceiling at each B (hf_ssd.bench.batched.ssd_ceiling, at its best gamma of 1..8)."""
    pad = pad_token_id(target, tok)
    results = []
    for b in args.batch_sizes:
        groups = chunks(encoded, b)
        row = {"batch_size": b, "calls": len(groups), "rows": [len(g) for g in groups]}
        for method in METHODS:
            for _ in range(args.warmup_calls):  # warm-up at this B
                call(method, target, draft, groups[0], pad, args.warmup_tokens, ssd_hooks(args, method))
        acc = {m: {"tokens": [], "seconds": 0.0, "options": {}, "proposed": 0, "accepted": 0} for m in METHODS}
        for i, g in enumerate(groups):  # the methods alternate, A B B A ...: drift and order weigh on both alike
            for method in (METHODS if i % 2 == 0 else METHODS[::-1]):
                out, s, stats = call(method, target, draft, g, pad, args.max_new_tokens, ssd_hooks(args, method))
                a = acc[method]
                a["tokens"] += out
                a["seconds"] += s
                if stats is not None:
                    a["proposed"] += stats.proposed_tokens
                    a["accepted"] += stats.accepted_tokens
                    for name, o in stats.options.items():
                        e = a["options"].setdefault(name, {"rounds": 0, "seconds": 0.0})
                        e["rounds"] += o["rounds"]
                        e["seconds"] += o["seconds"]
        for method in METHODS:
            a = acc[method]
            new = sum(len(t) for t in a["tokens"])
            row[method] = {"new_tokens": new, "seconds": a["seconds"], "tokens_per_second": new / a["seconds"]}
            if method == "ssd":
                total = sum(o["seconds"] for o in a["options"].values()) or 1.0
                row[method]["options"] = a["options"]
                row[method]["option_shares"] = sorted(((n, o["rounds"], o["seconds"] / total)
                                                       for n, o in a["options"].items()), key=lambda x: -x[2])
                row[method]["acceptance"] = a["accepted"] / a["proposed"] if a["proposed"] else None
        row["ratio"] = row["ssd"]["tokens_per_second"] / row["target_batched"]["tokens_per_second"]
        if plain_draft is not None:
            matches = chunks([greedy_matches(plain_draft, p, t) for p, t in zip(encoded, acc["target_batched"]["tokens"])], b)
            best = max(range(1, 9), key=lambda g: ssd_ceiling(matches, g, args.target_ms, args.draft_ms))
            agree = [x for rows in matches for m in rows for x in m]
            row["ceiling"] = {"gamma": best, "ratio": ssd_ceiling(matches, best, args.target_ms, args.draft_ms),
                              "draft_agrees": sum(agree) / max(1, len(agree))}
        row["mismatched_rows"] = [i for i, (x, y) in enumerate(zip(acc["ssd"]["tokens"], acc["target_batched"]["tokens"]))
                                  if x != y]
        results.append(row)
        print(f"  B={b}: target batched {row['target_batched']['tokens_per_second']:.2f} tok/s, SSD "
              f"{row['ssd']['tokens_per_second']:.2f} tok/s ({row['ratio']:.2f}x"
              + (f"; ceiling {row['ceiling']['ratio']:.2f}x" if "ceiling" in row else "") + ")", flush=True)
    return results


# ----------------------------------------------------------------------------------------------- memory


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        return False
    return True


def memory_child(args) -> dict:
    """One method at --memory-batch in this fresh process: the peak memory over its timed batches."""
    target, draft, tok, _ = load(args)
    encoded, _ = prompts(args, tok)
    b = args.memory_batch or max(args.batch_sizes)
    pad = pad_token_id(target, tok)
    generate_batch(target, encoded[:1], pad, max_new_tokens=1, do_sample=False)  # weights touched, allocator warm
    with torch.inference_mode():  # the draft's too: weights loaded lazily are resident only once read
        draft(input_ids=torch.tensor([encoded[0][:8]], device=draft.device))
    gc.collect()
    cuda = target.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(target.device)
        cuda_before = torch.cuda.memory_allocated(target.device)
    rss_before = _status_kib("VmRSS")
    reset = _reset_hwm() and _status_kib("VmHWM") is not None
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    new = 0
    for g in chunks(encoded, b):
        hooks = ssd_hooks(args, args.memory_child)
        out, _, _ = call(args.memory_child, target, draft, g, pad, args.max_new_tokens, hooks)
        new += sum(len(t) for t in out)
    seconds = time.perf_counter() - start
    result = {"method": args.memory_child, "batch_size": b, "prompts": len(encoded), "tokens_per_second": new / seconds,
              "hwm_reset": reset, "rss_before_mib": (rss_before or 0) / 1024}
    if reset:
        result["peak_rss_mib"] = _status_kib("VmHWM") / 1024
        result["peak_delta_mib"] = result["peak_rss_mib"] - result["rss_before_mib"]
    else:
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result["peak_rss_mib"] = maxrss / 1024
        result["peak_delta_mib"] = (maxrss - maxrss_before) / 1024
    if cuda:
        result["cuda_peak_delta_mib"] = (torch.cuda.max_memory_allocated(target.device) - cuda_before) / 2**20
    return result


def measure_memory(args) -> list[dict]:
    out = []
    for method in MEMORY_METHODS:
        argv = [sys.executable, str(Path(__file__).resolve()), "--memory-child", method,
                "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens),
                "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--threads", str(args.threads),
                "--target-ms", str(args.target_ms), "--draft-ms", str(args.draft_ms), "--device", args.device,
                "--dtype", args.dtype]
        argv += [flag for flag, on in (("--tiny", args.tiny), ("--sim", args.sim), ("--no-profile", args.no_profile))
                 if on]
        if args.memory_batch:
            argv += ["--memory-batch", str(args.memory_batch)]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        run = subprocess.run(argv, capture_output=True, text=True, env=env)
        line = next((x for x in run.stdout.splitlines() if x.startswith("MEMORY_JSON ")), None)
        if run.returncode != 0 or line is None:
            raise SystemExit(f"memory measurement of {method} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
        out.append(json.loads(line.removeprefix("MEMORY_JSON ")))
        print(f"  memory {method}: peak +{out[-1]['peak_delta_mib']:.1f} MiB", flush=True)
    return out


# ----------------------------------------------------------------------------------------------- report


def shares_text(shares, top: int = 3) -> str:
    return ", ".join(f"{n} {r} ({s:.0%})" for n, r, s in shares[:top]) or "—"


def render(command: str, pair: str, setting: str, rows: list[dict], memory: list[dict] | None) -> str:
    lines = [f"command: {command}", f"pair: {pair}", f"prompts: {setting}"]
    if OVERRUNS:
        over = ", ".join(f"{name} {o} of {n}" for name, (n, o) in OVERRUNS.items())
        lines.append(f"simulated forwards that ran over their simulated time: {over}")
        if any(o > 0.05 * n for n, o in OVERRUNS.values()):
            lines.append("WARNING: more than 5% of a model's forwards overran: the real compute (a busy machine) "
                         "shows in these numbers; rerun on an idle machine or raise --target-ms/--draft-ms")
    ceiling = any("ceiling" in r for r in rows)
    if ceiling:
        lines += ["SSD ceiling: every row a cache hit every round and drafting free within the verify (a round costs "
                  "max(target forward, gamma draft forwards)); a row gains its draft's agreeing run + 1 tokens a round "
                  "and a batch takes its slowest row's rounds (hf_ssd.bench.batched.ssd_ceiling)."]
    lines += [] if not rows else ["",
             "Dataset throughput: all rows' new tokens / all calls' wall time.", "",
             "| B | calls × rows | target batched tok/s | SSD tok/s | SSD / target | SSD acceptance "
             "| SSD options (rounds, share of round time) | SSD rows ≠ target batched |"
             + (" SSD ceiling / target (gamma; draft agrees) |" if ceiling else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if ceiling else "")]
    for r in rows:
        ssd, t = r["ssd"], r["target_batched"]
        acc = "—" if ssd["acceptance"] is None else f"{ssd['acceptance']:.1%}"
        shape = f"{r['calls']} × {'/'.join(map(str, sorted(set(r['rows']), reverse=True)))}"
        bad = len(r["mismatched_rows"])
        lines.append(f"| {r['batch_size']} | {shape} | {t['tokens_per_second']:.2f} | {ssd['tokens_per_second']:.2f} | "
                     f"{r['ratio']:.2f}× | {acc} | {shares_text(ssd['option_shares'])} | "
                     f"{'**' + str(bad) + ' MISMATCH**' if bad else '0'} |"
                     + (f" {r['ceiling']['ratio']:.2f}× (g={r['ceiling']['gamma']}; {r['ceiling']['draft_agrees']:.0%}) |"
                        if "ceiling" in r else ""))
    if memory:
        b = memory[0]["batch_size"]
        rows_per_call = min(b, memory[0]["prompts"])
        how = ("peak RSS over the timed calls minus RSS before them (high-water mark reset)"
               if all(m["hwm_reset"] for m in memory) else
               "max-RSS growth (getrusage; no resettable high-water mark here: only what exceeded the load's peak)")
        cuda = any("cuda_peak_delta_mib" in m for m in memory)
        at = f"B={b}" + (f" ({rows_per_call} rows: all the prompts)" if rows_per_call < b else "")
        lines += ["", f"Peak memory at {at}, each method in its own process: {how}.", "",
                  "| method | RSS before (MiB) | peak RSS (MiB) | peak / target's | peak − before (MiB) |"
                  + (" CUDA peak − before (MiB) |" if cuda else "") + " tok/s |",
                  "|---|---|---|---|---|" + ("---|" if cuda else "") + "---|"]
        base = next((m["peak_rss_mib"] for m in memory if m["method"] == "target_batched"), None)
        for m in memory:
            ratio = f"{m['peak_rss_mib'] / base:.2f}×" if base else "—"
            lines.append(f"| {LABELS[m['method']]} | {m['rss_before_mib']:.1f} | {m['peak_rss_mib']:.1f} | {ratio} | "
                         f"{m['peak_delta_mib']:.1f} |"
                         + (f" {m.get('cuda_peak_delta_mib', 0):.1f} |" if cuda else "")
                         + f" {m['tokens_per_second']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    ignore = hf_ssd.scheduling.profile.ignored() if (args.no_profile or args.sim) else contextlib.nullcontext()
    with ignore:
        if args.memory_child:
            print("MEMORY_JSON " + json.dumps(memory_child(args)), flush=True)
            return 0
        command = shlex.join(["python", "scripts/batch_bench.py", *(sys.argv[1:] if argv is None else argv)])
        print(f"command: {command}", flush=True)
        target, draft, tok, pair = load(args)
        encoded, setting = prompts(args, tok)
        plain_draft = None
        if args.sim:  # the draft's own greedy choices, for SSD's ceiling (not through the simulated device)
            from hf_ssd.models.tiny import tiny_pair

            plain_draft = tiny_pair(noise=args.noise)[1].to(next(draft.parameters()).dtype)
        rows = [] if args.memory_only else measure(args, target, draft, tok, encoded, plain_draft)
        del target, draft
        gc.collect()
        memory = None if args.no_memory else measure_memory(args)
    if rows:
        setting += f"; each method warmed up with {args.warmup_calls} calls of {args.warmup_tokens} tokens at each B"
        if args.options:
            setting += f"; SSD restricted to {' or '.join(args.options)}, its loop forced (--options)"
    report = render(command, pair, setting, rows, memory)
    print()
    print(report)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "pair": pair, "setting": setting, "rows": rows,
                                               "memory": memory}, indent=2), encoding="utf-8")
    return 3 if any(r["mismatched_rows"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
