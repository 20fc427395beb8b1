"""sha256 of files: read back, or computed on the way out by `HashingWriter` for the cache to reuse.

An export writes gigabytes once; hashing them while they are written (in a thread, beside the one
writing) spares `Cache.publish` reading them all back.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# sha256 of files this process wrote through a HashingWriter, by (inode, size, mtime_ns): publish()
# takes them instead of reading the bytes again. A file changed since has another mtime or size, so a
# stale entry is never used.
_FRESH_DIGESTS: dict[tuple[int, int, int], str] = {}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def take_fresh_digest(ident: tuple[int, int, int]) -> str | None:
    """The digest a HashingWriter recorded for the file with this (inode, size, mtime_ns), once."""
    return _FRESH_DIGESTS.pop(ident, None)


class HashingWriter:
    """A binary file written and sha256-hashed by two background threads (both release the GIL on
    large buffers), so the bytes are stored and hashed while the caller reads and converts the next
    tensor. A write error (a full disk) is raised by the next `write` or by `close`. Buffers handed
    to `write` must not change afterwards. `digest=False`: a file that is never published is only
    written."""

    def __init__(self, path: Path, depth: int = 2, digest: bool = True) -> None:
        import queue
        import threading

        self.path = path
        self._file = path.open("wb")
        self._digest = hashlib.sha256() if digest else None
        self._error: BaseException | None = None
        consumers = [self._file.write] + ([self._digest.update] if self._digest is not None else [])
        # Each queue bounds the blocks held for its thread.
        self._queues = tuple(queue.Queue(maxsize=depth) for _ in consumers)
        self._threads = tuple(
            threading.Thread(target=self._drain, args=(blocks, consume), daemon=True)
            for blocks, consume in zip(self._queues, consumers, strict=True)
        )
        for thread in self._threads:
            thread.start()

    def _drain(self, blocks, consume) -> None:
        while (block := blocks.get()) is not None:
            if self._error is None:
                try:
                    consume(block)
                except BaseException as exc:  # noqa: BLE001 - handed to the writing thread
                    self._error = exc  # keep draining: `write` must never block on a dead consumer

    def write(self, block) -> None:
        if self._error is not None:
            raise self._error
        for blocks in self._queues:
            blocks.put(block)

    def close(self, ok: bool = True) -> None:
        for blocks in self._queues:
            blocks.put(None)
        for thread in self._threads:
            thread.join()
        try:
            self._file.close()
        except OSError as exc:
            self._error = self._error or exc
        if self._error is not None and ok:
            raise self._error
        if ok and self._digest is not None:
            st = self.path.stat()
            _FRESH_DIGESTS[(st.st_ino, st.st_size, st.st_mtime_ns)] = self._digest.hexdigest()

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)
