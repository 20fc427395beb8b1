"""DirectFile leaves exactly the bytes written, with O_DIRECT, without it, and when a filesystem refuses
it at open or at write time; HashingWriter raises a write error instead of publishing a short file."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from dflash_cli import cache as cache_mod
from dflash_cli import direct_file
from dflash_cli.cache import HashingWriter
from dflash_cli.direct_file import DirectFile

STAGE = 3 * direct_file.ALIGN  # small staging buffer: many whole-buffer writes and a padded tail


def _blocks(seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    sizes = (1, 5000, STAGE, 3 * STAGE + 7, 0, 4096, 17)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes] + [b"tail bytes"]


def _write(path, direct: bool = True) -> tuple[bytes, bool]:
    blocks = _blocks()
    f = DirectFile(path, direct=direct, stage_bytes=STAGE)
    used = f.direct
    for b in blocks:
        f.write(b if isinstance(b, bytes) else memoryview(b).cast("B"))
    f.close()
    return b"".join(bytes(b) for b in blocks), used


@pytest.mark.parametrize("direct", [True, False])
def test_the_file_holds_exactly_what_was_written(tmp_path, direct):
    expected, used = _write(tmp_path / "d.data", direct)
    assert (tmp_path / "d.data").read_bytes() == expected
    if not direct:
        assert not used


@pytest.fixture(autouse=True)
def _direct_io_on(monkeypatch):
    monkeypatch.setenv("DFLASH_DIRECT_IO", "1")


def test_off_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_DIRECT_IO")
    _, used = _write(tmp_path / "d.data")
    assert not used


def test_a_filesystem_refusing_o_direct_at_open_gets_buffered_writes(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    expected, used = _write(tmp_path / "d.data")
    assert not used
    assert (tmp_path / "d.data").read_bytes() == expected


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_a_filesystem_refusing_o_direct_at_write_time_falls_back(tmp_path, monkeypatch):
    real_write = os.write
    refused = []

    def refuse_first(fd, data):
        if not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refuse_first)
    expected, _ = _write(tmp_path / "d.data")
    assert refused
    assert (tmp_path / "d.data").read_bytes() == expected


def test_other_write_errors_are_raised(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    f = DirectFile(tmp_path / "d.data", stage_bytes=STAGE)
    with pytest.raises(OSError, match="No space"):
        f.write(bytes(STAGE))
    monkeypatch.undo()
    f.close()


def test_hashing_writer_raises_a_full_disk_and_records_no_digest(tmp_path, monkeypatch):
    def full(self, block):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DirectFile, "write", full)
    before = dict(cache_mod._FRESH_DIGESTS)
    with pytest.raises(OSError, match="No space"):
        with HashingWriter(tmp_path / "w.data") as f:
            for _ in range(50):  # more blocks than the queues hold: write must not block on a dead writer
                f.write(b"x" * 4096)
    assert cache_mod._FRESH_DIGESTS == before
