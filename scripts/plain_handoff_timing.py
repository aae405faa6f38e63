#!/usr/bin/env python
"""What hf_ssd's plain batched decoding costs over the target's own batched `generate`, in one process.

Where drafting cannot pay at a batch size (this CPU at B >= 8), SSDConfig() hands the whole call to
transformers' own `_sample` (hf_ssd/loop/plain.py), entered through `custom_generate`. This script times
three ways to run the same batch, interleaved (T S C C S T, repeated) so that the machine's drift weighs on
all three alike:

- T: `target.generate(...)`, the target alone;
- S: `target.generate(..., assistant_model=draft, ssd_config=SSDConfig())` with the plain verdict forced;
- C: `target.generate(..., custom_generate=f)` where f only calls `_sample` (transformers' path alone).

Each call's decode steps are timed by a stopping criterion (hf_ssd's `StepClock`, the same in all three).
Prints per-call wall time, median step, and the means. Every output must equal T's first.

    flock /tmp/realpair.lock python scripts/plain_handoff_timing.py               # real pair, 8 HumanEval prompts
    python scripts/plain_handoff_timing.py --tiny --cycles 1 --max-new-tokens 8   # smoke check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers.generation.stopping_criteria import StoppingCriteriaList  # noqa: E402

import hf_ssd  # noqa: E402
import hf_ssd.loop.plain as plain  # noqa: E402
from hf_ssd import SSDConfig  # noqa: E402
from hf_ssd.bench.batched import left_pad, pad_token_id  # noqa: E402
from hf_ssd.bench.prompts import encode_prompt, load_prompts  # noqa: E402
from hf_ssd.loop import batch as loop  # noqa: E402


class Clock(plain.StepClock):
    last = None

    def __init__(self):
        super().__init__()
        Clock.last = self


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny random pair (smoke check; speeds mean nothing)")
    p.add_argument("--batch-size", type=int, default=8, help="HumanEval prompts in the batch")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--cycles", type=int, default=3, help="repeats of the order T S C C S T")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.tiny:
        from hf_ssd.models.tiny import tiny_pair

        target, draft, tok = tiny_pair()
    else:
        from hf_ssd.models.pairs import load_default_pair

        target, draft, tok = load_default_pair(dtype=torch.float32, device=torch.device("cpu"))
    hf_ssd.enable(target)
    _, ds = load_prompts("humaneval", args.batch_size)
    pad = pad_token_id(target, tok)
    ids, mask = left_pad([encode_prompt(r["prompt"], r["kind"], tok) for r in ds], pad, target.device)
    plain.StepClock = Clock  # S's own clock, read back after its call
    loop.BatchPlan.plain = lambda self, rows, new_tokens: True  # S: the plain verdict, forced

    def only_sample(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                    streamer=None, **model_kwargs):
        criteria = StoppingCriteriaList([*stopping_criteria, Clock()])
        return type(model)._sample(model, input_ids, logits_processor, criteria, generation_config, synced_gpus,
                                   streamer, **model_kwargs)

    def run(method: str):
        kw = dict(attention_mask=mask, pad_token_id=pad, max_new_tokens=args.max_new_tokens, do_sample=False)
        with torch.inference_mode():
            start = time.perf_counter()
            if method == "T":
                out = target.generate(ids, stopping_criteria=StoppingCriteriaList([Clock()]), **kw)
            elif method == "C":
                out = type(target).generate(target, ids, custom_generate=only_sample, **kw)
            else:
                out = target.generate(ids, assistant_model=draft, ssd_config=SSDConfig(hit_rate_warning=0.0), **kw)
            return out, time.perf_counter() - start, Clock.last.steps

    for m in "TSC":  # warm-up: first-use costs of the kernels, the draft probe
        run(m)
    walls, steps, reference = {m: [] for m in "TSC"}, {m: [] for m in "TSC"}, None
    for m in "TSCCST" * args.cycles:
        out, wall, s = run(m)
        reference = out if reference is None else reference
        if not torch.equal(out, reference):
            raise SystemExit(f"{m}'s output differs from the target's: a bug")
        walls[m].append(wall)
        steps[m] += s
        print(f"  {m}: wall {wall:6.2f} s, median step {statistics.median(s):.4f} s ({len(s)} steps)", flush=True)
    n = len(walls["T"])
    print(f"B = {args.batch_size}, {args.max_new_tokens} new tokens, {n} calls each, outputs identical")
    for m, name in (("T", "target alone"), ("S", "SSDConfig(), plain"), ("C", "custom_generate + _sample")):
        print(f"  {name:<26} mean wall {statistics.mean(walls[m]):6.2f} s, median step {statistics.median(steps[m]):.4f} s")
    print(f"  wall T / S = {statistics.mean(walls['T']) / statistics.mean(walls['S']):.3f}x (SSD's throughput "
          f"over the target's), T / C = {statistics.mean(walls['T']) / statistics.mean(walls['C']):.3f}x")


if __name__ == "__main__":
    main()
