"""Tuning profiles: a pair's measured scheduler costs, saved on disk and loaded by new processes.

Each process starts with empty scheduler estimates: its first call on a pair runs the default option three
times and then each other kind once to measure them (`schedule.Scheduler.first_rounds`), and a short call pays
for that. A profile holds what a process measured (`costs.CostModel.state_dict`: verify and draft times, tree steps,
overheads, acceptance per position and by confidence, bonus ranks, miss ratios, per-option corrections, rounds
seen; and the draft's acceptance calibration, `predictor.AcceptanceCalibration`). `hf-ssd tune` writes it
(`save`); `costs.cost_model_for` loads it where it creates a pair's estimates for the first time in a process
(`attach`), so every new process, each worker of a data-parallel run included, starts informed: with rounds
already seen it skips the first-call exploration, and the rare exploration rounds of an informed scheduler
remain.

File: ``<cache>/profiles/<key>.json`` (cache: ``$HF_SSD_CACHE`` or ``~/.cache/hf_ssd``; ``$HF_SSD_PROFILES``
names the directory instead). The key is a hash of `profile_fields`:

- target and draft: class, a hash of the config (less its name or path and the transformers version) and the
  attention implementation, parameter count, dtype, and a checksum of sampled weights (`model_fingerprint`);
- the device kinds of both and the GPU names, and torch's intra-op threads when the estimates were made;
- the machine: `platform.machine()`, the OS, the CPU model, `os.cpu_count()`.

So other models, another dtype, thread count or machine find no profile. The file repeats those fields (checked:
a file that does not match them is ignored) and records the hf_ssd, torch, transformers and Python versions: a
profile of other versions is ignored (with an info line on the "hf_ssd" logger; `hf-ssd tune` writes a new
one over it), as is a damaged file. Loading never raises. Inside, one entry per (layout, greedy or sampling,
top_k, draft_matmul): the keys of the in-process estimates.

Switches: ``HF_SSD_NO_PROFILE=1`` turns profiles off (none read, none written); `ignored()` (the command line's
``--no-profile``) reads none in its block, `save` still writes.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import logging
import os
import platform
import sys
import tempfile
import threading
import weakref
from pathlib import Path

import torch

logger = logging.getLogger("hf_ssd")

PROFILE_FORMAT = 1
NO_PROFILE_ENV = "HF_SSD_NO_PROFILE"
PROFILES_ENV = "HF_SSD_PROFILES"
CACHE_ENV = "HF_SSD_CACHE"  # as hf_ssd.models.fetch (the engine does not import the tooling)
SAMPLED_TENSORS = 5  # parameter tensors the weight checksum reads (first, last and three between)
SAMPLED_VALUES = 1024  # values read from each, evenly strided
# Config entries that name where a model came from rather than what it is.
_CONFIG_SKIP = ("_name_or_path", "transformers_version", "_commit_hash")

_ignore = 0
_ignore_lock = threading.Lock()
_fields: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # CostModel -> its profile fields


# ----------------------------------------------------------------------------------------------- switches


def enabled() -> bool:
    """False when HF_SSD_NO_PROFILE is set (to anything but "" or "0"): no profile is read or written."""
    return os.environ.get(NO_PROFILE_ENV, "").strip() in ("", "0")


def loading() -> bool:
    """Whether a pair's new estimates start from its profile here (`enabled` and outside `ignored`)."""
    return enabled() and _ignore == 0


@contextlib.contextmanager
def ignored():
    """Within the block (any thread of the process), estimates created for the first time start from the priors,
    not from a profile; `save` still writes. The command line's ``--no-profile``."""
    global _ignore
    with _ignore_lock:
        _ignore += 1
    try:
        yield
    finally:
        with _ignore_lock:
            _ignore -= 1


# ----------------------------------------------------------------------------------------------- key


def profiles_dir() -> Path:
    """``$HF_SSD_PROFILES``, else ``<cache>/profiles`` with the cache ``$HF_SSD_CACHE`` or ``~/.cache/hf_ssd``."""
    env = os.environ.get(PROFILES_ENV)
    if env:
        return Path(env).expanduser()
    cache = os.environ.get(CACHE_ENV)
    root = Path(cache).expanduser() if cache else Path.home() / ".cache" / "hf_ssd"
    return root / "profiles"


def _hash(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def cache_file(folder: str, key: dict) -> Path:
    """`<cache>/<folder>/<digest of key>.json`: where a verdict kept across processes lives (the draft's probe,
    the products' timings)."""
    return profiles_dir().parent / folder / f"{_hash(key)[:20]}.json"


@torch.no_grad()
def model_fingerprint(model) -> dict:
    """What identifies a model's costs and behaviour, cheaply: class, config hash, parameter count, dtype, and a
    checksum of SAMPLED_VALUES strided values of SAMPLED_TENSORS parameter tensors (a fine-tuned or noised copy
    of the same architecture differs there; reading them costs well under a millisecond per tensor)."""
    params = list(model.parameters())
    config = getattr(model, "config", None)
    cfg = config.to_dict() if hasattr(config, "to_dict") else {}
    for k in _CONFIG_SKIP:
        cfg.pop(k, None)
    cfg["_attn_implementation"] = getattr(config, "_attn_implementation", None)
    picks = sorted({round(i * (len(params) - 1) / max(1, SAMPLED_TENSORS - 1)) for i in range(SAMPLED_TENSORS)})
    sums = []
    for i in picks if params else ():
        flat = params[i].detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLED_VALUES)][:SAMPLED_VALUES].double()
        weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=sample.device)
        sums += [(sample * weights).sum(), sample.abs().sum()]
    checksum = [float(f"{v:.10g}") for v in torch.stack(sums).tolist()] if sums else []
    return {
        "class": type(model).__name__,
        "config": _hash(cfg)[:16],
        "parameters": sum(p.numel() for p in params),
        "dtype": str(params[0].dtype).removeprefix("torch.") if params else None,
        "checksum": checksum,
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware")):
                return line.split(":", 1)[1].strip()
    return platform.processor() or ""


@functools.lru_cache(maxsize=1)
def machine() -> dict:
    return {"machine": platform.machine(), "system": platform.system(), "cpu": _cpu_model(), "cpus": os.cpu_count()}


def versions() -> dict:
    import transformers

    return {
        "hf_ssd": getattr(sys.modules.get("hf_ssd"), "__version__", None),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def profile_fields(target, draft, threads: int | None = None) -> dict:
    """The fields a profile is keyed on (see the module docstring); `threads`: torch's intra-op threads (default:
    the current setting, which during an SSD call on CPU is the call's)."""
    devices = {p.device for m in (target, draft) for p in m.parameters()}
    gpus = sorted({torch.cuda.get_device_name(d) for d in devices if d.type == "cuda"})
    return {
        "target": model_fingerprint(target),
        "draft": model_fingerprint(draft),
        "devices": {role: sorted({p.device.type for p in m.parameters()}) for role, m in
                    (("target", target), ("draft", draft))},
        "gpus": gpus,
        "threads": torch.get_num_threads() if threads is None else threads,
        "machine": machine(),
    }


def profile_key(fields: dict) -> str:
    return _hash(fields)[:20]


def profile_path(fields: dict) -> Path:
    return profiles_dir() / f"{profile_key(fields)}.json"


def entry_name(layout: str, do_sample: bool, top_k: int, draft_matmul: str, verify_matmul: str) -> str:
    """The entry of a profile for one in-process estimates key (`costs.cost_model_for`, less the device)."""
    return (f"{layout}/{'sample' if do_sample else 'greedy'}/top_k={top_k}/draft_matmul={draft_matmul}"
            f"/verify_matmul={verify_matmul}")


# ----------------------------------------------------------------------------------------------- read / load


def read(path: Path, fields: dict, quiet: bool = False) -> dict | None:
    """The profile at `path` if it exists and is valid for `fields` and these versions; else None (logged at info
    level unless `quiet`, except for a missing file)."""
    say = logger.debug if quiet else logger.info
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        logger.debug("hf_ssd: no tuning profile at %s", path)
        return None
    except OSError as err:
        say("hf_ssd: tuning profile %s unreadable (%s); ignored", path, err)
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("not a profile")
    except ValueError as err:
        say("hf_ssd: tuning profile %s is damaged (%s); ignored (hf-ssd tune writes a new one)", path, err)
        return None
    if data.get("format") != PROFILE_FORMAT:
        say("hf_ssd: tuning profile %s has format %r, this hf_ssd reads %d; ignored (run hf-ssd tune again)", path,
            data.get("format"), PROFILE_FORMAT)
        return None
    if data.get("fields") != json.loads(json.dumps(fields, default=str)):
        say("hf_ssd: tuning profile %s was written for other models or another machine; ignored", path)
        return None
    now = versions()
    if data.get("versions") != now:
        old = data.get("versions") or {}
        diff = ", ".join(f"{k} {old.get(k)} (now {v})" for k, v in now.items() if old.get(k) != v)
        say("hf_ssd: tuning profile %s was written with %s; ignored (run hf-ssd tune again)", path, diff)
        return None
    return data


def attach(model, target, draft, layout: str, do_sample: bool, top_k: int, draft_matmul: str,
           verify_matmul: str) -> str | None:
    """Called where a pair's `CostModel` is created (`costs.cost_model_for`): remember its profile fields for `save`
    and, unless profiles are off or ignored, load its entry of the pair's profile. Returns the profile path loaded
    (also set as `model.profile`), or None. Never raises: a profile only saves exploration."""
    if not enabled():
        return None
    try:
        fields = profile_fields(target, draft)
        _fields[model] = fields
        if not loading():
            return None
        path = profile_path(fields)
        data = read(path, fields)
        if data is None:
            return None
        name = entry_name(layout, do_sample, top_k, draft_matmul, verify_matmul)
        entry = data["entries"].get(name)
        if entry is None:
            logger.info("hf_ssd: tuning profile %s has no estimates for %s (it has: %s); starting from the priors",
                        path, name, ", ".join(sorted(data["entries"])) or "none")
            return None
        with model.lock:
            model.load_state_dict(entry["costs"])
        model.profile = str(path)
        try:
            _load_calibration(draft, do_sample, entry.get("calibration"))
        except (KeyError, TypeError, ValueError) as err:
            logger.info("hf_ssd: tuning profile %s: acceptance calibration not used (%s)", path, err)
        logger.info("hf_ssd: scheduler estimates of %s loaded from tuning profile %s (%d rounds measured)", name, path,
                    model.rounds_seen)
        return model.profile
    except Exception as err:  # noqa: BLE001 - a profile may only ever save time
        logger.info("hf_ssd: tuning profile not used (%s: %s)", type(err).__name__, err)
        return None


def _load_calibration(draft, do_sample: bool, saved) -> None:
    """Seed the draft's acceptance calibration (`fanout="calibrated"`) unless this process already has one."""
    if not isinstance(saved, dict):
        return
    from ..speculation import predictor

    cal = predictor.AcceptanceCalibration(bins=int(saved["bins"]))
    accepted, tried = [float(v) for v in saved["accepted"]], [float(v) for v in saved["tried"]]
    if len(accepted) != cal.bins or len(tried) != cal.bins or min(tried, default=0.0) <= 0:
        raise ValueError("damaged calibration")
    cal.accepted, cal.tried = accepted, tried
    with predictor._carried_lock:
        predictor._carried.setdefault(draft, {}).setdefault(bool(do_sample), cal)


# ----------------------------------------------------------------------------------------------- save


def _calibration_state(draft, do_sample: bool) -> dict | None:
    from ..speculation import predictor

    with predictor._carried_lock:
        cal = predictor._carried.get(draft, {}).get(bool(do_sample))
    if cal is None:
        return None
    with cal._lock:
        return {"bins": cal.bins, "accepted": list(cal.accepted), "tried": list(cal.tried)}


def write_atomic(path: Path, data: dict) -> None:
    """Write JSON to `path` through a temporary file in its directory and `os.replace`: a reader sees the old file
    or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # as a file written normally (mkstemp's is private)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save(target, draft, source: str = "hf-ssd tune") -> list[Path]:
    """Write this process's estimates of (target, draft) into the pair's profile(s) (one per set of fields, e.g.
    thread count) and return their paths. Entries of the same file for other keys (e.g. sampling, measured by an
    earlier `hf-ssd tune --do-sample`) are kept when that file is valid. Nothing when HF_SSD_NO_PROFILE is set
    or nothing was measured. OSError when the directory cannot be written."""
    if not enabled():
        return []
    from .costs import estimates_of

    groups: dict[Path, tuple[dict, dict]] = {}
    for key, model in estimates_of(target, draft):
        _, _, layout, do_sample, top_k, draft_matmul, verify_matmul = key
        with model.lock:
            state = model.state_dict()
        if not state["rounds_seen"]:
            continue
        fields = _fields.get(model) or profile_fields(target, draft)
        path = profile_path(fields)
        entries = groups.setdefault(path, (fields, {}))[1]
        entries[entry_name(layout, do_sample, top_k, draft_matmul, verify_matmul)] = {
            "costs": state, "calibration": _calibration_state(draft, do_sample)}
    written = []
    for path, (fields, entries) in groups.items():
        old = read(path, fields, quiet=True)
        merged = {**(old["entries"] if old else {}), **entries}
        write_atomic(path, {
            "format": PROFILE_FORMAT, "fields": fields, "versions": versions(), "entries": merged,
            "written_by": source, "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        })
        logger.info("hf_ssd: tuning profile written to %s", path)
        written.append(path)
    return written
