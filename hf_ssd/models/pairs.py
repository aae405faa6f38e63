"""The default target/draft pair (Qwen2.5-Coder 1.5B / 0.5B Instruct), ready to use offline.

The official GGUF files come from :mod:`hf_ssd.models.fetch` (verified). Dequantizing a GGUF takes a while, so
each model is converted once to a dense float32 safetensors copy under ``<cache>/dense/<gguf stem>/`` and
loaded from there afterwards, in seconds. The tokenizer (identical for both models, checked at conversion)
is saved once, next to the target. Only safetensors are written or read: no pickles, no remote code.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from .fetch import Downloader, cache_root, delete_leftover_wheels, ensure_gguf, load_default_spec

__all__ = [
    "DEFAULT_NAMES",
    "ModelNotAvailableError",
    "dense_dir",
    "is_dense_ready",
    "convert_gguf_to_dense",
    "prepare_default_pair",
    "load_default_pair",
    "resolve_model",
    "resolve_tokenizer",
]

logger = logging.getLogger(__name__)

DEFAULT_NAMES = (None, "default")
MARKER = "hf_ssd_dense.json"  # written last: a dense dir without it is never used
MARKER_VERSION = 1


class ModelNotAvailableError(OSError):
    """A model given by hub id or path could not be loaded (typically: no network and not cached)."""


def _say(msg: str, progress: bool) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)
    logger.info(msg)


# ---------------------------------------------------------------------------------------------- dense cache


def dense_dir(spec: dict, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the dense copy of the GGUF described by ``spec`` lives."""
    return cache_root(cache_dir) / "dense" / Path(spec["file"]).stem


def is_dense_ready(path: Path, spec: dict) -> bool:
    """True if ``path`` holds a finished conversion of exactly this GGUF (by sha256)."""
    try:
        marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("version") == MARKER_VERSION and marker.get("source_sha256") == spec["sha256"]


def _load_gguf_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)


def _tokenizer_fingerprint(tok) -> tuple:
    """Everything that decides how text maps to ids and back.

    The chat template is left out on purpose: the two official GGUF files differ in one escape of the
    tool-call instructions, which does not change any token id; the target's template is the one saved.
    """
    backend = getattr(tok, "backend_tokenizer", None)
    return (
        backend.to_str() if backend is not None else sorted(tok.get_vocab().items()),
        tuple(tok.all_special_tokens),
    )


def _check_same_tokenizer(target_tok, draft_tok) -> None:
    if _tokenizer_fingerprint(target_tok) != _tokenizer_fingerprint(draft_tok):
        raise RuntimeError(
            "the target and draft GGUF files carry different tokenizers; speculative decoding needs identical "
            f"ones (target: {len(target_tok)} tokens, draft: {len(draft_tok)} tokens)."
        )


def _remove_stale_tmp(parent: Path, name: str) -> None:
    """Remove temp dirs left by conversions whose process is gone (killed mid-way)."""
    for tmp in parent.glob(f".{name}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit("-", 1)[1])
            os.kill(pid, 0)  # still running: leave it alone
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError):
            continue


def convert_gguf_to_dense(gguf: Path, out_dir: Path, spec: dict, tokenizer=None) -> Path:
    """Dequantize ``gguf`` to float32 and save it (safetensors) as ``out_dir``, atomically.

    Writes into a temp dir beside ``out_dir`` and renames it into place only when complete, so an
    interrupted conversion never leaves a half copy. ``tokenizer``, if given, is saved alongside.
    """
    from transformers import AutoModelForCausalLM, GgufConfig

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(out_dir.parent, out_dir.name)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
            local_files_only=True,
        )
        # Some transformers versions (5.23) keep the GGUF quantizer on a dequantized model and then refuse
        # to save it as "not serializable"; the weights are dense, so drop the quantization bookkeeping.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        del model
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if any(tmp.glob("*.bin")) or not any(tmp.glob("*.safetensors")):
            raise RuntimeError(
                f"conversion of {gguf.name} did not produce safetensors only: {sorted(os.listdir(tmp))}"
            )
        marker = {
            "version": MARKER_VERSION,
            "source_file": spec["file"],
            "source_sha256": spec["sha256"],
            "hub_id": spec.get("hub_id"),
            "dtype": "float32",
            "has_tokenizer": tokenizer is not None,
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        if out_dir.exists():
            shutil.rmtree(out_dir)  # an outdated or unfinished copy of ours
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def prepare_default_pair(
    cache_dir: str | os.PathLike | None = None, progress: bool = True, downloader: Downloader | None = None
) -> dict[str, Path]:
    """Make sure the dense copies of the default pair exist; return their dirs keyed by role.

    Does nothing (no network, no hashing) when both are ready; otherwise fetches and verifies the GGUF files
    and converts whatever is missing. The tokenizer is saved with the target.
    """
    spec = load_default_spec()
    models = spec["models"]
    dirs = {role: dense_dir(m, cache_dir) for role, m in models.items()}
    todo = [role for role in ("target", "draft") if not is_dense_ready(dirs[role], models[role])]
    if not todo:
        delete_leftover_wheels(cache_dir)  # a cache made by an older hf_ssd kept ~1.5 GB of them
        return dirs
    ggufs = {role: ensure_gguf(role, cache_dir, downloader, progress) for role in ("target", "draft")}
    # Checked whenever anything is converted: both files must share a tokenizer, as the pair requires.
    target_tok = _load_gguf_tokenizer(ggufs["target"])
    _check_same_tokenizer(target_tok, _load_gguf_tokenizer(ggufs["draft"]))
    for role in todo:
        minutes = "~2 min" if role == "target" else "~1 min"
        _say(f"hf_ssd: converting {models[role]['file']} to a dense copy (one-time, {minutes}) ...", progress)
        tok = target_tok if role == "target" else None
        convert_gguf_to_dense(ggufs[role], dirs[role], models[role], tokenizer=tok)
        _say(f"hf_ssd: saved {dirs[role]}", progress)
    return dirs


# ------------------------------------------------------------------------------------------------- loading


def _load_dense(path: Path, dtype: torch.dtype, device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, use_safetensors=True, local_files_only=True
    )
    return model.to(device).eval()


def _check_vocab(target, draft, expected: int) -> None:
    sizes = {
        "target": target.get_input_embeddings().weight.shape[0],
        "draft": draft.get_input_embeddings().weight.shape[0],
    }
    if set(sizes.values()) != {expected}:
        raise RuntimeError(f"default pair: embedding rows {sizes}, expected {expected} for both.")


def load_default_pair(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
):
    """Load the default pair: ``(target, draft, tokenizer)`` — Qwen2.5-Coder 1.5B and 0.5B Instruct.

    The first call fetches, verifies and converts (a few minutes on CPU); later calls load the dense
    copies from the cache in seconds, with no network access.
    """
    from transformers import AutoTokenizer

    dirs = prepare_default_pair(cache_dir, progress)
    tokenizer = AutoTokenizer.from_pretrained(dirs["target"], local_files_only=True)
    target = _load_dense(dirs["target"], dtype, device)
    draft = _load_dense(dirs["draft"], dtype, device)
    _check_vocab(target, draft, load_default_spec()["vocab_size"])
    return target, draft, tokenizer


def _hub_error(id_or_path: str, err: Exception) -> ModelNotAvailableError:
    return ModelNotAvailableError(
        f"could not load {id_or_path!r}: {err}\n"
        "If this machine has no access to the Hugging Face Hub, pass a local directory instead, or use "
        "'default' for the embedded pair (Qwen2.5-Coder-1.5B/0.5B-Instruct, fetched offline from PyPI)."
    )


def _check_local(id_or_path) -> None:
    """A path-looking argument that does not exist is a typo, not a hub id: say so plainly."""
    text = str(id_or_path)
    if text.startswith(("/", ".", "~")) and not Path(text).expanduser().exists():
        raise ModelNotAvailableError(
            f"no such model directory: {text!r}. Pass an existing local directory, a hub id, or 'default' for "
            "the embedded pair (Qwen2.5-Coder-1.5B/0.5B-Instruct, fetched offline from PyPI)."
        )


def resolve_model(
    id_or_path: str | os.PathLike | None = None,
    role: str = "target",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
):
    """A causal LM from a hub id or a local path; ``None``/"default" gives the ``role`` ("target" or
    "draft") of the embedded default pair. Remote code is never trusted."""
    if id_or_path in DEFAULT_NAMES:
        if role not in ("target", "draft"):
            raise ValueError(f"role must be 'target' or 'draft', got {role!r}")
        return _load_dense(prepare_default_pair(cache_dir, progress)[role], dtype, device)
    from transformers import AutoModelForCausalLM

    _check_local(id_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(id_or_path), dtype=dtype, trust_remote_code=False)
    except OSError as err:
        raise _hub_error(str(id_or_path), err) from err
    return model.to(device).eval()


def resolve_tokenizer(
    id_or_path: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
):
    """The tokenizer for ``id_or_path``; ``None``/"default" gives the default pair's shared tokenizer."""
    from transformers import AutoTokenizer

    if id_or_path in DEFAULT_NAMES:
        return AutoTokenizer.from_pretrained(
            prepare_default_pair(cache_dir, progress)["target"], local_files_only=True
        )
    _check_local(id_or_path)
    try:
        return AutoTokenizer.from_pretrained(str(id_or_path), trust_remote_code=False)
    except OSError as err:
        raise _hub_error(str(id_or_path), err) from err
