#!/usr/bin/env python
"""CPU matrix products by row count: torch's `linear` against the transposed product of hf_ssd/drafting/matmul.py.
Prints numbers; not a test.

    python scripts/matmul_bench.py                 # one weight shape, many copies (nothing stays in cache)
    flock /tmp/realpair.lock python scripts/matmul_bench.py --real   # + the real pair's forwards by token count

--real also times one forward of the real draft and target (after a 150-token prefill) at 1..8 new tokens,
stock and with draft_matmul's product, so the effect on a whole model shows (the target is measured only to
show the kernel effect; hf_ssd never changes the target's layers).
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
    print(f"{'rows':>5} {'linear':>9} {'transposed':>11} {'ratio':>6}")
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            times = []
            for fn in (lambda m, x: F.linear(x, m.weight), matmul._transposed_forward):
                fn(layers[0], x)
                t = time.perf_counter()
                for m in layers:
                    fn(m, x)
                times.append((time.perf_counter() - t) / len(layers) * 1e3)
            print(f"{rows:>5} {times[0]:>9.2f} {times[1]:>11.2f} {times[0] / times[1]:>5.2f}x")


def model_table() -> None:
    from transformers import DynamicCache

    from hf_ssd.models.pairs import load_default_pair

    target, draft, _ = load_default_pair()
    prompt = torch.randint(100, 1000, (1, 150))
    print("real pair, seconds per forward after a 150-token prefill (best of 3), by new tokens")
    for model, name in ((draft, "draft 0.5B"), (target, "target 1.5B")):
        rows = {}
        for mode in ("stock", "transposed"):
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
            print(f"  {name:<12} {n} tokens: stock {r['stock']:.3f} s, transposed {r['transposed']:.3f} s "
                  f"({r['stock'] / r['transposed']:.2f}x)")


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
