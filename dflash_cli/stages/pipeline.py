"""The stage graph: `build()` runs each stage unless its artifact is already cached.

A stage's key hashes its version, the recipe fields it reads (`key_fields`), its upstream keys in
order and the tool versions, so a change to an irrelevant field rebuilds nothing and a change to
a relevant one rebuilds that stage and, through the upstream keys, everything after it.
"""

from __future__ import annotations

import errno
import functools
import importlib
import importlib.util
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflash_cli.cache.locks import ArtifactHold
from dflash_cli.cache.store import Cache, CorruptArtifactError, compute_key, known_digests
from dflash_cli.errors import CacheError, DFlashError, InputVanishedError
from dflash_cli.host.memory import peak_rss_bytes, release_memory
from dflash_cli.host.versions import key_versions, tool_versions
from dflash_cli.stages.base import Stage, StageContext

# Build order. A stage module `dflash_cli.stages.<name>` exposes a module-level `STAGE`; names
# whose module does not exist yet are skipped so the pipeline works while stages are being added.
STAGE_NAMES: tuple[str, ...] = ("convert", "inject", "export", "compile")


@functools.cache
def default_stages() -> tuple[Stage, ...]:
    """The shipped stages, in order (imported on first use; stage modules import torch lazily)."""
    stages = []
    for name in STAGE_NAMES:
        module_name = f"dflash_cli.stages.{name}"
        if importlib.util.find_spec(module_name) is None:
            continue
        stages.append(importlib.import_module(module_name).STAGE)
    return tuple(stages)


def __getattr__(name: str) -> Any:
    # `pipeline.STAGES` is computed on first access so importing this module stays cheap.
    if name == "STAGES":
        return list(default_stages())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class StageResult:
    name: str
    status: Literal["built", "cached"]
    key: str
    seconds: float  # time spent in this invocation (lookup only, when cached)
    path: Path
    size: int  # bytes of the artifact's outputs
    peak_rss_bytes: int = 0  # this process's peak resident memory when the stage finished
    new_bytes: int = 0  # bytes the artifact added to the disk (not hard-linked from upstream or the checkpoint)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "key": self.key,
            "seconds": round(self.seconds, 3),
            "path": str(self.path),
            "size": self.size,
            "peak_rss_bytes": self.peak_rss_bytes,
            "new_bytes": self.new_bytes,
        }


@dataclass
class BuildResult:
    recipe: str
    stages: list[StageResult] = field(default_factory=list)
    # With build(hold=True): shared locks on the artifacts, so `dflash cache clean` leaves them alone
    # until release() (or until this result is garbage collected).
    holds: list[ArtifactHold] = field(default_factory=list, repr=False, compare=False)

    def path(self, stage: str) -> Path:
        return next(s.path for s in self.stages if s.name == stage)

    def release(self) -> None:
        for held in self.holds:
            held.release()
        self.holds.clear()

    def __enter__(self) -> BuildResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "stages": [s.to_dict() for s in self.stages]}


@dataclass(frozen=True)
class BuildEvent:
    """Progress for a renderer: `start` / `message` / `wait` / `done` for stage `index` of `total`."""

    kind: Literal["start", "message", "wait", "done"]
    stage: str
    index: int
    total: int
    message: str = ""
    result: StageResult | None = None


ProgressCallback = Callable[[BuildEvent], None]


@dataclass(frozen=True)
class PlannedStage:
    stage: Stage
    key: str
    fields: dict[str, Any]
    upstream: dict[str, str]  # upstream stage name -> key, in the stage's declared order


def plan(recipe: Any, stages: Sequence[Stage] | None = None) -> list[PlannedStage]:
    """Compute every stage's key without building anything."""
    stages = _resolve_stages(stages)
    keys: dict[str, str] = {}
    planned = []
    for stage in stages:
        missing = [u for u in stage.upstream if u not in keys]
        if missing:
            raise RuntimeError(f"stage {stage.name} needs {missing}, which come later or are not registered")
        fields = stage.key_fields(recipe)
        upstream = {u: keys[u] for u in stage.upstream}
        payload = {
            "stage": stage.name,
            "stage_version": stage.version,
            "fields": fields,
            "upstream": list(upstream.values()),
            "tools": key_versions(getattr(stage, "tools", None)),
        }
        keys[stage.name] = compute_key(payload)
        planned.append(PlannedStage(stage, keys[stage.name], fields, upstream))
    return planned


def stage_keys(recipe: Any, stages: Sequence[Stage] | None = None) -> dict[str, str]:
    return {p.stage.name: p.key for p in plan(recipe, stages)}


def build(
    recipe: Any,
    cache: Cache,
    *,
    upto: str | None = None,
    force: bool = False,
    rebuild: Collection[str] = frozenset(),
    progress: ProgressCallback | None = None,
    stages: Sequence[Stage] | None = None,
    hold: bool = False,
) -> BuildResult:
    """Run every stage (up to and including `upto`) whose artifact is not cached.

    `force` rebuilds every stage. `rebuild` names stages to rebuild; because a rebuilt stage's key
    does not change, downstream stages would otherwise be reused as-is, so the earliest named stage
    and everything after it are rebuilt. Each artifact is held (a shared lock `clean` respects) from
    before its lookup until the build returns; with `hold`, until the result's release().
    """
    all_stages = _resolve_stages(stages)
    names = [s.name for s in all_stages]
    for name in ([upto] if upto else []) + sorted(rebuild):
        _check_stage_name(name, names)
    selected = all_stages[: names.index(upto) + 1] if upto else all_stages
    first_rebuild = min((names.index(n) for n in rebuild), default=len(names))
    emit = progress or (lambda event: None)

    planned = plan(recipe, selected)
    cache.ensure_writable()
    result = BuildResult(recipe=recipe.name)
    try:
        _build_all(recipe, cache, planned, result, emit, force=force, first_rebuild=first_rebuild)
    finally:
        if not hold:
            result.release()
    return result


def _build_all(
    recipe: Any,
    cache: Cache,
    planned: list[PlannedStage],
    result: BuildResult,
    emit: ProgressCallback,
    *,
    force: bool,
    first_rebuild: int,
) -> None:
    paths: dict[str, Path] = {}
    for index, item in enumerate(planned):
        events = _Emitter(emit, item.stage.name, index, len(planned))
        events("start")
        t0 = time.perf_counter()
        result.holds.append(cache.hold(item.stage.name, item.key))
        status, path = _build_one(item, recipe, cache, paths, events, must_build=force or index >= first_rebuild)
        paths[item.stage.name] = path
        entry = cache.entry(item.stage.name, item.key)
        if status == "built":
            release_memory()
        stage_result = StageResult(
            item.stage.name,
            status,
            item.key,
            time.perf_counter() - t0,
            path,
            entry.size if entry else 0,
            peak_rss_bytes(),
            entry.new_bytes if entry else 0,
        )
        result.stages.append(stage_result)
        events("done", status, stage_result)


def artifact_path(recipe: Any, cache: Cache, stage: str, stages: Sequence[Stage] | None = None) -> Path:
    """The published artifact of `stage` for this recipe; CacheError naming the build command if absent."""
    return artifact_paths(recipe, cache, [stage], stages)[stage]


def artifact_paths(
    recipe: Any,
    cache: Cache,
    wanted: Sequence[str],
    stages: Sequence[Stage] | None = None,
    holds: list[ArtifactHold] | None = None,
) -> dict[str, Path]:
    """Several published artifacts from one plan (keys, and so checkpoint fingerprints, computed once).

    With `holds`, each artifact is held (a shared lock `clean` respects) before it is looked up and the
    hold appended there: the caller keeps the artifacts for as long as it keeps the holds.
    """
    all_stages = _resolve_stages(stages)
    names = [s.name for s in all_stages]
    for stage in wanted:
        _check_stage_name(stage, names)
    last = max(names.index(stage) for stage in wanted)
    keys = {item.stage.name: item.key for item in plan(recipe, all_stages[: last + 1])}
    paths = {}
    for stage in wanted:
        if holds is not None:
            holds.append(cache.hold(stage, keys[stage]))
        paths[stage] = _published(recipe, cache, stage, keys[stage])
    return paths


_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


def build_command(recipe: Any) -> str:
    ref = recipe.name
    source = getattr(recipe, "source", None)
    if source is not None and source.stem != recipe.name:
        ref = str(source)
    sets = "".join(f" --set {item}" for item in getattr(recipe, "overrides", ()))
    return f"dflash build --recipe {ref}{sets}"


def _lookup(recipe: Any, cache: Cache, stage: str, key: str) -> Path | None:
    """cache.lookup, with a damaged artifact's error naming the exact rebuild command."""
    try:
        return cache.lookup(stage, key)
    except CorruptArtifactError as exc:
        raise CorruptArtifactError(
            exc.message, hint=f"run `{build_command(recipe)} --rebuild {stage}` (`dflash cache verify` lists all)"
        ) from None


def _published(recipe: Any, cache: Cache, stage: str, key: str) -> Path:
    path = _lookup(recipe, cache, stage, key)
    if path is None:
        raise CacheError(f"stage {stage} of recipe {recipe.name} is not built", hint=f"run `{build_command(recipe)}`")
    return path


@dataclass(frozen=True)
class _Emitter:
    emit: ProgressCallback
    stage: str
    index: int
    total: int

    def __call__(self, kind: Any, message: str = "", result: StageResult | None = None) -> None:
        self.emit(BuildEvent(kind, self.stage, self.index, self.total, message, result))


def _build_one(
    item: PlannedStage,
    recipe: Any,
    cache: Cache,
    paths: dict[str, Path],
    events: _Emitter,
    *,
    must_build: bool,
) -> tuple[Literal["built", "cached"], Path]:
    name, key = item.stage.name, item.key
    path = None if must_build else _lookup(recipe, cache, name, key)
    if path is not None:
        return "cached", path
    with cache.lock(name, key, on_wait=lambda: events("wait", "waiting for another build of this stage")):
        # Another process may have published it while we waited for the lock.
        path = None if must_build else _lookup(recipe, cache, name, key)
        if path is not None:
            return "cached", path
        # Whatever sits at the final path (a crash leftover, or the artifact `--rebuild` replaces) stays
        # until the new one is complete: publish swaps it out, so an interrupted rebuild loses nothing.
        try:
            with cache.staging(name, key) as tmp:
                inputs = {u: paths[u] for u in item.upstream}
                ctx = StageContext(
                    recipe=recipe,
                    out_dir=tmp,
                    inputs=inputs,
                    progress=lambda m: events("message", m),
                )
                t0 = time.perf_counter()
                try:
                    facts = item.stage.run(ctx) or {}
                    # A stage that skipped a file which vanished (an `is_file()` test) would publish an
                    # incomplete artifact: its inputs must still be whole now.
                    vanished = _vanished(recipe, cache, item, tmp)
                    if vanished is not None:
                        raise vanished
                    manifest = {
                        "recipe": recipe.name,
                        "stage_version": item.stage.version,
                        "inputs": item.fields,
                        "upstream": item.upstream,
                        "versions": tool_versions(),
                        "facts": facts,
                    }
                    upstream = [
                        e.manifest for u in item.upstream if (e := cache.entry(u, item.upstream[u])) and e.manifest
                    ]
                    path, _ = cache.publish(tmp, name, key, manifest, time.perf_counter() - t0, known_digests(upstream))
                except InputVanishedError:
                    raise
                except Exception as exc:
                    # Removed by hand (rm -rf) while the stage read it: one error line, not a library's traceback.
                    vanished = _vanished(recipe, cache, item, tmp, exc)
                    if vanished is None:
                        raise
                    raise vanished from exc
        except OSError as exc:
            if exc.errno not in _DISK_ERRORS:
                raise
            raise CacheError(
                f"{name}: {exc.strerror} while writing into {cache.root} (nothing was published)",
                hint="free disk space (`dflash cache clean --older-than 7d`) or pass --cache-dir on a larger disk",
            ) from None
    return "built", path


def _vanished(
    recipe: Any, cache: Cache, item: PlannedStage, tmp: Path, exc: BaseException | None = None
) -> InputVanishedError | None:
    """The error to raise when what a running stage reads or writes disappeared (an upstream artifact, its
    working directory, or with `exc` any file not found), None when nothing did."""
    name = item.stage.name
    command = build_command(recipe)
    for upstream, key in item.upstream.items():
        problem, has_manifest = cache.damage(upstream, key)
        if problem is not None:
            what = "was removed" if problem == "missing" else f"was removed or damaged ({problem})"
            return InputVanishedError(
                f"{name} stopped: its input, the {upstream} artifact {key[:12]}, {what} while it ran "
                "(nothing was published)",
                hint=f"rebuild: {command}" + (f" --rebuild {upstream}" if has_manifest else ""),
            )
    if not tmp.is_dir():
        return InputVanishedError(
            f"{name} stopped: its working directory {tmp} was removed while it ran (nothing was published)",
            hint=f"rebuild: {command}",
        )
    if isinstance(exc, FileNotFoundError):
        return InputVanishedError(
            f"{name} stopped: {exc.filename or exc} vanished while it ran (nothing was published)",
            hint=f"rebuild: {command}",
        )
    return None


def _resolve_stages(stages: Sequence[Stage] | None) -> list[Stage]:
    return list(stages) if stages is not None else list(default_stages())


def _check_stage_name(name: str, names: list[str]) -> None:
    if name not in names:
        raise DFlashError(f"unknown stage {name!r}", hint=f"stages: {', '.join(names) or 'none registered'}")
