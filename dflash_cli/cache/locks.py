"""The cache's use locks: `flock`s on `locks/<stage>-<key>.use` beside the per-key build locks.

A reader of a published artifact holds a shared one for as long as it reads; `clean` removes an
artifact only under an exclusive one taken without waiting (and without the key's build lock held by
anyone), so it skips what is in use. The kernel drops a dead process's locks. `clean` deletes an
artifact's lock files with the artifact, under both locks; a waiter that then wakes on the deleted
inode sees that the path no longer names it and locks the path's new file instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import weakref
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout


class ArtifactHold:
    """A shared lock on one artifact: `clean` leaves the artifact alone until `release()` (or until this
    object is garbage collected, or its process ends)."""

    def __init__(self, fd: int | None) -> None:
        self._release = weakref.finalize(self, os.close, fd) if fd is not None else None

    def release(self) -> None:
        if self._release is not None:
            self._release()

    def __enter__(self) -> ArtifactHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold_shared(use: Path) -> ArtifactHold:
    """A shared lock on `use`; it waits only while a `clean` is removing that very artifact. A cache
    whose locks cannot be written (a read-only copy) gets a no-op hold: nobody can clean it either."""
    while True:
        fd = _open_lock(use)
        if fd is None:
            return ArtifactHold(None)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        if _names(use, fd):
            return ArtifactHold(fd)
        os.close(fd)  # `clean` deleted this lock file while we waited: lock the one the path names now


@contextlib.contextmanager
def claim(use: Path, build: Path) -> Iterator[tuple[int, ...] | None]:
    """Exclusive hold of an artifact without waiting: yields None when claimed (remove it now), else the
    pids holding it (maybe unknown: empty). A build of the same key (its build lock) is a holder too.
    While claimed, `forget(use, build)` may delete both lock files."""
    while True:
        fd = _open_lock(use)
        if fd is None:  # a read-only cache: nothing can hold it for writing, nor can this remove it
            yield None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            yield flock_holders(use)
            return
        if _names(use, fd):
            break
        os.close(fd)  # another clean deleted it meanwhile
    try:
        lock = FileLock(str(build))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            yield flock_holders(build)
            return
        try:
            yield None
        finally:
            lock.release()
    finally:
        os.close(fd)  # drops the exclusive lock


def forget(*locks: Path) -> None:
    """Delete lock files; only under `claim`, which holds them, so that nobody holds or waits on them."""
    for path in locks:
        with contextlib.suppress(OSError):
            path.unlink()


def _names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd` (a deleted or replaced lock file locks nothing)."""
    try:
        st, held = path.stat(), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _open_lock(path: Path) -> int | None:
    """A descriptor to flock `path` through (created if need be); None where the cache is read-only."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        with contextlib.suppress(OSError):
            return os.open(path, flags | os.O_CLOEXEC, 0o666)
    return None


def flock_holders(path: Path) -> tuple[int, ...]:
    """Pids holding a flock on `path`, from Linux's /proc/locks; () where that is unknown."""
    try:
        st = path.stat()
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return ()
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    same_dev, same_ino = set(), set()
    for line in lines:
        fields = line.split()  # "1: FLOCK  ADVISORY  READ 1234 fe:00:2671359 0 EOF"; waiters have a "->"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[4].isdigit():
            if fields[5].rsplit(":", 1)[-1] == str(st.st_ino):
                (same_dev if fields[5] == ident else same_ino).add(int(fields[4]))
    return tuple(sorted((same_dev or same_ino) - {0}))  # an overlay filesystem may report another device
