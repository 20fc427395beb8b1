"""Recipe schema, loading, overrides and error reporting."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from dflash_cli.errors import RecipeError
from dflash_cli.recipe.files import list_recipes
from dflash_cli.recipe.schema import Recipe, load_recipe, parse_override

REPO_RECIPES = Path(__file__).resolve().parent.parent / "recipes"

MINIMAL = """\
name: tiny
family: qwen3
target: {path: ./target}
draft: {path: ./draft}
"""


@pytest.fixture
def recipes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private recipes dir with `tiny` (local checkpoint dirs) and `hub` (repo ids)."""
    (tmp_path / "target").mkdir()
    (tmp_path / "draft").mkdir()
    (tmp_path / "tiny.yaml").write_text(MINIMAL)
    (tmp_path / "hub.yaml").write_text(
        "name: hub\nfamily: llama\ntarget: {path: meta-llama/Llama-3.1-8B-Instruct}\ndraft: {path: z-lab/x}\n"
    )
    monkeypatch.setenv("DFLASH_RECIPES_DIR", str(tmp_path))
    return tmp_path


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(text)
    return path


def test_defaults(recipes: Path) -> None:
    r = load_recipe("tiny")
    assert r.name == "tiny" and r.family == "qwen3"
    assert r.dflash.block_size is None and r.dflash.target_layer_ids is None
    assert (r.export.ctx_len, r.export.prefill_seq_len, r.export.opset, r.export.exporter) == (1024, 64, 18, "dynamo")
    assert r.export.validate_outputs is True and r.to_dict()["export"]["validate"] is True
    assert r.compile.backend == "ort" and r.compile.ort.provider == "auto" and r.compile.qaic.devices == [0]
    assert (r.run.max_new_tokens, r.run.temperature, r.run.top_p, r.run.stop) == (128, 0.0, 1.0, [])
    assert r.source == (recipes / "tiny.yaml").resolve()


def test_relative_paths_resolve_against_recipe_dir_and_repo_ids_stay(recipes: Path) -> None:
    r = load_recipe("tiny")
    assert r.target.path == str((recipes / "target").resolve())
    hub = load_recipe("hub")
    assert hub.target.path == "meta-llama/Llama-3.1-8B-Instruct"


def test_precedence_defaults_yaml_set(recipes: Path) -> None:
    write(recipes, "big", MINIMAL + "export: {ctx_len: 2048}\nrun: {max_new_tokens: 7}\n")
    r = load_recipe("big", ["export.ctx_len=4096", "dflash.target_layer_ids=[1,3]", "run.chat_template=true"])
    assert r.export.ctx_len == 4096  # --set beats YAML
    assert r.run.max_new_tokens == 7  # YAML beats default
    assert r.export.prefill_seq_len == 64  # default
    assert r.dflash.target_layer_ids == [1, 3] and r.run.chat_template is True


def test_load_by_path(recipes: Path, tmp_path: Path) -> None:
    path = write(tmp_path, "elsewhere", MINIMAL)
    assert load_recipe(str(path)).name == "tiny"


def test_all_errors_at_once_with_field_paths(recipes: Path) -> None:
    write(recipes, "bad", MINIMAL + "export: {ctx_len: 0}\ndflash: {blok_size: 4}\nrun: {top_p: 2}\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe("bad", ["compile.backend=tpu", "nonsense"])
    msg = exc.value.message
    assert "export.ctx_len: Input should be greater than 0" in msg
    assert "dflash.blok_size: unknown field" in msg
    assert "run.top_p: Input should be less than or equal to 1" in msg
    assert "compile.backend: Input should be 'ort' or 'qaic'" in msg
    assert "--set nonsense: expected KEY=VALUE" in msg
    assert exc.value.hint


def test_unknown_top_level_key(recipes: Path) -> None:
    write(recipes, "extra", MINIMAL + "colour: blue\n")
    with pytest.raises(RecipeError, match="colour: unknown field"):
        load_recipe("extra")


def test_set_unknown_key_is_an_error(recipes: Path) -> None:
    with pytest.raises(RecipeError, match=r"export\.ctx_lenn: unknown field"):
        load_recipe("tiny", ["export.ctx_lenn=5"])


def test_set_into_a_value_is_an_error(recipes: Path) -> None:
    with pytest.raises(RecipeError, match=r"--set name\.x=1: name is a value, not a section"):
        load_recipe("tiny", ["name.x=1"])


def test_prefill_must_be_multiple_of_block_size(recipes: Path) -> None:
    with pytest.raises(RecipeError, match=r"export\.prefill_seq_len \(64\) must be a multiple of the block size \(5\)"):
        load_recipe("tiny", ["dflash.block_size=5"])
    assert load_recipe("tiny", ["dflash.block_size=16"]).dflash.block_size == 16


def test_the_cache_must_hold_a_prefill_chunk_and_two_blocks(recipes: Path) -> None:
    with pytest.raises(
        RecipeError, match=r"export\.ctx_len \(80\) is too small for prefill 64 and block 16: at least 96"
    ):
        load_recipe("tiny", ["dflash.block_size=16", "export.ctx_len=80"])
    with pytest.raises(RecipeError, match=r"export\.ctx_len \(64\) is too small for prefill 64 and block 2"):
        load_recipe("tiny", ["export.ctx_len=64"])  # block from the draft: at least the smallest block
    assert load_recipe("tiny", ["dflash.block_size=16", "export.ctx_len=96"]).export.ctx_len == 96


def test_yaml_syntax_error_names_the_line(recipes: Path) -> None:
    write(recipes, "broken", "name: broken\nfamily: qwen3\ntarget: {path: x\ndraft:\n  path: y\n")
    with pytest.raises(RecipeError, match=r"YAML syntax error at line \d+"):
        load_recipe("broken")
    write(recipes, "indent", "name: x\nfamily: qwen3\n  target: 1\n")
    with pytest.raises(RecipeError, match="at line 3"):
        load_recipe("indent")


def test_unknown_name_lists_available(recipes: Path) -> None:
    with pytest.raises(RecipeError) as exc:
        load_recipe("nope")
    assert exc.value.message == "unknown recipe 'nope'"
    assert exc.value.hint == "available recipes: hub, tiny (or pass a path to a .yaml file)"


def test_missing_recipe_file(recipes: Path) -> None:
    with pytest.raises(RecipeError, match="recipe file not found: missing.yaml"):
        load_recipe("missing.yaml")


def test_recipe_is_frozen(recipes: Path) -> None:
    r = load_recipe("tiny")
    with pytest.raises(ValidationError):
        r.export.ctx_len = 5  # type: ignore[misc]


def test_parse_override_values() -> None:
    assert parse_override("a.b=[1, 3]") == ("a.b", [1, 3])
    assert parse_override("a=null") == ("a", None)
    assert parse_override("a=") == ("a", None)
    assert parse_override("a=Qwen/Qwen3-8B") == ("a", "Qwen/Qwen3-8B")
    assert parse_override("a=x=y") == ("a", "x=y")
    with pytest.raises(ValueError):
        parse_override("=3")


def test_yaml_round_trip(recipes: Path, tmp_path: Path) -> None:
    r = load_recipe("tiny", ["run.stop=['\\n\\n']", "compile.qaic.devices=[0,1]"])
    path = tmp_path / "dumped.yaml"
    path.write_text(r.to_yaml())
    assert load_recipe(str(path)).to_dict() == r.to_dict()


def test_list_recipes(recipes: Path) -> None:
    assert list(list_recipes()) == ["hub", "tiny"]


@pytest.mark.parametrize("path", sorted(REPO_RECIPES.glob("*.y*ml")), ids=lambda p: p.stem)
def test_every_shipped_recipe_validates(path: Path) -> None:
    recipe = load_recipe(str(path))
    assert recipe.name == path.stem
    first = path.read_text().splitlines()[:3]
    assert any(f"dflash build --recipe {path.stem}" in line for line in first), "head the YAML with its command"


def test_shipped_recipes_exist() -> None:
    names = {p.stem for p in REPO_RECIPES.glob("*.yaml")}
    assert {"demo", "qwen3-4b", "qwen3-8b", "llama3.1-8b"} <= names


def test_recipe_model_rejects_extra_keys_directly() -> None:
    with pytest.raises(ValidationError):
        Recipe.model_validate({"name": "x", "family": "qwen3", "target": {"path": "a"}, "draft": {"path": "b"}, "z": 1})
