"""Batches of prompts for `hf-ssd eval --batch-size` and `hf-ssd bench --batch-sizes`: left padding, one
`generate` call per batch, and each row's new tokens cut where that row ended.

Batches are left-padded (the prompts' token ids, already encoded, are padded on the left with the tokenizer's
pad token, the mask marking the real tokens), as transformers' batched `generate` expects for decoder-only
models. `--method ar` (the target alone) runs the target's own batched `generate`; SSD runs hf_ssd's batched
loop (hf_ssd/loop/batch.py: AR or plain SD rounds over all rows, exact per row). transformers' assisted
generation is batch-1 only.
"""

from __future__ import annotations

import time

import torch


def chunks(items: list, size: int) -> list[list]:
    """`items` in order, grouped into lists of `size` (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"batch size must be at least 1, got {size}")
    return [items[i : i + size] for i in range(0, len(items), size)]


def pad_token_id(target, tokenizer=None) -> int:
    """The token padding a batch: the tokenizer's pad token, else the target's generation config's, else EOS."""
    for source in (tokenizer, target.generation_config):
        pad = getattr(source, "pad_token_id", None) if source is not None else None
        if pad is not None:
            return int(pad)
    eos = eos_ids(target)
    return min(eos) if eos else 0


def eos_ids(target) -> set[int]:
    eos = target.generation_config.eos_token_id
    if eos is None:
        return set()
    return set(eos if isinstance(eos, (list, tuple)) else [eos])


def left_pad(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, L], attention_mask [B, L]): each prompt right-aligned, padded with `pad` on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def row_tokens(out: torch.Tensor, width: int, eos: set[int]) -> list[list[int]]:
    """Each row's new tokens: what follows the padded prompt, up to and including the row's first EOS (a row
    that stopped there is padded after it; a row without EOS ran to max_new_tokens, the output's width)."""
    rows = []
    for row in out[:, width:].tolist():
        end = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def generate_batch(target, prompts: list[list[int]], pad: int, **kwargs) -> tuple[list[list[int]], float]:
    """One `target.generate` call over the left-padded `prompts` (kwargs as for generate: max_new_tokens,
    do_sample, assistant_model, ssd_config, ...): (each row's new tokens, wall seconds of the call)."""
    input_ids, mask = left_pad(prompts, pad, target.device)
    cuda = target.device.type == "cuda"
    with torch.inference_mode():
        if cuda:
            torch.cuda.synchronize(target.device)
        start = time.perf_counter()
        out = target.generate(input_ids, attention_mask=mask, pad_token_id=pad, **kwargs)
        if cuda:
            torch.cuda.synchronize(target.device)
        seconds = time.perf_counter() - start
    return row_tokens(out, input_ids.shape[1], eos_ids(target)), seconds


def greedy_matches(draft, prompt: list[int], tokens: list[int]) -> list[bool]:
    """Per new token of a greedy target row: would the draft's greedy choice, given the row's tokens before it,
    have been that token (one draft forward over prompt + tokens, no cache)."""
    if not tokens:
        return []
    ids = torch.tensor([prompt + tokens], dtype=torch.long, device=draft.device)
    with torch.inference_mode():
        top = draft(input_ids=ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    return [a == b for a, b in zip(top, tokens)]


def ssd_ceiling(batches: list[list[list[bool]]], gamma: int, target_s: float, draft_s: float) -> float:
    """SSD's best case over a dataset of batches (each a list of rows' `greedy_matches`) against the target's own
    batched decoding, on a device where a forward costs the same whatever its rows.

    Every row hits the speculation cache every round, so a round costs one verify, or `gamma` draft steps where
    those take longer (they run during the verify before). A round of a row whose draft agrees with the target
    on the next L tokens yields min(L, gamma) + 1 tokens; a batch takes as many rounds as its slowest row, the
    target's batched decoding as many steps as its longest row. Returns the target's time over the ceiling's
    (prefill left out: both pay it)."""
    if gamma < 1:
        raise ValueError(f"gamma must be at least 1, got {gamma}")
    steps = rounds = 0
    for rows in batches:
        steps += max((len(m) for m in rows), default=0)
        rounds += max((_ceiling_rounds(m, gamma) for m in rows), default=0)
    if steps == 0:
        return 1.0
    return steps * target_s / (rounds * max(target_s, gamma * draft_s))


def _ceiling_rounds(matches: list[bool], gamma: int) -> int:
    run = [0] * (len(matches) + 1)  # run[j]: how many tokens from j on the draft agrees with
    for j in range(len(matches) - 1, -1, -1):
        run[j] = run[j + 1] + 1 if matches[j] else 0
    j = n = 0
    while j < len(matches):
        j += min(run[j], gamma) + 1
        n += 1
    return n
