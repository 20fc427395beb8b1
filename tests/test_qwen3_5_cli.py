"""A tiny Qwen3.5 pair through the command line at the quantised precisions: build, `run --json` in every
mode (identical tokens), `bench` (lossless on every prompt), the build's own checks recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_cli.cli.app import create_app
from tests.fixtures.tiny_pairs import make_pair


def _dflash(*args: str):
    result = CliRunner().invoke(create_app(), list(args))
    assert result.exit_code == 0, result.output
    return result


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantised_build_runs_and_benches_losslessly(precision: str, tmp_path: Path) -> None:
    pair = make_pair(tmp_path / "pair", "qwen3_5")
    recipe = str(pair.write_recipe(tmp_path / "recipe.yaml", compile={"ort": {"precision": precision}}))
    common = ["-r", recipe, "--cache-dir", str(tmp_path / "cache")]
    _dflash("build", *common)
    facts = json.loads(next((tmp_path / "cache" / "artifacts" / "compile").glob("*/compile.json")).read_text())
    assert facts["precision"] == precision
    assert facts["accuracy_level"] == 0  # fp32 compute: int8 activations would amplify the delta rule's rounding
    assert set(facts["causal_invariance_max_diff"].values()) == {0.0}
    assert facts["prefix_call_length_max_diff"]["tokens"] == 0.0

    runs = {}
    for mode in ("plain", "dflash", "lookup", "hybrid"):
        out = _dflash("run", *common, "--prompt", "def add(a, b):\n    return a + b\n" * 3, "--mode", mode,
                      "--max-new-tokens", "24", "--json")  # fmt: skip
        runs[mode] = json.loads(out.stdout)["token_ids"]
    assert all(tokens == runs["plain"] for tokens in runs.values())

    prompts = tmp_path / "prompts.jsonl"
    lines = ["The quick brown fox", "for i in range(10):\n    print(i * i)\n", "Question: what is 12 plus 30?"]
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in lines))
    out = _dflash("bench", *common, "--dataset", str(prompts), "--max-new-tokens", "16", "--json")
    doc = json.loads(out.stdout)
    assert doc["lossless"]["checked"] and doc["lossless"]["mismatches"] == []


def test_accuracy_level_defaults_by_family() -> None:
    from types import SimpleNamespace

    from dflash_cli.stages.compile import accuracy_level

    def recipe(family: str, level):
        return SimpleNamespace(family=family, compile=SimpleNamespace(ort=SimpleNamespace(accuracy_level=level)))

    assert accuracy_level(recipe("qwen3", None)) == 4
    assert accuracy_level(recipe("llama", None)) == 4
    assert accuracy_level(recipe("qwen3_5", None)) == 0
    assert accuracy_level(recipe("qwen3_5", 4)) == 4  # asked for: the build warns
