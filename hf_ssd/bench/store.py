"""The crash-safe files of an `hf-ssd eval` run: `settings.json` and the per-example `results*.jsonl`.

Guarantees, for a run killed at any moment (SIGKILL and power loss included):

- `settings.json` is written atomically (temporary file, fsync, rename, fsync of the directory) before the
  first result, so a directory with results always says how they were made; a rerun with other settings is
  refused (`SettingsMismatch`) instead of mixing results.
- Each result is one JSON line, appended with a single write and then flushed and fsync'd, so a kill loses at
  most the examples in flight. Only the last line of a file can be torn; a reader drops it (`read_records`)
  and the writer that owns the file cuts it off before it appends again (`Appender`). Damage anywhere else is
  reported (`ResultsDamaged`), never silently skipped.
- In a data-parallel run each process appends to its own part, `results.rank{i}.jsonl`; at the end the main
  process merges `results.jsonl` and every part (deduplicated by `index`, sorted) into a new `results.jsonl`
  written atomically, and only then deletes the parts. A kill during the merge leaves either the old
  `results.jsonl` with its parts or the new one (with parts that repeat it, which readers ignore), so no
  example is ever lost or counted twice.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

RESULTS = "results.jsonl"
LOCK = ".lock"
SETTINGS = "settings.json"
PART_GLOB = "results.rank*.jsonl"


class StoreError(RuntimeError):
    """The run directory cannot be used as it is (the message says what to change)."""


class SettingsMismatch(StoreError):
    """A rerun on an existing --out was given settings other than the ones its results were made with."""


class DirectoryBusy(StoreError):
    """Another run is writing to the same directory."""


class ResultsDamaged(StoreError):
    """A results file is damaged somewhere other than a torn last line (not the result of a crash)."""


def part_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"results.rank{rank}.jsonl"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by `data` so that a reader (or a crash) sees either the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")  # see remove_leftovers
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# ----------------------------------------------------------------------------------------------- the lock

_held: dict[str, list] = {}  # resolved directory -> [open lock file, holders] in this process


@contextlib.contextmanager
def exclusive(out_dir: Path):
    """Hold `out_dir`'s lock for the block: a second run on the same directory (also in another process) stops
    with `DirectoryBusy` instead of writing the same examples. Reentrant within a process; the operating system
    releases it when the process dies, however it dies."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = str(out_dir.resolve())
    if key in _held:
        _held[key][1] += 1
    else:
        f = open(out_dir / LOCK, "a+")
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            fcntl = None
        if fcntl is not None:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                f.close()
                raise DirectoryBusy(f"another hf-ssd eval is writing to {out_dir}; wait for it to finish (or stop "
                                    "it), or pass another --out") from err
        _held[key] = [f, 1]
    try:
        yield
    finally:
        _held[key][1] -= 1
        if _held[key][1] == 0:
            _held.pop(key)[0].close()


# ----------------------------------------------------------------------------------------------- settings


def _describe_change(old: dict, new: dict, prefix: str = "") -> list[str]:
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        if isinstance(a, dict) and isinstance(b, dict):
            changes += _describe_change(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {json.dumps(a)} in the results, {json.dumps(b)} now")
    return changes


# SSD options an earlier version wrote into settings.json at values that make what today's default makes (0.2.0
# removed pipeline_depth and eviction; at these values they changed nothing): such a run stays resumable.
RETIRED_OPTIONS = {"pipeline_depth": 1, "eviction": "probability"}


def _without_retired(settings: dict) -> dict:
    options = settings.get("ssd_options")
    if isinstance(options, dict):
        kept = {k: v for k, v in options.items() if not (k in RETIRED_OPTIONS and v == RETIRED_OPTIONS[k])}
        settings = {**settings, "ssd_options": kept}
    return settings


def check_settings(out_dir: Path, settings: dict, write: bool) -> bool:
    """Refuse `settings` if `out_dir` holds results made with other settings; write them when it holds none.

    Returns True when the directory already had these settings (a resume). `write=False` only checks (the
    other processes of a data-parallel run; the main process writes)."""
    out_dir = Path(out_dir)
    path = out_dir / SETTINGS
    settings = json.loads(json.dumps(settings))  # what it will read back as (tuples -> lists, ...)
    if path.exists():
        try:
            old = _without_retired(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as err:
            raise StoreError(f"{path} cannot be read ({err}); it was not written by hf-ssd eval or was edited. "
                             "Use a new --out (or restore the file).") from err
        if old != settings:
            changes = "\n  ".join(_describe_change(old, settings))
            raise SettingsMismatch(
                f"{out_dir} holds results made with other settings, so they would mix:\n  {changes}\n"
                "Rerun with the settings of the results to resume, or pass a new --out for these settings.")
        return True
    if out_dir.exists() and (any(out_dir.glob(PART_GLOB)) or (out_dir / RESULTS).exists()):
        raise StoreError(f"{out_dir} has results but no {SETTINGS}, so it is not known how they were made; "
                         "pass a new --out (or move the results away).")
    if write:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(path, (json.dumps(settings, indent=2, sort_keys=True) + "\n").encode())
    return False


# ----------------------------------------------------------------------------------------------- results


def _parse(line: bytes):
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("index"), int):
        return None
    return record


def read_records(path: Path) -> tuple[list[dict], int, bool]:
    """(records, length of the good prefix in bytes, whether a torn last line was dropped) of one file.

    A crash can only tear the last line: bytes after the last newline, or a last line that does not parse
    (e.g. zeros a file system left after a power loss). Those are dropped; a bad line before a good one is
    `ResultsDamaged`."""
    path = Path(path)
    if not path.exists():
        return [], 0, False
    data = path.read_bytes()
    records: list[dict] = []
    good = 0
    pos = 0
    torn = False
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:  # no newline: the write of this line did not finish
            torn = True
            break
        line = data[pos:end]
        record = _parse(line) if line.strip() else None
        if record is None and line.strip(b"\x00 \t\r"):
            if data[end + 1:].strip(b"\x00 \t\r\n"):
                lineno = data[:pos].count(b"\n") + 1
                raise ResultsDamaged(f"{path}, line {lineno}, is not a result written by hf-ssd eval (only a "
                                     "last line can be torn by a crash); repair or remove that line, or use a "
                                     "new --out.")
            torn = True
            break
        if record is None:  # an empty (or all-zero) line
            if data[end + 1:].strip(b"\x00 \t\r\n"):
                pos = end + 1
                good = pos
                continue
            torn = bool(line)
            break
        records.append(record)
        pos = end + 1
        good = pos
    return records, good, torn


def result_files(out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    return [out_dir / RESULTS] + sorted(out_dir.glob(PART_GLOB))


def read_all(out_dir: Path) -> dict[int, dict]:
    """Every finished example in `out_dir` (results.jsonl and any parts), by index, first copy kept."""
    found: dict[int, dict] = {}
    for path in result_files(out_dir):
        for record in read_records(path)[0]:
            found.setdefault(record["index"], record)
    return found


class Appender:
    """Appends result lines to one file, each flushed and fsync'd; a torn last line is cut off first."""

    def __init__(self, path: Path):
        self.path = Path(path)
        existed = self.path.exists()
        _, good, torn = read_records(self.path)
        self.dropped_torn_line = torn
        if existed and self.path.stat().st_size != good:
            with open(self.path, "r+b") as f:
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())
        self._file = open(self.path, "ab")
        if not existed:
            _fsync_dir(self.path.parent)  # the new file's name is durable too

    def append(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8")
        self._file.write(line)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def remove_leftovers(out_dir: Path) -> None:
    """Delete the temporary files of writes a kill interrupted (never read: the real files are intact)."""
    for tmp in Path(out_dir).glob(".*.tmp*"):
        tmp.unlink(missing_ok=True)


def merge_parts(out_dir: Path) -> int:
    """Fold every `results.rank*.jsonl` into `results.jsonl` (atomically), then delete the parts.

    Returns the number of examples in results.jsonl. Without parts the file is left as it is."""
    out_dir = Path(out_dir)
    parts = sorted(out_dir.glob(PART_GLOB))
    if not parts:
        return len(read_records(out_dir / RESULTS)[0])
    merged = read_all(out_dir)
    lines = b"".join((json.dumps(merged[i], ensure_ascii=False, default=str) + "\n").encode("utf-8")
                     for i in sorted(merged))
    write_atomic(out_dir / RESULTS, lines)
    for part in parts:
        part.unlink()
    _fsync_dir(out_dir)
    return len(merged)


class PartsWatcher:
    """Counts finished examples of `indices` in the part files as they grow, reading each byte once (the main
    process's progress bar in a data-parallel run). Create it once every writer has cut its torn line off
    (appends then only add whole lines behind what it read)."""

    def __init__(self, out_dir: Path, ranks: Iterable[int], indices: Iterable[int]):
        self.paths = [part_path(out_dir, r) for r in ranks]
        self.offsets = {p: 0 for p in self.paths}
        self.sizes = {p: 0 for p in self.paths}
        self.wanted = set(indices)
        self.seen: set[int] = set()

    def poll(self) -> int:
        for p in self.paths:
            if not p.exists():
                continue
            if p.stat().st_size < self.offsets[p]:  # cut shorter under us (not done by hf-ssd): read it again
                self.offsets[p] = 0
            with open(p, "rb") as f:
                f.seek(self.offsets[p])
                data = f.read()
            end = data.rfind(b"\n")
            if end < 0:
                continue
            for line in data[:end].split(b"\n"):
                record = _parse(line)
                if record is not None and record["index"] in self.wanted:
                    self.seen.add(record["index"])
            self.offsets[p] += end + 1
        return len(self.seen)
