"""`dflash run`: streaming output, --json, and one-line errors for bad requests."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from dflash_cli.cli.app import create_app

runner = CliRunner()


def invoke(engine, *args):
    recipe = str(engine.recipe.source)
    cache = str(engine.compile_dir.parents[2])
    return runner.invoke(create_app(), ["run", "-r", recipe, "--cache-dir", cache, *args])


def test_run_streams_text_and_summary(qwen3_engine):
    res = invoke(qwen3_engine, "--prompt", "def add(a, b):", "--max-new-tokens", "6")
    assert res.exit_code == 0, res.output
    assert "new tokens" in res.stderr and "tau" in res.stderr


def test_run_json(qwen3_engine):
    res = invoke(qwen3_engine, "--prompt", "def add(a, b):", "--max-new-tokens", "6", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["mode"] == "dflash" and 1 <= len(doc["token_ids"]) <= 6
    assert {"text", "acceptance_lengths", "tau", "ttft_s", "decode_tokens_per_s"} <= set(doc)


def test_no_draft_is_plain(qwen3_engine):
    res = invoke(qwen3_engine, "--prompt", "x = 1", "--max-new-tokens", "6", "--json", "--no-draft")
    assert json.loads(res.stdout)["mode"] == "plain"


def test_empty_prompt(qwen3_engine):
    res = invoke(qwen3_engine, "--prompt", "  ")
    assert res.exit_code == 1
    assert "error: the prompt is empty" in res.stderr and "hint:" in res.stderr


def test_over_long_prompt(qwen3_engine):
    res = invoke(qwen3_engine, "--prompt", "x " * 400)
    assert res.exit_code == 1
    assert "exceeds the" in res.stderr and "export.ctx_len" in res.stderr


def test_missing_artifacts_are_built_first(qwen3_engine):
    """Like `dflash bench`, `run` builds the stages a changed setting needs, with progress on stderr."""
    res = invoke(qwen3_engine, "--prompt", "x", "--set", "export.ctx_len=96", "--max-new-tokens", "3", "--json")
    assert res.exit_code == 0, res.output
    assert "export: built" in res.stderr and json.loads(res.stdout)["new_tokens"] <= 3


def test_recipe_as_positional_argument(qwen3_engine):
    cache = str(qwen3_engine.compile_dir.parents[2])
    argv = ["run", str(qwen3_engine.recipe.source), "--cache-dir", cache, "-p", "x", "--max-new-tokens", "2"]
    res = runner.invoke(create_app(), argv)
    assert res.exit_code == 0, res.output


def test_sampling_needs_logits(qwen3_engine):
    res = invoke(qwen3_engine, "--prompt", "x", "--max-new-tokens", "4", "--temperature", "0.7")
    assert res.exit_code == 1
    assert "export.logits=true" in res.stderr


def test_unavailable_cuda_provider(qwen3_engine):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        return
    res = invoke(qwen3_engine, "--prompt", "x", "--set", "compile.ort.provider=cuda")
    assert res.exit_code == 1
    assert "no CUDA provider" in res.stderr


def test_qaic_backend_without_sdk(qwen3_engine, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_QAIC_ROOT", str(tmp_path / "no-sdk"))
    recipe = str(qwen3_engine.recipe.source)
    cache = str(qwen3_engine.compile_dir.parents[2])
    res = runner.invoke(create_app(), ["build", "-r", recipe, "--cache-dir", cache, "--set", "compile.backend=qaic"])
    assert res.exit_code == 1
    assert "QAIC SDK not found" in res.stderr and "--emit-script" in res.stderr


def test_mode_option_takes_every_mode_and_the_old_name():
    from dflash_cli.cli.run import resolve_mode
    from dflash_cli.decoding.modes import ALIASES, MODES

    assert [resolve_mode(m) for m in MODES] == list(MODES)
    assert resolve_mode("pld") == "lookup" == ALIASES["pld"] and resolve_mode(None) is None
    with pytest.raises(typer.BadParameter, match="did you mean 'lookup'"):
        resolve_mode("lokup")


def test_stop_string_ends_the_answer_streamed_or_json(qwen3_engine):
    """--stop cuts the printed text where the stop string begins and ends generation there; before, a
    streamed answer printed everything and only --json's text was cut."""
    full = json.loads(invoke(qwen3_engine, "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--json").stdout)
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    want = text[: text.find(stop)]
    streamed = invoke(qwen3_engine, "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--stop", stop)
    assert streamed.exit_code == 0, streamed.output
    assert streamed.stdout == want + "\n" and "stopped: stop_string" in streamed.stderr
    args = ("--prompt", "def add(a, b):", "--max-new-tokens", "24", "--json")
    doc = json.loads(invoke(qwen3_engine, *args, "--stop", stop).stdout)
    assert doc["text"] == want and doc["stopped"] == "stop_string"
    assert doc["token_ids"] == full["token_ids"][: len(doc["token_ids"])]
    from_recipe = invoke(qwen3_engine, *args[:-1], "--set", f"run.stop={json.dumps([stop])}")
    assert from_recipe.stdout == want + "\n"


def test_stop_option_reads_escapes_and_refuses_an_empty_string(qwen3_engine):
    from dflash_cli.cli.run import _stops

    assert _stops(["\\n\\n", "a\\tb", "\\\\n"], ["x"]) == ["\n\n", "a\tb", "\\n"]
    assert _stops(None, ["x"]) == ["x"]
    res = invoke(qwen3_engine, "--prompt", "x", "--stop", "")
    assert res.exit_code == 2 and "stop string must not be empty" in res.output


def test_run_follows_a_json_schema_file_or_a_regex(qwen3_logits_engine, tmp_path):
    n = {"type": "integer", "maximum": 9, "minimum": 0}
    schema = {"type": "object", "properties": {"n": n}, "required": ["n"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    doc = json.loads(
        invoke(
            qwen3_logits_engine,
            "-p",
            "x",
            "--json-schema",
            str(tmp_path / "s.json"),
            "--json",
            "--max-new-tokens",
            "24",
        ).stdout
    )
    assert set(json.loads(doc["text"])) <= {"n"} and doc["stopped"] == "stop_token"
    res = invoke(qwen3_logits_engine, "-p", "x", "--regex", "[a-c]{4}", "--max-new-tokens", "24")
    assert res.exit_code == 0 and len(res.stdout.strip()) == 4 and set(res.stdout.strip()) <= set("abc")


def test_run_constraint_errors_are_one_line_with_a_hint(qwen3_engine, qwen3_logits_engine, tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    for engine, args, words in (
        (qwen3_logits_engine, ["--json-schema", str(tmp_path / "missing.json")], "cannot read the JSON schema"),
        (qwen3_logits_engine, ["--json-schema", str(tmp_path / "bad.json")], "is not JSON"),
        (qwen3_logits_engine, ["--regex", "([a-z"], "regex cannot be compiled"),
        (qwen3_engine, ["--regex", "a+"], "export.logits=true"),
    ):
        res = invoke(engine, "-p", "x", "--max-new-tokens", "8", *args)
        assert res.exit_code == 1 and words in res.stderr and "Traceback" not in res.output, res.output
    both = invoke(qwen3_logits_engine, "-p", "x", "--regex", "a", "--json-schema", str(tmp_path / "bad.json"))
    assert both.exit_code == 2 and "not both" in both.output


def test_repetition_penalty_needs_logits_and_a_positive_value(qwen3_engine):
    res = invoke(qwen3_engine, "--prompt", "x", "--max-new-tokens", "4", "--repetition-penalty", "1.3")
    assert res.exit_code != 0 and "export.logits=true" in res.output
    res = invoke(qwen3_engine, "--prompt", "x", "--max-new-tokens", "4", "--repetition-penalty", "0")
    assert res.exit_code != 0 and "not positive" in res.output
