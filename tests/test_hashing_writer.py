"""Files written through HashingWriter are hashed on the way out, and publish() trusts that digest
only while the file is unchanged."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from dflash_cli.cache import hashing as cache_mod
from dflash_cli.cache.hashing import HashingWriter, sha256_file
from dflash_cli.cache.store import Cache


def test_digest_equals_reading_the_file_back(tmp_path):
    path = tmp_path / "w.data"
    blocks = [np.arange(n, dtype=np.float32) for n in (1, 70000, 3)]
    with HashingWriter(path) as f:
        for b in blocks:
            f.write(memoryview(b).cast("B"))
        f.write(b"\0" * 17)
    st = path.stat()
    assert cache_mod._FRESH_DIGESTS[(st.st_ino, st.st_size, st.st_mtime_ns)] == sha256_file(path)


def test_without_digest_the_bytes_are_written_and_nothing_is_recorded(tmp_path):
    path = tmp_path / "twin.data"
    before = dict(cache_mod._FRESH_DIGESTS)
    with HashingWriter(path, digest=False) as f:
        f.write(b"abc")
        f.write(memoryview(np.arange(5, dtype=np.float32)).cast("B"))
    assert path.read_bytes() == b"abc" + np.arange(5, dtype=np.float32).tobytes()
    assert cache_mod._FRESH_DIGESTS == before


def test_publish_uses_the_fresh_digest_and_ignores_it_once_the_file_changed(tmp_path):
    cache = Cache(tmp_path / "cache")
    with cache.staging("export", "k1") as tmp:
        with HashingWriter(tmp / "a.data") as f:
            f.write(b"x" * 1000)
        st = (tmp / "a.data").stat()
        ident = (st.st_ino, st.st_size, st.st_mtime_ns)
        cache_mod._FRESH_DIGESTS[ident] = "0" * 64  # what publish must take without re-reading
        _, manifest = cache.publish(tmp, "export", "k1", {}, 0.0)
    assert manifest["outputs"][0]["sha256"] == "0" * 64
    assert ident not in cache_mod._FRESH_DIGESTS  # used once
    with cache.staging("export", "k2") as tmp:
        with HashingWriter(tmp / "b.data") as f:
            f.write(b"y" * 1000)
        st = (tmp / "b.data").stat()
        cache_mod._FRESH_DIGESTS[(st.st_ino, st.st_size, st.st_mtime_ns)] = "0" * 64
        with (tmp / "b.data").open("r+b") as g:  # changed after writing: another mtime
            g.write(b"z")
        os.utime(tmp / "b.data", ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
        _, manifest = cache.publish(tmp, "export", "k2", {}, 0.0)
    assert manifest["outputs"][0]["sha256"] == sha256_file(cache.path_for("export", "k2") / "b.data")


def test_a_failed_write_records_no_digest(tmp_path):
    path = tmp_path / "w.data"
    before = dict(cache_mod._FRESH_DIGESTS)
    try:
        with HashingWriter(path) as f:
            f.write(b"abc")
            raise RuntimeError("killed")
    except RuntimeError:
        pass
    assert cache_mod._FRESH_DIGESTS == before


def test_a_full_disk_is_raised_and_records_no_digest(tmp_path, monkeypatch):
    class FullDisk:
        def write(self, block):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass

    monkeypatch.setattr(Path, "open", lambda self, mode="r", *a, **k: FullDisk())
    before = dict(cache_mod._FRESH_DIGESTS)
    with pytest.raises(OSError, match="No space"):
        with HashingWriter(tmp_path / "w.data") as f:
            for _ in range(50):  # more blocks than the queues hold: write must not block on a dead writer
                f.write(b"x" * 4096)
    assert cache_mod._FRESH_DIGESTS == before
