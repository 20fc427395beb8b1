"""Pipeline mechanics with fake stages: caching, key propagation, rebuilds, crashes, SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dflash_cli.cache.store import Cache
from dflash_cli.errors import CacheError, DFlashError
from dflash_cli.recipe.schema import Recipe
from dflash_cli.stages import pipeline
from dflash_cli.stages.base import StageContext
from dflash_cli.stages.pipeline import artifact_path, build, stage_keys

RECIPE = {"name": "tiny", "family": "qwen3", "target": {"path": "t"}, "draft": {"path": "d"}}


def make_recipe(**sections: dict[str, Any]) -> Recipe:
    return Recipe.model_validate({**RECIPE, **sections})


def dotted(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


class FakeStage:
    """Writes `<name>(<upstream outputs>)` to out.txt; key_fields are the recipe fields it `reads`."""

    def __init__(self, name: str, upstream: tuple[str, ...] = (), reads: tuple[str, ...] = (), fail: bool = False):
        self.name, self.upstream, self.reads, self.fail = name, upstream, reads, fail
        self.version = 1
        self.calls = 0

    def key_fields(self, recipe: Any) -> dict[str, Any]:
        return {r: dotted(recipe, r) for r in self.reads}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        self.calls += 1
        ctx.progress("working")
        (ctx.out_dir / "partial.bin").write_bytes(b"x" * 10)
        if self.fail:
            raise RuntimeError(f"{self.name} failed")
        parts = ",".join((ctx.inputs[u] / "out.txt").read_text() for u in self.upstream)
        (ctx.out_dir / "out.txt").write_text(f"{self.name}({parts})")
        return {"calls": self.calls}


def fake_stages() -> list[FakeStage]:
    return [
        FakeStage("convert", reads=("family", "target.path", "draft.path", "dflash.block_size")),
        FakeStage("inject", upstream=("convert",)),
        FakeStage("export", upstream=("inject",), reads=("export.ctx_len", "export.prefill_seq_len")),
        FakeStage("compile", upstream=("export",), reads=("compile.backend",)),
    ]


def test_second_build_is_all_cached(tmp_path: Path) -> None:
    stages = fake_stages()
    cache = Cache(tmp_path)
    first = build(make_recipe(), cache, stages=stages)
    assert [s.status for s in first.stages] == ["built"] * 4
    assert (first.path("compile") / "out.txt").read_text() == "compile(export(inject(convert())))"
    second = build(make_recipe(), cache, stages=stages)
    assert [s.status for s in second.stages] == ["cached"] * 4
    assert [s.calls for s in stages] == [1, 1, 1, 1]
    assert [s.key for s in first.stages] == [s.key for s in second.stages]
    assert all(s.size > 0 for s in second.stages)
    doc = second.to_dict()
    assert doc["recipe"] == "tiny" and set(doc["stages"][0]) >= {"name", "status", "key", "seconds", "path"}


def test_irrelevant_field_changes_no_key() -> None:
    stages = fake_stages()
    base = stage_keys(make_recipe(), stages)
    assert stage_keys(make_recipe(run={"max_new_tokens": 7, "temperature": 0.5}), stages) == base


def test_block_size_changes_convert_and_everything_after() -> None:
    stages = fake_stages()
    base = stage_keys(make_recipe(), stages)
    changed = stage_keys(make_recipe(dflash={"block_size": 16}), stages)
    assert all(base[name] != changed[name] for name in base)


def test_export_field_changes_only_export_and_after() -> None:
    stages = fake_stages()
    base = stage_keys(make_recipe(), stages)
    changed = stage_keys(make_recipe(export={"ctx_len": 2048}), stages)
    assert [base[n] == changed[n] for n in base] == [True, True, False, False]


def test_stage_version_is_part_of_the_key() -> None:
    stages = fake_stages()
    base = stage_keys(make_recipe(), stages)
    stages[1].version = 2
    changed = stage_keys(make_recipe(), stages)
    assert [base[n] == changed[n] for n in base] == [True, False, False, False]


def test_upto_rebuild_and_force(tmp_path: Path) -> None:
    stages = fake_stages()
    cache = Cache(tmp_path)
    assert [s.name for s in build(make_recipe(), cache, upto="inject", stages=stages).stages] == ["convert", "inject"]
    result = build(make_recipe(), cache, rebuild={"export"}, stages=stages)
    assert [s.status for s in result.stages] == ["cached", "cached", "built", "built"]
    result = build(make_recipe(), cache, rebuild={"inject"}, stages=stages)
    assert [s.status for s in result.stages] == ["cached", "built", "built", "built"]
    result = build(make_recipe(), cache, force=True, stages=stages)
    assert [s.status for s in result.stages] == ["built"] * 4
    assert [s.calls for s in stages] == [2, 3, 3, 3]


def test_unknown_stage_name(tmp_path: Path) -> None:
    with pytest.raises(DFlashError) as exc:
        build(make_recipe(), Cache(tmp_path), rebuild={"exprot"}, stages=fake_stages())
    assert exc.value.message == "unknown stage 'exprot'"
    assert exc.value.hint == "stages: convert, inject, export, compile"


def test_progress_events(tmp_path: Path) -> None:
    events: list[tuple[str, str, str]] = []
    build(
        make_recipe(),
        Cache(tmp_path),
        upto="inject",
        stages=fake_stages(),
        progress=lambda e: events.append((e.kind, e.stage, e.message)),
    )
    assert events == [
        ("start", "convert", ""),
        ("message", "convert", "working"),
        ("done", "convert", "built"),
        ("start", "inject", ""),
        ("message", "inject", "working"),
        ("done", "inject", "built"),
    ]


def test_manifest_records_inputs_upstream_and_versions(tmp_path: Path) -> None:
    result = build(make_recipe(), Cache(tmp_path), upto="inject", stages=fake_stages())
    manifest = json.loads((result.path("inject") / "manifest.json").read_text())
    assert manifest["recipe"] == "tiny" and manifest["stage_version"] == 1
    assert manifest["upstream"] == {"convert": result.stages[0].key}
    assert set(manifest["versions"]) == {"dflash", "torch", "transformers", "onnx", "onnxruntime"}
    assert manifest["facts"] == {"calls": 1}


def test_failed_stage_publishes_nothing_and_cleans_tmp(tmp_path: Path) -> None:
    stages = fake_stages()
    stages[1].fail = True
    cache = Cache(tmp_path)
    with pytest.raises(RuntimeError, match="inject failed"):
        build(make_recipe(), cache, stages=stages)
    assert [e.stage for e in cache.entries()] == ["convert"]
    assert list(cache.tmp_dir.iterdir()) == []
    stages[1].fail = False
    assert [s.status for s in build(make_recipe(), cache, stages=stages).stages] == ["cached"] + ["built"] * 3


def test_artifact_path(tmp_path: Path) -> None:
    stages = fake_stages()
    cache = Cache(tmp_path)
    with pytest.raises(CacheError) as exc:
        artifact_path(make_recipe(), cache, "export", stages=stages)
    assert exc.value.message == "stage export of recipe tiny is not built"
    assert exc.value.hint == "run `dflash build --recipe tiny`"
    result = build(make_recipe(), cache, stages=stages)
    assert artifact_path(make_recipe(), cache, "export", stages=stages) == result.path("export")


def test_default_stages_are_lazy_and_light() -> None:
    # Importing the pipeline and listing its stages must not drag in torch/onnx/transformers.
    code = (
        "import sys; from dflash_cli.stages import pipeline; names = [s.name for s in pipeline.STAGES]; "
        "heavy = [m for m in ('torch', 'onnx', 'transformers', 'onnxruntime') if m in sys.modules]; "
        "print(names, heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    names, heavy = out.rsplit("] [", 1)
    assert names.startswith("['convert', 'inject'")
    assert heavy.strip() == "]", f"heavy modules imported at pipeline import: [{heavy}"


def test_stages_list_is_ordered() -> None:
    names = [s.name for s in pipeline.STAGES]
    assert names == [n for n in pipeline.STAGE_NAMES if n in names]


HANGING_BUILD = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from dflash_cli.cache.store import Cache
    from dflash_cli.stages.pipeline import build
    from dflash_cli.recipe.schema import Recipe

    class Hang:
        name, version, upstream = "convert", 1, ()
        def key_fields(self, recipe):
            return {"family": recipe.family, "target.path": recipe.target.path,
                    "draft.path": recipe.draft.path, "dflash.block_size": recipe.dflash.block_size}
        def run(self, ctx):
            (ctx.out_dir / "out.txt").write_text("half-written")
            Path(sys.argv[2]).write_text("started")
            time.sleep(120)
            return {}

    build(Recipe.model_validate(json.loads(sys.argv[3])), Cache(sys.argv[1]), stages=[Hang()])
    """
)


def test_sigkill_mid_stage_then_rebuild_succeeds(tmp_path: Path) -> None:
    cache_root, marker = tmp_path / "cache", tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", HANGING_BUILD, str(cache_root), str(marker), json.dumps(RECIPE)])
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, "the build subprocess exited early"
            assert time.monotonic() < deadline, "the build subprocess never reached its stage"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    cache = Cache(cache_root)
    key = stage_keys(make_recipe(), fake_stages()[:1])["convert"]
    assert cache.lookup("convert", key) is None
    assert not cache.path_for("convert", key).exists()  # only a tmp dir, never a published artifact
    assert [p.name.startswith(f"convert-{key}-") for p in cache.tmp_dir.iterdir()] == [True]

    result = build(make_recipe(), cache, stages=fake_stages()[:1])
    assert result.stages[0].status == "built" and result.stages[0].key == key
    assert (result.path("convert") / "out.txt").read_text() == "convert()"
    assert list(cache.tmp_dir.iterdir()) == []  # the killed build's leftover was swept


def test_corrupt_published_artifact_is_rebuilt(tmp_path: Path) -> None:
    stages = fake_stages()[:1]
    cache = Cache(tmp_path)
    path = build(make_recipe(), cache, stages=stages).path("convert")
    (path / "manifest.json").write_text("{")
    result = build(make_recipe(), cache, stages=stages)
    assert result.stages[0].status == "built" and stages[0].calls == 2
    assert cache.lookup("convert", result.stages[0].key) == path


def test_real_stage_keys_follow_the_fields_they_read(tiny_qwen3_pair: Any) -> None:
    """The shipped stages: run settings change no key; block_size changes convert and all after it."""
    pair = {"target": {"path": str(tiny_qwen3_pair.target_dir)}, "draft": {"path": str(tiny_qwen3_pair.draft_dir)}}
    base = stage_keys(make_recipe(**pair))
    assert list(base)[:2] == ["convert", "inject"]
    assert stage_keys(make_recipe(**pair, run={"max_new_tokens": 7, "seed": 3})) == base
    changed = stage_keys(make_recipe(**pair, dflash={"block_size": 8}))
    assert all(changed[name] != base[name] for name in base)


def test_concurrent_builds_of_one_recipe_build_once(tmp_path: Path) -> None:
    class Slow(FakeStage):
        def run(self, ctx: StageContext) -> dict[str, Any]:
            time.sleep(0.3)
            return super().run(ctx)

    stage = Slow("convert", reads=("dflash.block_size",))
    results: list[Any] = []
    events: list[str] = []

    def one() -> None:
        results.append(build(make_recipe(), Cache(tmp_path), stages=[stage], progress=lambda e: events.append(e.kind)))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert stage.calls == 1
    assert sorted(r.stages[0].status for r in results) == ["built", "cached"]
    assert "wait" in events


def test_keys_hash_only_the_tool_versions_a_stage_depends_on(tmp_path: Path, monkeypatch) -> None:
    """An onnxruntime upgrade rebuilds compile only; a torch upgrade rebuilds inject, export and compile's inputs."""
    from dflash_cli.host import versions

    real = versions.package_version
    recipe = make_recipe()

    def keys_with(**pinned: str) -> dict[str, str]:
        monkeypatch.setattr(versions, "package_version", lambda tool: pinned.get(tool) or real(tool))
        return {p.stage.name: p.key for p in pipeline.plan(recipe)}

    monkeypatch.setattr(pipeline, "_resolve_stages", lambda stages: list(_key_stages()))
    base = keys_with()
    ort = keys_with(onnxruntime="99.0")
    assert [n for n in base if base[n] != ort[n]] == ["compile"]
    torch_ = keys_with(torch="99.0")
    assert [n for n in base if base[n] != torch_[n]] == ["inject", "export", "compile"]


def _key_stages():
    """The real stages' names, upstreams and tools, with recipe-independent key fields."""
    from dflash_cli.stages.pipeline import default_stages

    for real in default_stages():
        fake = FakeStage(real.name, real.upstream)
        fake.tools = real.tools
        yield fake


def test_rebuild_keeps_the_old_artifact_until_the_new_one_is_published(tmp_path: Path) -> None:
    """An interrupted `--rebuild` (Ctrl-C mid-stage) leaves the previous artifact in place and usable."""
    stages = fake_stages()[:2]
    cache = Cache(tmp_path)
    first = build(make_recipe(), cache, stages=stages)
    stages[1].fail = True
    with pytest.raises(RuntimeError, match="inject failed"):
        build(make_recipe(), cache, stages=stages, rebuild={"inject"})
    assert cache.lookup("inject", first.stages[1].key) == first.path("inject")
    assert (first.path("inject") / "out.txt").read_text() == "inject(convert())"


def test_damaged_upstream_stops_a_rebuild_with_the_fix(tmp_path: Path) -> None:
    """`--rebuild inject` after a flip in convert's output must not build on the damaged file."""
    stages = fake_stages()[:2]
    cache = Cache(tmp_path)
    first = build(make_recipe(), cache, stages=stages)
    out = first.path("convert") / "out.txt"
    time.sleep(0.01)
    out.write_text("convXrt()")  # same size, new content
    with pytest.raises(CacheError, match="convert artifact .* is damaged") as exc:
        build(make_recipe(), cache, stages=stages, rebuild={"inject"})
    assert "--rebuild convert" in exc.value.hint
    assert stages[1].calls == 1  # inject did not run again on the damaged input
    fixed = build(make_recipe(), cache, stages=stages, rebuild={"convert"})
    assert (fixed.path("inject") / "out.txt").read_text() == "inject(convert())"
