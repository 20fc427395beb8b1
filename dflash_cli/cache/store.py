"""Content-addressed artifact store: `<root>/artifacts/<stage>/<key>/` plus a `manifest.json`.

A stage works in `<root>/tmp/<stage>-<key>-<random>/`; `publish()` writes the manifest last and
renames the directory into place, so a crash leaves a tmp dir, never something that looks built.
Only a directory whose manifest parses, names the same stage and key, and whose listed outputs
exist with their recorded sizes counts as a hit. A per-key file lock lets concurrent builds of
the same artifact wait for one another instead of racing.
Whoever reads a published artifact (a build reading an upstream stage, an engine serving compiled
graphs) holds it (`hold`, cache/locks.py); `clean` (cache/upkeep.py) skips what is held.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from dflash_cli.cache.hashing import sha256_file, take_fresh_digest
from dflash_cli.cache.locks import ArtifactHold, hold_shared
from dflash_cli.errors import CacheError


class CorruptArtifactError(CacheError):
    """A published artifact's file is missing or changed since it was built."""


MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_UNWRITABLE_HINT = "pass --cache-dir DIR or set DFLASH_HOME to a writable directory"


def default_root(cache_dir: str | Path | None = None) -> Path:
    """`--cache-dir`, else $DFLASH_HOME, else ~/.cache/dflash."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("DFLASH_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dflash"


def compute_key(payload: dict[str, Any]) -> str:
    """sha256 of canonical JSON: sorted keys and fixed separators make it independent of dict order."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """`30s`, `15m`, `12h`, `7d`, `2w` -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not match:
        raise CacheError(f"cannot parse age {text!r}", hint="use a number and a unit, e.g. 30m, 12h, 7d, 2w")
    return float(match.group(1)) * _AGE_UNITS[match.group(2)]


@dataclass(frozen=True)
class Entry:
    """One directory under artifacts/; `problem` is set when it is not a usable artifact."""

    stage: str
    key: str
    path: Path
    manifest: dict[str, Any] | None
    problem: str | None = None

    @property
    def recipe(self) -> str:
        return str((self.manifest or {}).get("recipe", "?"))

    @property
    def size(self) -> int:
        return sum(int(o.get("size", 0)) for o in (self.manifest or {}).get("outputs", []))

    @property
    def new_bytes(self) -> int:
        """Bytes this artifact added to the disk (its files not hard-linked from elsewhere)."""
        manifest = self.manifest or {}
        return int(manifest.get("new_bytes", self.size))

    @property
    def created(self) -> float:
        return float((self.manifest or {}).get("created_unix", 0.0)) or _mtime(self.path)

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.created)


class Cache:
    def __init__(self, root: str | Path | None = None) -> None:
        self.root = default_root(root)

    @property
    def artifacts_dir(self) -> Path:
        return self.root / "artifacts"

    @property
    def tmp_dir(self) -> Path:
        return self.root / "tmp"

    @property
    def locks_dir(self) -> Path:
        return self.root / "locks"

    def path_for(self, stage: str, key: str) -> Path:
        return self.artifacts_dir / stage / key

    # -- setup ----------------------------------------------------------------------------------

    def ensure_writable(self) -> None:
        """Create the layout and prove we can write to it; raise CacheError with a hint otherwise."""
        try:
            for d in (self.artifacts_dir, self.tmp_dir, self.locks_dir):
                d.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.tmp_dir, prefix=".probe-"):
                pass
        except OSError as exc:
            raise CacheError(
                f"cache directory {self.root} is not writable: {exc.strerror or exc}", hint=_UNWRITABLE_HINT
            ) from None

    # -- lookup ---------------------------------------------------------------------------------

    def damage(self, stage: str, key: str) -> tuple[str | None, bool]:
        """(what is wrong with the artifact at (stage, key) or None, whether its manifest is still there);
        stat-level, no hashing."""
        manifest, problem = self._check(stage, key, self.path_for(stage, key))
        return problem, manifest is not None

    def lookup(self, stage: str, key: str) -> Path | None:
        """The artifact directory if it is a complete artifact for (stage, key), else None."""
        entry = self.entry(stage, key)
        return entry.path if entry is not None else None

    def entry(self, stage: str, key: str) -> Entry | None:
        """The complete artifact for (stage, key) with its manifest, None when there is none.

        Raises CorruptArtifactError when a published artifact (complete manifest) has a file that is
        missing or changed since it was built: that is damage, never a reason to rebuild silently.
        """
        path = self.path_for(stage, key)
        manifest, problem = self._check(stage, key, path, rehash_changed=True)
        if problem is None:
            return Entry(stage, key, path, manifest)
        if manifest is not None:
            raise CorruptArtifactError(
                f"cached {stage} artifact {key[:12]} is damaged: {problem}",
                hint=f"rebuild it with `--rebuild {stage}` (`dflash cache verify` lists every damaged artifact)",
            )
        return None

    def _check(
        self, stage: str, key: str, path: Path, *, rehash_changed: bool = False
    ) -> tuple[dict[str, Any] | None, str | None]:
        """Stat-level check of an artifact; with `rehash_changed`, a file whose inode or mtime differs
        from the manifest is hashed again (cheap unless something touched it)."""
        if not path.is_dir():
            return None, "missing"
        try:
            manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None, "no readable manifest"
        if not isinstance(manifest, dict) or manifest.get("stage") != stage or manifest.get("key") != key:
            return None, "manifest does not match its directory"
        outputs = manifest.get("outputs")
        if not isinstance(outputs, list):
            return manifest, "manifest lists no outputs"
        for out in outputs:
            try:
                st = (path / out["path"]).stat()
            except (OSError, KeyError, TypeError):
                name = out.get("path") if isinstance(out, dict) else repr(out)
                return manifest, f"missing output {name}"
            if st.st_size != out.get("size"):
                return manifest, f"output {out['path']} has size {st.st_size}, manifest says {out.get('size')}"
            touched = "mtime_ns" in out and (st.st_mtime_ns, st.st_ino) != (out["mtime_ns"], out.get("inode"))
            if rehash_changed and touched and sha256_file(path / out["path"]) != out.get("sha256"):
                return manifest, f"output {out['path']} was modified after the artifact was built"
        return manifest, None

    def entries(self) -> list[Entry]:
        """Every directory under artifacts/, newest first; broken ones carry `problem`."""
        found = []
        if not self.artifacts_dir.is_dir():
            return found
        for stage_dir in sorted(p for p in self.artifacts_dir.iterdir() if p.is_dir()):
            for path in sorted(p for p in stage_dir.iterdir() if p.is_dir()):
                manifest, problem = self._check(stage_dir.name, path.name, path)
                found.append(Entry(stage_dir.name, path.name, path, manifest, problem))
        return sorted(found, key=lambda e: e.created, reverse=True)

    def size(self) -> int:
        """Bytes on disk under the root (artifacts, tmp dirs and locks)."""
        return _tree_size(self.root)

    # -- building -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, stage: str, key: str, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
        """Hold the per-key lock; `on_wait` is called once if another process holds it."""
        self.locks_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.locks_dir / f"{stage}-{key}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if on_wait is not None:
                on_wait()
            lock.acquire()
        try:
            yield
        finally:
            lock.release()

    def hold(self, stage: str, key: str) -> ArtifactHold:
        """Hold (stage, key)'s artifact for as long as it is read: `clean` skips it meanwhile. Take it
        before looking the artifact up (a `clean` removing it right then makes the lookup miss)."""
        return hold_shared(self.use_lock(stage, key))

    def use_lock(self, stage: str, key: str) -> Path:
        return self.locks_dir / f"{stage}-{key}.use"

    @contextlib.contextmanager
    def staging(self, stage: str, key: str) -> Iterator[Path]:
        """An empty tmp dir for one build of (stage, key); removed if the build raises.

        Call with the key's lock held: any other tmp dir of the same key is then a crashed build's
        leftover and is deleted first.
        """
        self._remove_tmp(f"{stage}-{key}-*")
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{stage}-{key}-", dir=self.tmp_dir))
        try:
            yield tmp
        finally:
            # After a successful publish the directory has been renamed away and this is a no-op.
            shutil.rmtree(tmp, ignore_errors=True)

    def discard(self, stage: str, key: str) -> None:
        """Remove whatever sits at the final path (a stale or forced-out artifact), atomically."""
        path = self.path_for(stage, key)
        if path.exists():
            self._trash(path)

    def publish(
        self,
        tmp: Path,
        stage: str,
        key: str,
        manifest: dict[str, Any],
        seconds: float,
        known: dict[tuple[int, int, int], str] | None = None,
    ) -> tuple[Path, dict[str, Any]]:
        """Hash every output, write the manifest last, rename tmp into place. Returns (path, manifest).

        `known` maps (inode, size, mtime_ns) to the sha256 an upstream manifest recorded: a file
        hard-linked from an upstream artifact is the same inode and is not hashed again; nor is a file
        this process wrote through a HashingWriter.
        """
        outputs = []
        for file in sorted(p for p in tmp.rglob("*") if p.is_file() and p.name != MANIFEST):
            rel = file.relative_to(tmp).as_posix()
            st = file.stat()
            ident = (st.st_ino, st.st_size, st.st_mtime_ns)
            digest = (known or {}).get(ident) or take_fresh_digest(ident) or sha256_file(file)
            outputs.append(
                {
                    "path": rel,
                    "size": st.st_size,
                    "sha256": digest,
                    "inode": st.st_ino,
                    "mtime_ns": st.st_mtime_ns,
                    "linked": st.st_nlink > 1,  # shared with an upstream artifact or the checkpoint
                }
            )
        now = time.time()
        full = {
            "format": MANIFEST_FORMAT,
            **manifest,
            "stage": stage,
            "key": key,
            "outputs": outputs,
            "new_bytes": sum(o["size"] for o in outputs if not o["linked"]),
            "seconds": round(seconds, 3),
            "created": datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds"),
            "created_unix": now,
        }
        with (tmp / MANIFEST).open("w", encoding="utf-8") as f:
            json.dump(full, f, indent=2, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        final = self.path_for(stage, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        self.discard(stage, key)
        os.rename(tmp, final)
        return final, full

    # -- maintenance ----------------------------------------------------------------------------

    def clean_stale_tmp(self) -> int:
        """Delete tmp dirs whose build is no longer running (its key's lock is free)."""
        removed = 0
        if not self.tmp_dir.is_dir():
            return removed
        for tmp in list(self.tmp_dir.iterdir()):
            if tmp.name.startswith(".probe-"):
                continue
            parts = tmp.name.rsplit("-", 2)  # <stage>-<key>-<random>; keys and randoms have no '-'
            if tmp.name.startswith("trash-") or len(parts) != 3:
                shutil.rmtree(tmp, ignore_errors=True)
                removed += 1
                continue
            lock = FileLock(str(self.locks_dir / f"{parts[0]}-{parts[1]}.lock"))
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue  # a build is using it
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                removed += 1
            finally:
                lock.release()
        return removed

    def _remove_tmp(self, pattern: str) -> None:
        if self.tmp_dir.is_dir():
            for stale in self.tmp_dir.glob(pattern):
                shutil.rmtree(stale, ignore_errors=True)

    def _trash(self, path: Path) -> None:
        # Rename first so a half-deleted directory can never be mistaken for an artifact.
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        trash = Path(tempfile.mkdtemp(prefix="trash-", dir=self.tmp_dir))
        with contextlib.suppress(FileNotFoundError):  # already gone: nothing to remove
            os.rename(path, trash / path.name)
        shutil.rmtree(trash, ignore_errors=True)


def known_digests(manifests: list[dict[str, Any]]) -> dict[tuple[int, int, int], str]:
    """(inode, size, mtime_ns) -> sha256 of every output the manifests recorded with its inode."""
    found = {}
    for manifest in manifests:
        for out in manifest.get("outputs", []):
            if "inode" in out and "mtime_ns" in out:
                found[(out["inode"], out["size"], out["mtime_ns"])] = out["sha256"]
    return found


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _tree_size(path: Path) -> int:
    """Bytes on disk under `path`, each inode once (artifacts hard-link the files they share)."""
    if not path.exists():
        return 0
    seen: set[tuple[int, int]] = set()
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file() and not p.is_symlink():
                st = p.stat()
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
    return total
