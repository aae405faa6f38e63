#!/usr/bin/env python
"""Does hf_ssd's loop make the target's forwards slower? In one process, alternating call by call (the order swapped
every other pair), the target alone and `SSDConfig()` restricted to AR rounds generate from one stdlib prompt of
scripts/first_call_bench.py; hooks on the target time each of its forwards. Same tokens, same forwards: the ratio
of their decode-step seconds says whether the loop's forwards (explicit positions and mask, its own cache layers)
cost what transformers' own do. Prints numbers; not a test.

    flock /tmp/realpair.lock python scripts/ar_forward_ab.py [NEW_TOKENS=32] [PAIRS=6] [FIRST=target|ssd]

Fresh processes (one pair each, the first method alternating), as a process's first calls run:

    for i in 0 1 2 3 4 5; do first=$([ $((i % 2)) = 0 ] && echo target || echo ssd)
        flock /tmp/realpair.lock python scripts/ar_forward_ab.py 48 1 $first; done
"""
import os
import runpy
import statistics
import sys
import time
from pathlib import Path

os.environ["HF_SSD_NO_PROFILE"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

fc = runpy.run_path(str(ROOT / "scripts" / "first_call_bench.py"), run_name="fc")
import hf_ssd  # noqa: E402
from hf_ssd import SSDConfig  # noqa: E402
from hf_ssd.models.pairs import load_default_pair  # noqa: E402


def main() -> None:
    new = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    flip = int(len(sys.argv) > 3 and sys.argv[3] == "ssd")  # the first pair starts with the loop
    target, draft, tok = load_default_pair(dtype=torch.float32, device=torch.device("cpu"))
    hf_ssd.enable(target)
    for m in (target, draft):
        m.generation_config.eos_token_id = None
    ids = torch.tensor([tok(t).input_ids for t in fc["stdlib_prompts"](1)])
    times = []  # seconds of each target forward in the current call

    def pre(module, args):
        times.append(time.perf_counter())

    def post(module, args, out):
        times[-1] = time.perf_counter() - times[-1]

    target.register_forward_pre_hook(pre)
    target.register_forward_hook(post)

    def run(ssd: bool):
        kw = {"max_new_tokens": new, "do_sample": False, "attention_mask": torch.ones_like(ids)}
        if ssd:
            kw.update(assistant_model=draft, ssd_config=SSDConfig(hit_rate_warning=0.0),
                      _ssd_hooks={"options": lambda options: [o for o in options if o.kind == "ar"]})
        times.clear()
        with torch.inference_mode():
            start = time.perf_counter()
            out = target.generate(ids, **kw)
            return out, time.perf_counter() - start, list(times)

    with torch.inference_mode():  # first-use costs of both models' kernels
        for m in (target, draft):
            m.generate(ids, max_new_tokens=2, do_sample=False, attention_mask=torch.ones_like(ids))
    res, ref = {False: [], True: []}, None
    for i in range(pairs):
        for ssd in ((False, True) if (i + flip) % 2 == 0 else (True, False)):
            out, wall, ts = run(ssd)
            ref = out if ref is None else ref
            assert torch.equal(out, ref), "the loop's output differs from the target alone"
            res[ssd].append((wall, ts))
            print(f"{'ssd' if ssd else 'target':6} wall {wall:.2f} s, {len(ts)} forwards: prefill {ts[0]:.3f} s, "
                  f"decode steps {sum(ts[1:]):.2f} s (median {statistics.median(ts[1:]) * 1000:.1f} ms)", flush=True)
    decode = {}
    for ssd in (False, True):
        calls = res[ssd]
        decode[ssd] = sum(sum(ts[1:]) for _, ts in calls)
        print(f"{'ssd' if ssd else 'target':6} {len(calls)} calls: wall {sum(w for w, _ in calls):.2f} s, prefill "
              f"{sum(ts[0] for _, ts in calls):.2f} s, decode steps {decode[ssd]:.2f} s")
    print(f"decode steps, target alone / the loop's AR rounds: {decode[False] / decode[True]:.3f}x")


if __name__ == "__main__":
    main()
