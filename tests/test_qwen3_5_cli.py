"""A tiny Qwen3.5 pair through the command line at the quantised precisions: build, `run --json` in every
mode (identical tokens), `bench` (lossless on every prompt), the build's own checks recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engines import assert_quantised_runs_agree, dflash_ok
from tests.fixtures.tiny_pairs import make_pair


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantised_build_runs_and_benches_losslessly(precision: str, tmp_path: Path) -> None:
    pair = make_pair(tmp_path / "pair", "qwen3_5")
    recipe = str(pair.write_recipe(tmp_path / "recipe.yaml", compile={"ort": {"precision": precision}}))
    common = ["-r", recipe, "--cache-dir", str(tmp_path / "cache")]
    dflash_ok("build", *common)
    facts = json.loads(next((tmp_path / "cache" / "artifacts" / "compile").glob("*/compile.json")).read_text())
    assert facts["precision"] == precision
    assert facts["accuracy_level"] == 4  # int8 activations: the delta rule runs row by row, exact at any length
    assert set(facts["causal_invariance_max_diff"].values()) == {0.0}
    assert set(facts["prefix_call_length_max_diff"].values()) == {0.0}  # features too

    assert_quantised_runs_agree(common, tmp_path / "prompts.jsonl")


def test_int8_activations_are_the_default_for_this_family_too() -> None:
    from dflash_cli.recipe.schema import load_recipe

    assert load_recipe("demo", ["family=qwen3_5"]).compile.ort.accuracy_level == 4
    assert load_recipe("demo", ["family=qwen3_5", "compile.ort.accuracy_level=0"]).compile.ort.accuracy_level == 0
    load_recipe("demo", ["family=qwen3_next", "compile.ort.precision=w8a8"])  # no longer refused
