"""`dflash cache clean` while a build or run reads the cache: what is held stays; what vanishes anyway
(rm -rf by hand) stops the build with one error line, never a traceback or a published artifact."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dflash_cli.cache.store import Cache
from dflash_cli.cache.upkeep import clean as clean_cache
from dflash_cli.cli.app import create_app
from dflash_cli.recipe.schema import Recipe
from dflash_cli.stages import pipeline
from dflash_cli.stages.base import StageContext
from dflash_cli.stages.pipeline import artifact_paths, build

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def publish(cache: Cache, stage: str, key: str) -> Path:
    with cache.lock(stage, key), cache.staging(stage, key) as tmp:
        (tmp / "out.bin").write_bytes(stage.encode() * 100)
        path, _ = cache.publish(tmp, stage, key, {"recipe": "tiny"}, seconds=0.1)
    return path


def clean(root: Path, *args: str) -> Any:
    return runner.invoke(create_app(), ["cache", "clean", "--cache-dir", str(root), *args])


@pytest.mark.parametrize("how", [["--yes"], ["--older-than", "0s"]])
def test_clean_skips_an_artifact_held_by_a_reader(tmp_path: Path, how: list[str]) -> None:
    cache = Cache(tmp_path)
    held, free = publish(cache, "export", "a" * 64), publish(cache, "convert", "b" * 64)
    with cache.hold("export", "a" * 64):
        result = clean(tmp_path, *how)
        assert result.exit_code == 0, result.output
        assert held.is_dir() and not free.is_dir()
        assert "removed 1 artifact(s)" in result.stderr
        assert "skipped 1 artifact(s) in use by a running build or run" in result.stderr
        assert "export aaaaaaaaaaaa" in result.stderr
        dry = clean(tmp_path, "--dry-run", "--json")
        assert json.loads(dry.stdout)["in_use"][0]["key"] == "a" * 64 and held.is_dir()
    again = clean(tmp_path, *how)
    assert again.exit_code == 0 and "removed 1 artifact(s)" in again.stderr and "skipped" not in again.stderr
    assert not held.exists() and cache.entries() == []


def test_clean_names_the_holding_process_and_a_dead_holder_blocks_nothing(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    held = publish(cache, "compile", "c" * 64)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import sys
                from dflash_cli.cache.store import Cache
                hold = Cache({str(tmp_path)!r}).hold("compile", {"c" * 64!r})
                print("held", flush=True)
                sys.stdin.read()
            """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        result = clean(tmp_path, "--yes", "--json")
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert doc["removed"] == [] and held.is_dir()
        [busy] = doc["in_use"]
        assert busy["stage"] == "compile" and busy["pids"] == [holder.pid]
        assert f"(pid {holder.pid})" in clean(tmp_path, "--yes").stderr
    finally:
        holder.kill()  # a killed build: the kernel drops its lock
        holder.wait()
    assert "removed 1 artifact(s)" in clean(tmp_path, "--yes").stderr and not held.exists()


def test_clean_skips_an_artifact_a_build_is_producing(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    stale = publish(cache, "inject", "d" * 64)
    with cache.lock("inject", "d" * 64):  # a --rebuild of it runs: its publish will swap this one out
        assert [u.entry.key for u in clean_cache(cache).in_use] == ["d" * 64] and stale.is_dir()


def test_clean_removes_the_lock_files_of_what_it_removes(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    for stage, key in (("convert", "a" * 64), ("inject", "b" * 64), ("export", "c" * 64)):
        publish(cache, stage, key)
        cache.hold(stage, key).release()  # a run that read it: its .use file stays behind
    (cache.locks_dir / f"compile-{'e' * 64}.lock").touch()  # a build killed before it published
    held = publish(cache, "compile", "f" * 64)
    with cache.hold("compile", "f" * 64):
        assert clean(tmp_path, "--yes").exit_code == 0
        left = sorted(p.name for p in cache.locks_dir.iterdir())
        assert left == [f"compile-{'f' * 64}.lock", f"compile-{'f' * 64}.use"] and held.is_dir()
    assert clean(tmp_path, "--yes").exit_code == 0
    assert list(cache.locks_dir.iterdir()) == [] and cache.entries() == []


def test_a_reader_waiting_while_clean_deletes_the_lock_file_locks_the_new_one(tmp_path: Path) -> None:
    import fcntl
    import threading

    from dflash_cli.cache.locks import claim, forget

    cache = Cache(tmp_path)
    use, build = cache.use_lock("export", "a" * 64), cache.locks_dir / f"export-{'a' * 64}.lock"
    got = []
    with claim(use, build) as busy:
        assert busy is None
        reader = threading.Thread(target=lambda: got.append(cache.hold("export", "a" * 64)))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive()  # blocked on the claimed (old) lock file
        forget(use, build)
    reader.join(10)
    [hold] = got
    # The reader holds the file the path names now, so a second clean sees it as busy.
    fd = os.open(use, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
        hold.release()


# --- a real pipeline run with fake stages -----------------------------------------------------------


class Stage:
    def __init__(self, name: str, upstream: tuple[str, ...] = (), during=None) -> None:
        self.name, self.upstream, self.version, self.during = name, upstream, 1, during

    def key_fields(self, recipe: Any) -> dict[str, Any]:
        return {}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        if self.during is not None:
            self.during(ctx)
        parts = [(ctx.inputs[u] / "out.txt").read_text() for u in self.upstream]
        (ctx.out_dir / "out.txt").write_text(f"{self.name}({','.join(parts)})")
        return {}


RECIPE = Recipe.model_validate({"name": "tiny", "family": "qwen3", "target": {"path": "t"}, "draft": {"path": "d"}})


def test_clean_during_a_build_spares_what_the_build_reads(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    reports = []
    stages = [
        Stage("convert"),
        Stage("inject", ("convert",), during=lambda ctx: reports.append(clean_cache(Cache(tmp_path)))),
        Stage("export", ("inject",)),
    ]
    result = build(RECIPE, cache, stages=stages)  # the clean ran inside inject, after convert was published
    assert (result.path("export") / "out.txt").read_text() == "export(inject(convert()))"
    assert reports[0].removed == [] and [u.entry.stage for u in reports[0].in_use] == ["convert"]
    assert os.getpid() in reports[0].in_use[0].pids

    # Once the build has returned it holds nothing; with hold=True it holds until release().
    held = build(RECIPE, cache, stages=stages[:1] + [Stage("inject", ("convert",))], hold=True)
    report = clean_cache(cache)  # export is not part of that build: nothing holds it
    assert {u.entry.stage for u in report.in_use} == {"convert", "inject"}
    assert [e.stage for e in report.removed] == ["export"]
    held.release()
    assert len(clean_cache(cache).removed) == 2 and cache.entries() == []


def test_artifact_paths_can_hold_what_they_return(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    stages = [Stage("convert"), Stage("inject", ("convert",))]
    build(RECIPE, cache, stages=stages)
    holds: list = []
    paths = artifact_paths(RECIPE, cache, ["inject"], stages=stages, holds=holds)
    report = clean_cache(cache)
    assert [u.entry.stage for u in report.in_use] == ["inject"] and [e.stage for e in report.removed] == ["convert"]
    assert paths["inject"].is_dir()
    for held in holds:
        held.release()
    assert [e.stage for e in clean_cache(cache).removed] == ["inject"]


# --- inputs removed by hand while a stage runs -------------------------------------------------------


def _remove_input(ctx: StageContext) -> None:
    shutil.rmtree(ctx.inputs["convert"])


def _remove_one_file(ctx: StageContext) -> None:
    (ctx.inputs["convert"] / "out.txt").unlink()


def _library_wraps_it(ctx: StageContext) -> None:
    shutil.rmtree(ctx.inputs["convert"])
    raise OSError(f"Repo id must be in the form 'repo_name': '{ctx.inputs['convert']}'")  # transformers' way


def _skips_it_quietly(ctx: StageContext) -> None:
    shutil.rmtree(ctx.inputs["convert"])
    (ctx.out_dir / "out.txt").write_text("incomplete")  # and reads nothing: only the check before publish notices


def _remove_workdir(ctx: StageContext) -> None:
    shutil.rmtree(ctx.out_dir)


class QuietStage(Stage):
    def run(self, ctx: StageContext) -> dict[str, Any]:
        self.during(ctx)
        return {}


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "tiny.yaml").write_text("name: tiny\nfamily: qwen3\ntarget: {path: t}\ndraft: {path: d}\n")
    monkeypatch.setenv("DFLASH_RECIPES_DIR", str(recipes))
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    return tmp_path / "cache"


@pytest.mark.parametrize(
    ("during", "words", "hint"),
    [
        (_remove_input, "its input, the convert artifact", "hint: rebuild: dflash build --recipe tiny\n"),
        (_remove_one_file, "was removed or damaged (missing output out.txt)", "--rebuild convert"),
        (_library_wraps_it, "its input, the convert artifact", "hint: rebuild: dflash build --recipe tiny\n"),
        (_skips_it_quietly, "its input, the convert artifact", "hint: rebuild: dflash build --recipe tiny\n"),
        (_remove_workdir, "its working directory", "hint: rebuild: dflash build --recipe tiny\n"),
    ],
)
def test_a_vanished_input_is_one_error_line(cli_env: Path, monkeypatch: pytest.MonkeyPatch, during, words, hint):
    inject = (QuietStage if during is _skips_it_quietly else Stage)("inject", ("convert",), during=during)
    monkeypatch.setattr(pipeline, "default_stages", lambda: (Stage("convert"), inject))
    result = runner.invoke(create_app(), ["build", "-r", "tiny", "--cache-dir", str(cli_env)])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # handled, not a crash
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: inject stopped: ") and words in errors[0]
    assert "(nothing was published)" in errors[0] and hint in result.stderr
    assert "Traceback" not in result.output
    assert "inject" not in {e.stage for e in Cache(cli_env).entries()}  # nothing was published
    # The hint's command recovers.
    monkeypatch.setattr(pipeline, "default_stages", lambda: (Stage("convert"), Stage("inject", ("convert",))))
    again = runner.invoke(create_app(), ["build", "-r", "tiny", "--cache-dir", str(cli_env), "--rebuild", "convert"])
    assert again.exit_code == 0, again.output


def test_an_ordinary_stage_failure_is_not_called_a_vanished_input(tmp_path: Path) -> None:
    def fail(ctx: StageContext) -> None:
        raise FileExistsError("a bug in the stage")

    with pytest.raises(FileExistsError):
        build(RECIPE, Cache(tmp_path), stages=[Stage("convert"), Stage("inject", ("convert",), during=fail)])
