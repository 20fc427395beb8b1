"""Mistakes a user can make get one error line, one hint line and a non-zero exit, never a traceback."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_cli.cache import contents as cache_contents
from dflash_cli.cli.app import create_app
from dflash_cli.errors import GenerationError
from tests.fixtures.damage import rot_in_place

runner = CliRunner()


def run_cli(engine, *args, input: str | None = None):
    recipe = str(engine.recipe.source)
    cache = str(engine.compile_dir.parents[2])
    return runner.invoke(create_app(), ["run", "-r", recipe, "--cache-dir", cache, *args], input=input)


@pytest.mark.parametrize(
    "args",
    [
        ["--max-new-tokens", "0"],
        ["--max-new-tokens", "-1"],
        ["--temperature", "-1"],
        ["--top-p", "2"],
        ["--top-k", "-3"],
    ],
)
def test_run_refuses_out_of_range_options_as_usage_errors(qwen3_engine, args) -> None:
    res = run_cli(qwen3_engine, "--prompt", "x = 1", *args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens 0"),
        ({"max_new_tokens": -1}, "max_new_tokens -1"),
        ({"temperature": -1.0}, "temperature -1.0"),
        ({"top_p": 0.0}, "top_p 0.0"),
        ({"top_k": -3}, "top_k -3"),
    ],
)
def test_engine_api_refuses_bad_settings(qwen3_engine, kwargs, words) -> None:
    with pytest.raises(GenerationError, match=words) as exc:
        qwen3_engine.generate([3, 4, 5], mode="dflash", **{"max_new_tokens": 4, **kwargs})
    assert exc.value.hint


def test_non_utf8_prompt_is_an_error(qwen3_engine) -> None:
    res = run_cli(qwen3_engine, "--prompt", "def f(\udcff):")  # how Python hands over undecodable argv bytes
    assert res.exit_code == 1
    assert "not valid UTF-8" in res.stderr and "hint:" in res.stderr and "Traceback" not in res.output


def test_prompt_from_stdin(qwen3_engine) -> None:
    res = run_cli(qwen3_engine, "-p", "-", "--max-new-tokens", "4", "--json", input="def add(a, b):")
    assert res.exit_code == 0, res.output
    assert '"prompt_tokens"' in res.stdout


def _bench(engine, *args):
    recipe = str(engine.recipe.source)
    cache = str(engine.compile_dir.parents[2])
    argv = ["bench", "-r", recipe, "--cache-dir", cache, "--dataset", "humaneval", "--max-samples", "1", *args]
    return runner.invoke(create_app(), argv)


def test_bench_block_sizes_with_an_empty_item(qwen3_engine) -> None:
    res = _bench(qwen3_engine, "--block-sizes", "4,,8")
    assert res.exit_code == 1 and "invalid --block-sizes" in res.stderr


@pytest.mark.parametrize("kind", ["directory", "under-a-file"])
def test_bench_results_path_that_cannot_be_written(qwen3_engine, tmp_path: Path, kind: str) -> None:
    target = tmp_path
    if kind == "under-a-file":
        (tmp_path / "plain-file").write_text("x")
        target = tmp_path / "plain-file" / "results.jsonl"
    res = _bench(qwen3_engine, "--results", str(target))
    assert res.exit_code == 1, res.output
    assert "--results" in res.stderr and "hint:" in res.stderr and "Traceback" not in res.output


def test_full_disk_during_a_stage_is_one_error_and_publishes_nothing(tiny_qwen3_pair, tmp_path, monkeypatch) -> None:
    from dflash_cli.cache.store import Cache
    from dflash_cli.errors import CacheError
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages import export
    from dflash_cli.stages.pipeline import build

    def full_disk(self, ctx):
        (ctx.out_dir / "target.onnx.data").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export.ExportStage, "run", full_disk)
    recipe = load_recipe(str(tiny_qwen3_pair.write_recipe(tmp_path / "recipe.yaml")))
    cache = Cache(tmp_path / "cache")
    with pytest.raises(CacheError, match="export: No space left on device") as exc:
        build(recipe, cache)
    assert "--cache-dir" in exc.value.hint
    assert {e.stage for e in cache.entries()} == {"convert", "inject"}
    assert not list(cache.tmp_dir.glob("export-*"))


def test_rot_that_keeps_size_and_mtime_stops_run_before_any_output(tiny_qwen3_pair, tmp_path) -> None:
    """The stat check passes such a file; the content check of run's engine must not."""
    recipe = str(tiny_qwen3_pair.write_recipe(tmp_path / "recipe.yaml"))
    cache = str(tmp_path / "cache")
    app = create_app()
    assert runner.invoke(app, ["build", "-r", recipe, "--cache-dir", cache]).exit_code == 0
    args = ["run", "-r", recipe, "--cache-dir", cache, "-p", "x", "--max-new-tokens", "3"]
    (weights,) = (tmp_path / "cache" / "artifacts" / "compile").glob("*/target.onnx.data")
    rot_in_place(weights, 7)
    run = runner.invoke(app, args)
    assert run.exit_code == 1 and run.stdout == ""
    assert "compile artifact" in run.stderr and "target.onnx.data no longer holds the bytes" in run.stderr
    # compile hard-links the export's weights: rebuilding compile alone would link the same bytes again
    assert "--rebuild export" in run.stderr
    assert runner.invoke(app, ["build", "-r", recipe, "--cache-dir", cache, "--rebuild", "export"]).exit_code == 0
    assert runner.invoke(app, args).exit_code == 0
    (graph,) = (tmp_path / "cache" / "artifacts" / "compile").glob("*/draft.onnx")
    rot_in_place(graph, 0)
    cache_contents._VERIFIED.clear()  # what a new process starts with (a file is checked once per process)
    run = runner.invoke(app, args)
    assert run.exit_code == 1 and "draft.onnx no longer holds the bytes" in run.stderr


def test_flipped_byte_in_a_real_graph_stops_run_and_rebuild_fixes_it(tiny_qwen3_pair, tmp_path) -> None:
    """One flipped byte in the cached target.onnx (rewritten, same size): no wrong answer, a clear error."""
    import time

    recipe = str(tiny_qwen3_pair.write_recipe(tmp_path / "recipe.yaml"))
    cache = str(tmp_path / "cache")
    app = create_app()
    assert runner.invoke(app, ["build", "-r", recipe, "--cache-dir", cache]).exit_code == 0
    (graph,) = (tmp_path / "cache" / "artifacts" / "export").glob("*/target.onnx")
    data = bytearray(graph.read_bytes())
    data[len(data) // 3] ^= 0x01
    time.sleep(0.01)
    graph.write_bytes(bytes(data))  # in place: compile's hard link sees the same damage

    run = runner.invoke(app, ["run", "-r", recipe, "--cache-dir", cache, "-p", "x", "--max-new-tokens", "3"])
    assert run.exit_code == 1
    assert "export artifact" in run.stderr and "is damaged" in run.stderr and "target.onnx" in run.stderr
    assert "--rebuild export" in run.stderr
    build = runner.invoke(app, ["build", "-r", recipe, "--cache-dir", cache, "--rebuild", "compile"])
    assert build.exit_code == 1 and "--rebuild export" in build.stderr  # never builds on the damaged graph
    fixed = runner.invoke(app, ["build", "-r", recipe, "--cache-dir", cache, "--rebuild", "export"])
    assert fixed.exit_code == 0, fixed.output
    again = runner.invoke(app, ["run", "-r", recipe, "--cache-dir", cache, "-p", "x", "--max-new-tokens", "3"])
    assert again.exit_code == 0, again.output
