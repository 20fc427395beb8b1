"""Artifact cache: atomic publish, what counts as a hit, verify, clean, locking."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from dflash_cli.cache.store import MANIFEST, Cache, compute_key, parse_age
from dflash_cli.cache.upkeep import clean, verify
from dflash_cli.errors import CacheError


def publish_one(cache: Cache, stage: str = "convert", key: str = "k1", content: bytes = b"weights") -> Path:
    with cache.lock(stage, key), cache.staging(stage, key) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "model.bin").write_bytes(content)
        (tmp / "config.json").write_text("{}")
        path, _ = cache.publish(tmp, stage, key, {"recipe": "tiny", "inputs": {"a": 1}}, seconds=1.5)
    return path


def test_compute_key_is_canonical() -> None:
    assert compute_key({"a": 1, "b": [1, 2]}) == compute_key({"b": [1, 2], "a": 1})
    assert compute_key({"a": 1}) != compute_key({"a": 2})
    assert len(compute_key({})) == 64


def test_default_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    assert Cache().root == tmp_path / "home"
    assert Cache(tmp_path / "explicit").root == tmp_path / "explicit"
    monkeypatch.delenv("DFLASH_HOME")
    assert Cache().root == Path.home() / ".cache" / "dflash"


def test_publish_is_atomic_and_complete(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    cache.ensure_writable()
    path = publish_one(cache)
    assert path == tmp_path / "artifacts" / "convert" / "k1"
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["stage"] == "convert" and manifest["key"] == "k1" and manifest["recipe"] == "tiny"
    assert manifest["seconds"] == 1.5 and manifest["inputs"] == {"a": 1} and manifest["created"]
    outputs = {o["path"]: o for o in manifest["outputs"]}
    assert set(outputs) == {"config.json", "sub/model.bin"}
    assert outputs["sub/model.bin"]["size"] == len(b"weights") and len(outputs["sub/model.bin"]["sha256"]) == 64
    assert cache.lookup("convert", "k1") == path
    assert list(cache.tmp_dir.iterdir()) == []  # the tmp dir was renamed, nothing left behind


def test_failed_build_leaves_no_artifact_and_no_tmp(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    with pytest.raises(RuntimeError), cache.staging("convert", "k1") as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("stage crashed")
    assert cache.lookup("convert", "k1") is None
    assert list(cache.tmp_dir.iterdir()) == []


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: (p / MANIFEST).write_text("{not json"),
        lambda p: (p / MANIFEST).unlink(),
        lambda p: (p / MANIFEST).write_text(json.dumps({"stage": "convert", "key": "other", "outputs": []})),
    ],
    ids=["unparseable", "missing", "wrong-key"],
)
def test_incomplete_artifact_is_a_miss(tmp_path: Path, damage) -> None:
    """No complete manifest: a crash leftover, nothing to trust, rebuilt."""
    cache = Cache(tmp_path)
    path = publish_one(cache)
    damage(path)
    assert cache.lookup("convert", "k1") is None
    assert [e.problem for e in cache.entries()] != [None]


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda p: (p / "sub" / "model.bin").write_bytes(b"trunc"), "has size"),
        (lambda p: (p / "config.json").unlink(), "missing output config.json"),
        (lambda p: _flip_byte(p / "sub" / "model.bin"), "sub/model.bin was modified"),
    ],
    ids=["truncated-output", "missing-output", "flipped-byte"],
)
def test_damaged_published_artifact_is_an_error_not_a_miss(tmp_path: Path, damage, words: str) -> None:
    """A complete manifest whose files changed: damage, reported with the fix, never silently reused."""
    from dflash_cli.cache.store import CorruptArtifactError

    cache = Cache(tmp_path)
    path = publish_one(cache)
    damage(path)
    with pytest.raises(CorruptArtifactError, match=words) as exc:
        cache.lookup("convert", "k1")
    assert "--rebuild convert" in exc.value.hint


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    time.sleep(0.01)  # a rewrite moves mtime, as any real write does
    path.write_bytes(bytes(data))  # same size


def test_publish_replaces_a_broken_leftover(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    leftover = cache.path_for("convert", "k1")
    leftover.mkdir(parents=True)
    (leftover / "junk").write_text("from a crash")
    path = publish_one(cache)
    assert not (path / "junk").exists() and cache.lookup("convert", "k1") == path


def test_verify_detects_modified_and_missing_files(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    publish_one(cache, key="good")
    bad = publish_one(cache, key="bad")
    publish_one(cache, key="gone")
    (bad / "sub" / "model.bin").write_bytes(b"WEIGHTS")  # same size, different bytes: only a hash finds it
    (cache.path_for("convert", "gone") / "config.json").unlink()
    reports = {r.entry.key: r for r in verify(cache)}
    assert reports["good"].ok
    assert reports["bad"].problems == ["contents changed: sub/model.bin"]
    assert reports["gone"].problems == ["missing: config.json"]


def test_entries_show_recipe_size_and_age(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    publish_one(cache)
    [entry] = cache.entries()
    assert (entry.recipe, entry.stage, entry.key, entry.problem) == ("tiny", "convert", "k1", None)
    assert entry.size == len(b"weights") + 2 and 0 <= entry.age_s < 60
    assert Cache(tmp_path / "nothing-here").entries() == []


def test_clean_older_than(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    old = publish_one(cache, key="old")
    publish_one(cache, key="new")
    manifest = json.loads((old / MANIFEST).read_text())
    manifest["created_unix"] = time.time() - 8 * 86400
    (old / MANIFEST).write_text(json.dumps(manifest))

    dry = clean(cache, parse_age("7d"), dry_run=True)
    assert [e.key for e in dry.removed] == ["old"] and old.exists()

    report = clean(cache, parse_age("7d"))
    assert [e.key for e in report.removed] == ["old"] and report.bytes_freed > 0
    assert not old.exists() and cache.lookup("convert", "new") is not None

    clean(cache)
    assert cache.entries() == []


def test_parse_age() -> None:
    assert parse_age("7d") == 7 * 86400 and parse_age("12h") == 43200 and parse_age("30m") == 1800
    with pytest.raises(CacheError, match="cannot parse age"):
        parse_age("seven days")


def test_stale_tmp_dirs_are_removed_unless_their_build_runs(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    cache.ensure_writable()
    stale = cache.tmp_dir / "convert-aaaa-xyz12345"
    stale.mkdir()
    live = cache.tmp_dir / "convert-bbbb-abc12345"
    live.mkdir()
    with cache.lock("convert", "bbbb"):
        assert cache.clean_stale_tmp() == 1
    assert not stale.exists() and live.exists()


def test_unwritable_cache_dir_has_a_hint(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(CacheError) as exc:
        Cache(blocker / "cache").ensure_writable()
    assert "is not writable" in exc.value.message
    assert "--cache-dir" in exc.value.hint and "DFLASH_HOME" in exc.value.hint


def test_lock_makes_concurrent_builders_build_once(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    cache.ensure_writable()
    builds: list[str] = []
    waited: list[str] = []

    def builder(name: str) -> None:
        if cache.lookup("convert", "k") is not None:
            return
        with cache.lock("convert", "k", on_wait=lambda: waited.append(name)):
            if cache.lookup("convert", "k") is not None:
                return
            with cache.staging("convert", "k") as tmp:
                builds.append(name)
                time.sleep(0.3)
                (tmp / "out").write_text(name)
                cache.publish(tmp, "convert", "k", {"recipe": "tiny"}, seconds=0.3)

    threads = [threading.Thread(target=builder, args=(f"t{i}",)) for i in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(waited) == 2
    assert cache.lookup("convert", "k") is not None
