"""Hit rate of the outcome predictors at equal budget, replayed on the target's own greedy outputs (prints numbers).

In greedy decoding a round's candidates are the draft's greedy continuation of the accepted context, and the
verification outcome (k accepted, bonus) follows from the target's greedy output. So once the target's output
of each prompt is known (one AR run), every round of SSD with draft length gamma can be replayed with draft
forwards alone, and each predictor asked whether the real outcome was among its `budget` pre-drafted ones:
exactly the lookup SSD makes (inline layout, nothing cut short). A third row bounds every predictor that takes
bonus tokens from the draft's ranking: it knows k and bets the whole budget on the draft's likeliest bonuses
there. All budgets and predictors see the same rounds;
the calibrated predictor learns along the way and carries over from prompt to prompt, as in a real session.

    flock /tmp/realpair.lock python scripts/predictor_eval.py --prompts 5 --max-new-tokens 64
    python scripts/predictor_eval.py --tiny          # seconds, for a smoke run
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_ssd.drafting.drafter import Drafter
from hf_ssd.speculation.fanout import geometric_fanout
from hf_ssd.speculation.outcomes import bonus_rank, predict_outcomes, rank_outcomes
from hf_ssd.speculation.predictor import AcceptanceCalibration, drafted_probs, hedged_length_probs


class AcceptanceTracker:
    """The acceptance rate this replay's geometric fan-out uses: accepted / tried, decayed towards recent rounds
    from a prior worth a few tokens (the package keeps one estimate per pair, `CostModel.acceptance`)."""

    def __init__(self, prior: float, prior_weight: float = 4.0, decay: float = 0.9):
        self.accepted, self.tried, self.decay = prior * prior_weight, prior_weight, decay

    def update(self, accepted: int, proposed: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.tried = self.decay * self.tried + min(proposed, accepted + 1)

    @property
    def rate(self) -> float:
        return self.accepted / self.tried if self.tried else 0.0


def replay(target_ids: list[int], prompt_len: int, drafter: Drafter, gamma: int, budgets: list[int],
           tracker: AcceptanceTracker, calibration: AcceptanceCalibration, counts: dict) -> None:
    seq, pos = target_ids, prompt_len
    while pos < len(seq) - 1:
        context = seq[:pos]
        n = min(gamma, len(seq) - pos - 1)  # a round needs its bonus inside the known output
        candidates = drafter.draft(context, n, [0] * n).tokens
        drafter.record(context + candidates, record_from=len(context) - 1)
        tops = drafter.candidate_tops(len(context), len(candidates))
        k = 0
        while k < len(candidates) and candidates[k] == seq[pos + k]:
            k += 1
        truth = (k, seq[pos + k])
        alpha = tracker.rate
        for b in budgets:
            geo = predict_outcomes(candidates, tops, geometric_fanout(b, alpha, len(candidates)), alpha, b)
            cal = rank_outcomes(candidates, tops, hedged_length_probs(calibration, drafted_probs(candidates, tops)), b)
            counts[("geometric", b)] += truth in {(o.accepted, o.bonus) for o in geo}
            counts[("calibrated", b)] += truth in {(o.accepted, o.bonus) for o in cal}
            # The bound for any predictor that takes bonus tokens from the draft's ranking: it knows k exactly
            # and spends the whole budget on the draft's b likeliest bonuses there.
            rank = bonus_rank(tops[k], candidates[k] if k < len(candidates) else None, truth[1])
            counts[("oracle_k", b)] += rank is not None and rank < b
        counts["rounds"] += 1
        tracker.update(k, len(candidates))
        calibration.observe(drafted_probs(candidates, tops), k)
        pos += k + 1


def main() -> None:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--datasets", default="humaneval,gsm")
    p.add_argument("--prompts", type=int, default=5, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--budgets", default="1,2,4")
    p.add_argument("--tiny", action="store_true", help="the tiny random pair instead of the real one")
    args = p.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    from hf_ssd.bench.prompts import encode_prompt, load_prompts

    if args.tiny:
        from hf_ssd.models.tiny import tiny_pair

        target, draft, tok = tiny_pair(noise=0.003)
    else:
        from hf_ssd.models.pairs import load_default_pair

        target, draft, tok = load_default_pair(progress=False)
    print(f"gamma {args.gamma}, budgets {budgets}, {args.prompts} prompts per dataset x {args.max_new_tokens} tokens")
    for spec in args.datasets.split(","):
        name, ds = load_prompts(spec, args.prompts)
        counts = {(kind, b): 0 for kind in ("geometric", "calibrated", "oracle_k") for b in budgets} | {"rounds": 0}
        tracker, calibration = AcceptanceTracker(0.7), AcceptanceCalibration()
        start = time.perf_counter()
        for row in ds:
            ids = encode_prompt(row["prompt"], row["kind"], tok)
            if args.tiny:
                ids = ids[-64:]
            with torch.inference_mode():
                out = target.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False)
                drafter = Drafter(draft, None, False, max(budgets) + 1)
                replay(out[0].tolist(), len(ids), drafter, args.gamma, budgets, tracker, calibration, counts)
        rounds = counts["rounds"]
        print(f"{name}: {len(ds)} prompts, {rounds} rounds ({time.perf_counter() - start:.0f} s)")
        for b in budgets:
            g, c = counts[("geometric", b)] / rounds, counts[("calibrated", b)] / rounds
            o = counts[("oracle_k", b)] / rounds
            print(f"  budget {b}: hit rate geometric {g:.1%}  calibrated {c:.1%}  ({100 * (c - g):+.1f} points)  "
                  f"bound with k known {o:.1%}")
        print(f"  learned P(accept | q) by q decile: {[round(x, 2) for x in calibration.curve()]}")


if __name__ == "__main__":
    main()
