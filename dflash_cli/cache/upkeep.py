"""`dflash cache verify` and `clean`: re-hash every artifact; remove artifacts (all, or older ones) that
nothing holds, and stale tmp dirs."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dflash_cli.cache.hashing import sha256_file
from dflash_cli.cache.locks import claim, forget
from dflash_cli.cache.store import Cache, Entry


@dataclass
class VerifyReport:
    entry: Entry
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class InUse:
    """An artifact `clean` left alone: a build or an engine holds it (`pids`: its holders, when known)."""

    entry: Entry
    pids: tuple[int, ...] = ()


@dataclass
class CleanReport:
    removed: list[Entry] = field(default_factory=list)
    bytes_freed: int = 0
    tmp_removed: int = 0
    in_use: list[InUse] = field(default_factory=list)


def verify(cache: Cache, progress: Callable[[Entry], None] | None = None) -> list[VerifyReport]:
    """Re-hash every output of every artifact; report missing, resized and modified files."""
    reports = []
    for entry in cache.entries():
        if progress is not None:
            progress(entry)
        report = VerifyReport(entry)
        if entry.manifest is None:
            report.problems.append(entry.problem or "no manifest")
            reports.append(report)
            continue
        for out in entry.manifest.get("outputs", []):
            file = entry.path / out["path"]
            if not file.is_file():
                report.problems.append(f"missing: {out['path']}")
            elif file.stat().st_size != out.get("size"):
                report.problems.append(f"size changed: {out['path']}")
            elif sha256_file(file) != out.get("sha256"):
                report.problems.append(f"contents changed: {out['path']}")
        reports.append(report)
    return reports


def clean(cache: Cache, older_than_s: float | None = None, dry_run: bool = False) -> CleanReport:
    """Remove artifacts (all, or those created more than `older_than_s` ago) and stale tmp dirs.

    An artifact that a running build or engine holds (`hold`), or that a build is replacing, is skipped
    and listed in `in_use`. Each other one is renamed into one trash dir under its exclusive lock.
    """
    report = CleanReport()
    trash: Path | None = None
    try:
        for n, entry in enumerate(cache.entries()):
            if older_than_s is not None and entry.age_s < older_than_s:
                continue
            with _claim(cache, entry) as busy:
                if busy is not None:
                    report.in_use.append(busy)
                    continue
                if dry_run:
                    report.removed.append(entry)
                    continue
                if trash is None:
                    cache.tmp_dir.mkdir(parents=True, exist_ok=True)
                    trash = Path(tempfile.mkdtemp(prefix="trash-", dir=cache.tmp_dir))
                with contextlib.suppress(FileNotFoundError):  # unless another clean removed it meanwhile
                    os.rename(entry.path, trash / f"{n}-{entry.key}")
                    report.removed.append(entry)
                forget(*_lock_files(cache, entry.stage, entry.key))
        # A file hard-linked into an artifact that stays (or into the user's checkpoint) is not freed:
        # removing a directory only drops its own links, so a shared file lives on where still used.
        report.bytes_freed = freed_bytes([trash] if trash else [e.path for e in report.removed])
    finally:
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    if not dry_run:
        report.tmp_removed = cache.clean_stale_tmp()
        _forget_orphan_locks(cache)
    return report


def _lock_files(cache: Cache, stage: str, key: str) -> tuple[Path, Path]:
    return cache.use_lock(stage, key), cache.locks_dir / f"{stage}-{key}.lock"


def _forget_orphan_locks(cache: Cache) -> None:
    """Delete the lock files of keys that have no artifact (removed, or a build that never finished) and
    that nobody holds: they would otherwise pile up, two per key ever built."""
    if not cache.locks_dir.is_dir():
        return
    keys = {p.name.rsplit(".", 1)[0] for p in cache.locks_dir.glob("*-*.*") if p.suffix in (".use", ".lock")}
    for name in sorted(keys):
        stage, _, key = name.rpartition("-")
        if cache.path_for(stage, key).exists():
            continue
        use, build = _lock_files(cache, stage, key)
        with claim(use, build) as busy:
            if busy is None and not cache.path_for(stage, key).exists():
                forget(use, build)


@contextlib.contextmanager
def _claim(cache: Cache, entry: Entry) -> Iterator[InUse | None]:
    """Yields None when `entry` is claimed for removal, else who holds it."""
    with claim(*_lock_files(cache, entry.stage, entry.key)) as holders:
        yield None if holders is None else InUse(entry, holders)


def freed_bytes(paths: list[Path]) -> int:
    """Bytes that removing `paths` frees: inodes all of whose hard links are inside them."""
    links: dict[tuple[int, int], list[int]] = {}
    for root in paths:
        for p in root.rglob("*"):
            with contextlib.suppress(OSError):
                if p.is_file() and not p.is_symlink():
                    st = p.stat()
                    entry = links.setdefault((st.st_dev, st.st_ino), [0, st.st_nlink, st.st_size])
                    entry[0] += 1
    return sum(size for seen, nlink, size in links.values() if seen >= nlink)
