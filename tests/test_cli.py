"""The `dflash` command line: JSON output, error wording, cache and recipe commands, help."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from dflash_cli.cli.app import create_app
from dflash_cli.errors import RecipeError
from dflash_cli.stages import pipeline
from dflash_cli.stages.base import StageContext

runner = CliRunner()


class FakeStage:
    def __init__(self, name: str, upstream: tuple[str, ...] = (), reads: str | None = None):
        self.name, self.upstream, self.reads, self.version = name, upstream, reads, 1

    def key_fields(self, recipe: Any) -> dict[str, Any]:
        return {"block_size": recipe.dflash.block_size} if self.reads else {}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        ctx.progress("working")
        print("a chatty library writes to stdout")  # must not reach a --json stdout
        (ctx.out_dir / "out.bin").write_bytes(self.name.encode() * 100)
        return {}


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A recipes dir with `tiny`, fake convert/inject stages, and a private cache dir."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "tiny.yaml").write_text("name: tiny\nfamily: qwen3\ntarget: {path: t}\ndraft: {path: d}\n")
    monkeypatch.setenv("DFLASH_RECIPES_DIR", str(recipes))
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    stages = (FakeStage("convert", reads="block_size"), FakeStage("inject", upstream=("convert",)))
    monkeypatch.setattr(pipeline, "default_stages", lambda: stages)
    return {"cache": str(tmp_path / "cache")}


def invoke(*args: str) -> Any:
    return runner.invoke(create_app(), list(args))


def test_build_json_is_one_document_on_stdout(env: dict[str, str]) -> None:
    result = invoke("build", "-r", "tiny", "--cache-dir", env["cache"], "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)  # raises if anything else was printed on stdout
    assert doc["recipe"] == "tiny"
    assert [(s["name"], s["status"]) for s in doc["stages"]] == [("convert", "built"), ("inject", "built")]
    assert all({"name", "status", "key", "seconds", "path"} <= set(s) for s in doc["stages"])
    assert "block_size" in result.stderr  # the effective settings go to stderr

    again = json.loads(invoke("build", "-r", "tiny", "--cache-dir", env["cache"], "--json").stdout)
    assert [s["status"] for s in again["stages"]] == ["cached", "cached"]


def test_build_table_and_single_stage_force(env: dict[str, str]) -> None:
    first = invoke("build", "-r", "tiny", "--cache-dir", env["cache"])
    assert first.exit_code == 0, first.output
    assert "convert" in first.stdout and "built" in first.stdout
    result = invoke("inject", "-r", "tiny", "--cache-dir", env["cache"], "--force", "--json")
    assert [s["status"] for s in json.loads(result.stdout)["stages"]] == ["cached", "built"]
    result = invoke("convert", "-r", "tiny", "--cache-dir", env["cache"], "--json")
    assert [(s["name"], s["status"]) for s in json.loads(result.stdout)["stages"]] == [("convert", "cached")]


def test_set_changes_the_key(env: dict[str, str]) -> None:
    a = json.loads(invoke("convert", "-r", "tiny", "--cache-dir", env["cache"], "--json").stdout)
    b = invoke("convert", "-r", "tiny", "--cache-dir", env["cache"], "--json", "--set", "dflash.block_size=8")
    assert json.loads(b.stdout)["stages"][0]["key"] != a["stages"][0]["key"]


def test_unknown_recipe_is_one_line_and_a_hint(env: dict[str, str]) -> None:
    result = invoke("build", "-r", "nope", "--cache-dir", env["cache"])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == (
        "error: unknown recipe 'nope'\nhint: available recipes: tiny (or pass a path to a .yaml file)\n"
    )


def test_invalid_override_names_the_field(env: dict[str, str]) -> None:
    result = invoke("build", "-r", "tiny", "--set", "export.ctx_len=0", "--set", "dflash.blok_size=4")
    assert result.exit_code == 1
    first = result.stderr.splitlines()[0]
    assert first.startswith("error: recipe 'tiny' is invalid: ")
    assert "export.ctx_len: Input should be greater than 0" in first and "dflash.blok_size: unknown field" in first


def test_debug_env_reraises(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_DEBUG", "1")
    result = invoke("build", "-r", "nope")
    assert isinstance(result.exception, RecipeError)


@pytest.mark.parametrize("flag", ["--rebuild", "--upto"])
def test_unknown_stage_is_a_usage_error_with_a_suggestion(env: dict[str, str], flag: str) -> None:
    result = invoke("build", "-r", "tiny", "--cache-dir", env["cache"], flag, "exprot")
    assert result.exit_code == 2  # click's usage-error code, before any settings table or build
    assert "unknown stage 'exprot'; did you mean 'export'?" in result.stderr
    assert "dflash build:" not in result.stderr


def test_unwritable_cache_dir(env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = invoke("build", "-r", "tiny", "--cache-dir", str(tmp_path / "file" / "cache"))
    assert result.exit_code == 1
    assert "is not writable" in result.stderr and "hint: pass --cache-dir DIR or set DFLASH_HOME" in result.stderr


def test_cache_ls_verify_clean(env: dict[str, str]) -> None:
    build = json.loads(invoke("build", "-r", "tiny", "--cache-dir", env["cache"], "--json").stdout)
    ls = json.loads(invoke("cache", "ls", "--cache-dir", env["cache"], "--json").stdout)
    assert {(a["recipe"], a["stage"]) for a in ls["artifacts"]} == {("tiny", "convert"), ("tiny", "inject")}
    table = invoke("cache", "ls", "--cache-dir", env["cache"]).stdout
    assert "tiny" in table and "convert" in table

    assert invoke("cache", "verify", "--cache-dir", env["cache"]).exit_code == 0
    out = Path(build["stages"][0]["path"]) / "out.bin"
    out.write_bytes(out.read_bytes().upper())
    bad = invoke("cache", "verify", "--cache-dir", env["cache"], "--json")
    assert bad.exit_code == 1
    assert json.loads(bad.stdout)["corrupt"][0]["problems"] == ["contents changed: out.bin"]
    assert "error: 1 of 2 cached artifacts failed verification" in bad.stderr

    kept = json.loads(invoke("cache", "clean", "--cache-dir", env["cache"], "--older-than", "7d", "--json").stdout)
    assert kept["removed"] == []
    refused = invoke("cache", "clean", "--cache-dir", env["cache"], "--json")  # no terminal, no --yes
    assert refused.exit_code == 1 and "--yes" in refused.stderr
    gone = json.loads(invoke("cache", "clean", "--cache-dir", env["cache"], "--json", "--yes").stdout)
    assert len(gone["removed"]) == 2
    assert json.loads(invoke("cache", "ls", "--cache-dir", env["cache"], "--json").stdout)["artifacts"] == []


def test_cache_clean_bad_age(env: dict[str, str]) -> None:
    result = invoke("cache", "clean", "--older-than", "soon")
    assert result.exit_code == 1 and result.stderr.startswith("error: cannot parse age 'soon'")


def test_recipes_list_and_show(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_RECIPES_DIR")
    listed = json.loads(invoke("recipes", "list", "--json").stdout)
    names = {r["name"] for r in listed["recipes"]}
    assert {"demo", "qwen3-4b", "qwen3-8b", "llama3.1-8b"} <= names
    assert not [r for r in listed["recipes"] if "error" in r]
    shown = invoke("recipes", "show", "qwen3-8b", "--set", "run.temperature=0.7")
    assert shown.exit_code == 0 and "temperature: 0.7" in shown.stdout and "Qwen/Qwen3-8B" in shown.stdout
    as_json = json.loads(invoke("recipes", "show", "demo", "--json").stdout)
    assert as_json["export"]["ctx_len"] == 1024 and as_json["export"]["validate"] is True


def test_doctor_json(env: dict[str, str]) -> None:
    result = invoke("doctor", "--cache-dir", env["cache"], "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["versions"]["dflash"] and doc["versions"]["torch"].startswith("2.13")
    assert "CPUExecutionProvider" in doc["ort_providers"]
    assert set(doc["qaic"]) >= {"present", "qaic_compile", "qaic_exec"}
    assert doc["cache"]["root"] == env["cache"] and doc["cache"]["writable"] is True
    assert invoke("doctor", "--cache-dir", env["cache"]).exit_code == 0


def _commands(group: Any, prefix: str = "") -> list[tuple[str, Any]]:
    # Typer vendors its own Click, so walk the tree by shape rather than by Click's classes.
    if hasattr(group, "commands"):
        out = []
        for name, cmd in group.commands.items():
            out += _commands(cmd, f"{prefix} {name}".strip())
        return out
    return [(prefix, group)]


def test_every_command_has_an_example() -> None:
    commands = _commands(typer.main.get_command(create_app()))
    names = {name for name, _ in commands}
    assert {"build", "convert", "inject", "recipes list", "recipes show", "cache ls", "doctor"} <= names
    missing = [name for name, cmd in commands if "example" not in (cmd.epilog or "").lower()]
    assert missing == []


def test_stdout_guard_covers_c_level_writes() -> None:
    code = (
        "import os, sys; from dflash_cli.cli.common import stdout_to_stderr\n"
        "with stdout_to_stderr():\n"
        "    print('py-noise'); sys.stdout.flush(); os.write(1, b'fd-noise\\n')\n"
        "print('{}')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout == "{}\n"
    assert "py-noise" in proc.stderr and "fd-noise" in proc.stderr


def test_help_is_fast_and_light() -> None:
    code = (
        "import sys; from dflash_cli.cli.app import create_app; create_app(); "
        "print([m for m in ('torch', 'onnx', 'transformers', 'onnxruntime') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    help_text = subprocess.run(
        [sys.executable, "-m", "dflash_cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "build" in help_text and "cache" in help_text


def test_real_convert_inject_on_tiny_pair(tiny_qwen3_pair: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """End to end with the real stages: build up to inject twice; the second run is all cached."""
    monkeypatch.delenv("DFLASH_RECIPES_DIR", raising=False)
    recipe = tmp_path / "pair.yaml"
    recipe.write_text(
        f"name: pair\nfamily: qwen3\ntarget: {{path: {tiny_qwen3_pair.target_dir}}}\n"
        f"draft: {{path: {tiny_qwen3_pair.draft_dir}}}\n"
    )
    args = ["build", "-r", str(recipe), "--cache-dir", str(tmp_path / "cache"), "--upto", "inject", "--json"]
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    assert [s["status"] for s in json.loads(first.stdout)["stages"]] == ["built", "built"]
    second = json.loads(invoke(*args).stdout)
    assert [s["status"] for s in second["stages"]] == ["cached", "cached"]
