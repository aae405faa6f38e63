"""`ssd_match`: an `evaluate` metric for lossless speculative decoding checks and exact-match accuracy.

Loaded locally (never from the Hub): `evaluate.load(hf_ssd.bench.METRIC_PATH)`.

Inputs are pairs of token-id sequences (greedy outputs of a method vs. the target alone) or pairs of strings
(extracted answers vs. references). Outputs:
- exact_match: share of pairs that are identical (1.0 means the method was lossless on every prompt);
- num_mismatches and mismatch_indices: which pairs differ;
- first_divergence: per pair, the first position where the two differ (-1 when identical; for strings, the
  character position), so a mismatch report can say where a method drifted off the target's output.
"""

import datasets
import evaluate

_DESCRIPTION = __doc__
_KWARGS_DESCRIPTION = """
Args:
    predictions: list of token-id lists (or of strings).
    references: list of token-id lists (or of strings), same length.
Returns:
    exact_match (float), num_mismatches (int), mismatch_indices (list[int]), first_divergence (list[int]).
Examples:
    >>> m = evaluate.load("hf_ssd/metrics/ssd_match.py")
    >>> m.compute(predictions=[[1, 2, 3], [4, 5]], references=[[1, 2, 3], [4, 6]])["exact_match"]
    0.5
"""
_CITATION = """\
@inproceedings{kumar2026ssd,
  title={Speculative Speculative Decoding},
  author={Kumar, Tanishq and Dao, Tri and May, Avner},
  booktitle={ICLR},
  year={2026}
}
"""


def first_divergence(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class SsdMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features(
                    {"predictions": datasets.Sequence(datasets.Value("int64")),
                     "references": datasets.Sequence(datasets.Value("int64"))}
                ),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
        )

    def _compute(self, predictions, references):
        firsts = [first_divergence(list(p), list(r)) for p, r in zip(predictions, references)]
        mismatches = [i for i, f in enumerate(firsts) if f != -1]
        n = len(firsts)
        return {
            "exact_match": (n - len(mismatches)) / n if n else 1.0,
            "num_mismatches": len(mismatches),
            "mismatch_indices": mismatches,
            "first_divergence": firsts,
        }
