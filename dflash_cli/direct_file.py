"""A write-only file for gigabytes written once, with O_DIRECT when DFLASH_DIRECT_IO=1.

Through the page cache every 4 KiB written first needs a page. On the 2-core VM this was measured on,
fresh pages are slow (its host takes freed guest memory back): buffered writes of 2.5 GB ran at
0.27-0.56 GB/s with most of a core in the kernel, O_DIRECT at 1.3-1.7 GB/s with the CPU idle
(`dd bs=8M`, alternating), and a whole 0.6B-shaped `dflash build` took 18.2 s instead of 21.5 s. But a
file written around the page cache is read back from the disk: the `dflash run` right after such a
build took ~10 s longer, more than the build saved. So it is opt-in, for builds whose output is used
elsewhere or later (a CI build machine) or pairs whose export cannot stay in the page cache anyway.
O_DIRECT wants the memory, the file offset and the length aligned, so blocks are gathered in an
aligned staging buffer and written a whole buffer at a time; the last one is padded to the alignment
and the file truncated back. Filesystems that refuse O_DIRECT (tmpfs, some network mounts) get
ordinary buffered writes.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import numpy as np

ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks
STAGE_BYTES = 8 << 20


def direct_io_wanted() -> bool:
    return hasattr(os, "O_DIRECT") and os.environ.get("DFLASH_DIRECT_IO") == "1"


class DirectFile:
    """`write(buffer)` appends; `close()` leaves exactly the bytes written. Not thread-safe: one writer.
    `direct=False`: never O_DIRECT (a file read back at once), whatever DFLASH_DIRECT_IO says."""

    def __init__(self, path: Path, direct: bool = True, stage_bytes: int = STAGE_BYTES) -> None:
        self.path = path
        # O_BINARY: Windows would otherwise translate newlines in the bytes written
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
        self.direct = False
        if direct and direct_io_wanted():
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError:
                pass  # EINVAL: the filesystem has no O_DIRECT
        if not self.direct:
            self._fd = os.open(path, flags, 0o644)
        self._stage = mmap.mmap(-1, stage_bytes) if self.direct else None  # page-aligned memory
        self._view = memoryview(self._stage) if self.direct else None
        self._array = np.frombuffer(self._stage, dtype=np.uint8) if self.direct else None  # copies outside the GIL
        self._fill = 0
        self.size = 0

    def write(self, block) -> None:
        data = np.frombuffer(block, dtype=np.uint8)
        if not self.direct and not self._fill:  # buffered, nothing staged before a fallback: straight through
            self._write_all(memoryview(data))
            self.size += data.size
            return
        while data.size:
            take = min(data.size, len(self._view) - self._fill)
            self._array[self._fill : self._fill + take] = data[:take]
            self._fill += take
            data = data[take:]
            if self._fill == len(self._view):
                self._flush(self._fill)

    def _flush(self, length: int) -> None:
        padded = -(-length // ALIGN) * ALIGN if self.direct else length
        if padded > length:
            self._view[length:padded] = bytes(padded - length)
        done = 0
        while done < padded:
            try:
                done += os.write(self._fd, self._view[done:padded])
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:  # O_DIRECT refused at write time
                    raise
                self._buffered()
                padded = length
        self.size += length
        self._fill = 0

    def _write_all(self, view) -> None:
        while view:
            view = view[os.write(self._fd, view) :]

    def _buffered(self) -> None:
        import fcntl

        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            if self._fill:
                self._flush(self._fill)
            if self.direct:
                os.ftruncate(self._fd, self.size)  # drop the last block's padding
        finally:
            os.close(self._fd)
            self._fd = -1
            if self._stage is not None:
                self._array = None
                self._view.release()
                self._stage.close()
