"""Whether the files an engine reads still hold the bytes their build wrote, checked once per file per
process.

`Cache.entry` checks sizes, inodes and mtimes only: rot on disk, or an edit in place that restores the
mtime, passes it, and an engine running on such a file answers wrongly with exit 0. So an engine's
files are hashed again (sha256, as the manifest records it) in a background thread started before the
sessions load, which read the same pages anyway; the engine is handed out only once the check passed.
A file verified once is not hashed again by the same process (a server checks at start, not per request).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import threading
from pathlib import Path

from dflash_cli.cache.hashing import sha256_file
from dflash_cli.cache.store import MANIFEST, CorruptArtifactError

# What an engine reads of each artifact it holds: the whole compiled program, and of the upstream ones the
# descriptions, the tokenizer and (QAIC) the vision tower; their weights were compiled into the program.
ENGINE_READS = {
    "compile": ("*",),
    "export": ("export.json", "vision.onnx*"),
    "inject": ("pair.json", "target/*"),
}
_NOT_READ = ("*.safetensors",)

# (device, inode, size, mtime_ns, sha256) of every file this process has verified
_VERIFIED: set[tuple[int, int, int, int, str]] = set()
_VERIFIED_LOCK = threading.Lock()


class ContentCheck:
    """Hashes the engine-read outputs of `artifacts` (stage -> published directory) in a daemon thread;
    `wait()` returns once all match their manifests and raises CorruptArtifactError naming the first
    that does not, with the `build_command` that replaces it."""

    def __init__(self, artifacts: dict[str, Path], build_command: str) -> None:
        self._artifacts, self._build_command = artifacts, build_command
        self._error: CorruptArtifactError | None = None
        self.bytes_hashed = 0
        self._thread = threading.Thread(target=self._run, name="dflash-content-check", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        for stage, path in self._artifacts.items():
            for out in _read_outputs(stage, path):
                problem = self._check(path / out["path"], out.get("sha256"))
                if problem is not None:
                    first = self._first_holder(path / out["path"]) or stage
                    self._error = CorruptArtifactError(
                        f"cached {stage} artifact {path.name[:12]} is damaged: {out['path']} {problem}",
                        hint=f"run `{self._build_command} --rebuild {first}` (`dflash cache verify` lists all)",
                    )
                    return

    def _first_holder(self, file: Path) -> str | None:
        """The earliest stage whose artifact holds `file` as a hard link: rebuilding a later one would link
        the same damaged bytes again."""
        try:
            st = file.stat()
        except OSError:
            return None
        for stage, path in self._artifacts.items():  # in pipeline order
            for other in path.rglob("*"):
                with contextlib.suppress(OSError):
                    o = other.stat()
                    if (o.st_dev, o.st_ino) == (st.st_dev, st.st_ino):
                        return stage
        return None

    def _check(self, file: Path, sha: str | None) -> str | None:
        try:
            st = file.stat()
        except OSError:
            return "is missing"
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, sha or "")
        with _VERIFIED_LOCK:
            if ident in _VERIFIED:
                return None
        try:
            actual = sha256_file(file)
        except OSError as exc:
            return f"cannot be read ({exc.strerror or exc})"
        self.bytes_hashed += st.st_size
        if actual != sha:
            return "no longer holds the bytes it was built with"
        with _VERIFIED_LOCK:
            _VERIFIED.add(ident)
        return None


def _read_outputs(stage: str, path: Path) -> list[dict]:
    """The manifest's outputs of `path` that an engine reads (the stat check already passed)."""
    patterns = ENGINE_READS.get(stage, ("*",))
    outputs = json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("outputs", [])
    return [
        out
        for out in outputs
        if any(fnmatch.fnmatch(out["path"], p) for p in patterns)
        and not any(fnmatch.fnmatch(out["path"], p) for p in _NOT_READ)
    ]
