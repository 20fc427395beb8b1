"""Conflicting or unusable input is refused up front, in one line, instead of silently doing something else:
a closed or empty stdin for `-p -`, two different recipes, `--mode X --no-draft`, a JSON file that is not
a bench result, an option `bench compare` does not read, target and draft swapped, a config vocab_size the
weights disagree with."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_cli.cli.app import create_app
from dflash_cli.recipe.files import find_recipe
from tests.fixtures.tiny_pairs import TinyPair

runner = CliRunner()
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "hybrid"


def invoke(*args: str, input: str | None = None):
    return runner.invoke(create_app(), list(args), input=input)


def flat(text: str) -> str:
    """A usage error's text without whitespace and the rich panel around it (which wraps long lines)."""
    return re.sub(r"[\s│╭╮╰╯─]", "", text)


def assert_one_error(res, code: int, *fragments: str) -> None:
    """Exit `code`, no traceback, and every fragment on the one `error:` line."""
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, res.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("conflicts_cache"))


@pytest.fixture(scope="module")
def recipe(tiny_qwen3_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_qwen3_pair.write_recipe(tmp_path_factory.mktemp("conflicts_recipe") / "tiny.yaml"))


# --- 1. `-p -` with stdin closed or empty ------------------------------------------------------


def test_prompt_from_closed_stdin_is_one_error_line(recipe: str, tmp_path: Path) -> None:
    """`dflash run -p - <&-`: Python starts with sys.stdin None (was: AttributeError traceback)."""
    argv = [sys.executable, "-m", "dflash_cli", "run", "-r", recipe, "--cache-dir", str(tmp_path), "-p", "-"]
    res = subprocess.run(argv, preexec_fn=lambda: os.close(0), capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.startswith("error: ") and "stdin is closed" in res.stderr.splitlines()[0]
    assert "hint: " in res.stderr
    assert not (tmp_path / "artifacts").exists()  # refused before anything was built


@pytest.mark.parametrize("text", ["", "  \n"])
def test_prompt_from_empty_stdin_is_refused_before_building(recipe: str, tmp_path: Path, text: str) -> None:
    res = invoke("run", "-r", recipe, "--cache-dir", str(tmp_path), "-p", "-", input=text)
    assert_one_error(res, 1, "the prompt on stdin is empty")
    assert "hint: " in res.stderr
    assert not (tmp_path / "artifacts").exists()


# --- 2. the positional recipe and --recipe naming different recipes ---------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["build", "--upto", "convert"],
        ["run", "-p", "x", "--max-new-tokens", "1"],
        ["serve", "--print-command", "vllm"],
    ],
    ids=["build", "run", "serve"],
)
def test_recipe_argument_and_a_different_recipe_option_conflict(recipe: str, cache: str, command) -> None:
    """`dflash build demo --recipe qwen3-4b` built demo; -r demo (the default, given explicitly) counts too."""
    name, *rest = command
    res = invoke(name, recipe, "--recipe", "demo", "--cache-dir", cache, *rest)
    assert res.exit_code == 2, res.output
    assert f"'{flat(recipe)}'(argument)and'demo'(--recipe)" in flat(res.output)


@pytest.mark.parametrize("other", ["demo", "file"])
def test_the_same_recipe_twice_is_accepted(other: str) -> None:
    option = "demo" if other == "demo" else str(find_recipe("demo"))
    res = invoke("serve", "demo", "--recipe", option, "--print-command", "vllm")
    assert res.exit_code == 0, res.output


# --- 3. --mode other than plain with --no-draft ------------------------------------------------


@pytest.mark.parametrize("mode", ["dflash", "hybrid", "lookup", "pld"])
def test_a_drafting_mode_with_no_draft_is_a_usage_error(recipe: str, cache: str, mode: str) -> None:
    """`--mode hybrid --no-draft` ran plain decoding without a word."""
    res = invoke(
        "run", "-r", recipe, "--cache-dir", cache, "-p", "x", "--max-new-tokens", "1", "--mode", mode, "--no-draft"
    )
    assert res.exit_code == 2, res.output
    assert f"--no-draftmeansplaindecodingbut--mode{mode}wasgiven" in flat(res.output)


def test_mode_plain_with_no_draft_is_accepted(recipe: str, tmp_path: Path) -> None:
    # The options pass; what stops the command is the (empty) prompt, before anything is built.
    res = invoke(
        "run", "-r", recipe, "--cache-dir", str(tmp_path), "-p", "-", "--mode", "plain", "--no-draft", input=""
    )
    assert_one_error(res, 1, "the prompt on stdin is empty")


# --- 4. bench compare refuses what is not a bench result ----------------------------------------


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"schema_version": 2}, ["no settings", "no dataset", "no mode section"]),
        ({"schema_version": 2, "settings": {}, "dataset": {}, "answer": 42}, ["no mode section", "baseline"]),
        ({"schema_version": 2, "dflash": {"decode_speedup": 2.0}}, ["no settings", "no dataset"]),
        ({"schema_version": "2", "settings": {}, "dataset": {}, "dflash": {}}, ["schema_version '2'"]),
        ({"schema_version": 99, "settings": {}, "dataset": {}, "dflash": {}}, ["schema_version 99", "newer"]),
        ([1, 2], ["list"]),
    ],
    ids=["bare", "no-mode", "no-settings", "string-version", "newer", "list"],
)
def test_compare_refuses_a_document_that_is_not_a_bench_result(tmp_path: Path, doc, words) -> None:
    good = RESULTS / "demo-humaneval-4modes-rev12.json"
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps(doc))
    res = invoke("bench", "compare", str(good), str(bad))
    assert_one_error(res, 1, str(bad), "not a dflash bench result", *words)
    assert "hint: " in res.stderr and not res.stdout.strip()


# `bench compare A B --endpoint URL` exited 0, ignoring --endpoint: every option compare does not read
# is a usage error. Each of bench's options -> arguments giving it a value it accepts:
BENCH_OPTIONS = {
    "--dataset": ["--dataset", "gsm8k"],
    "--recipe": ["--recipe", "demo"],
    "--set": ["--set", "run.max_new_tokens=8"],
    "--cache-dir": ["--cache-dir", "cache"],
    "--max-samples": ["--max-samples", "3"],
    "--seed": ["--seed", "1"],
    "--max-new-tokens": ["--max-new-tokens", "8"],
    "--temperature": ["--temperature", "0.5"],
    "--top-k": ["--top-k", "5"],
    "--top-p": ["--top-p", "0.5"],
    "--modes": ["--modes", "plain,dflash"],
    "--output": ["--output", "out.json"],
    "--results": ["--results", "r.jsonl"],
    "--resume": ["--resume"],
    "--min-speedup": ["--min-speedup", "2"],
    "--min-tau": ["--min-tau", "2"],
    "--block-sizes": ["--block-sizes", "4,8"],
    "--warmup": ["--warmup", "0"],
    "--repeat": ["--repeat", "2"],
    "--plain-best": ["--plain-same"],  # either form
    "--endpoint": ["--endpoint", "http://127.0.0.1:9"],
    "--model": ["--model", "m"],
    "--timeout": ["--timeout", "5"],
    "--concurrency": ["--concurrency", "2"],
    "--request-rate": ["--request-rate", "1"],
    "--plot": ["--plot", "p.html"],
}


def test_every_bench_option_is_checked_with_compare() -> None:
    import typer

    bench = typer.main.get_command(create_app()).commands["bench"]
    options = {p.opts[0] for p in bench.params if p.opts[0].startswith("--")} - {"--json", "--format", "--help"}
    assert options == set(BENCH_OPTIONS)


@pytest.mark.parametrize("option", list(BENCH_OPTIONS))
def test_compare_refuses_options_it_does_not_read(tmp_path: Path, monkeypatch, option: str) -> None:
    monkeypatch.chdir(tmp_path)
    good = str(RESULTS / "demo-humaneval-4modes-rev12.json")
    res = invoke("bench", "compare", good, good, *BENCH_OPTIONS[option])
    assert res.exit_code == 2, res.output
    assert option in flat(res.output) and "notapplytoit(ittakes--json/--format)" in flat(res.output), res.output
    assert not res.stdout.strip().startswith("{") and not list(tmp_path.iterdir())  # nothing compared or written


def test_compare_takes_its_report_format() -> None:
    good = str(RESULTS / "demo-humaneval-4modes-rev12.json")
    res = invoke("bench", "compare", good, good, "--format", "csv")
    assert res.exit_code == 0 and res.stdout.startswith("metric,")
    res = invoke("bench", "compare", good, good, "--json", "--format", "json")
    assert res.exit_code == 0 and json.loads(res.stdout)["rows"]


# --- 5. target and draft swapped in a recipe ------------------------------------------------------


def _build_convert(recipe: str, cache: Path, *sets: str):
    return invoke("build", "-r", recipe, "--cache-dir", str(cache), "--upto", "convert", *sets)


def test_swapped_target_and_draft_say_so(tiny_qwen3_pair: TinyPair, recipe: str, tmp_path: Path) -> None:
    """Was: "target checkpoint has no tokenizer files", hint: copy tokenizer files."""
    pair = tiny_qwen3_pair
    res = _build_convert(
        recipe, tmp_path, "--set", f"target.path={pair.draft_dir}", "--set", f"draft.path={pair.target_dir}"
    )
    assert_one_error(res, 1, "target checkpoint is a DFlash draft", "DFlashDraftModel", str(pair.draft_dir))
    assert "tokenizer" not in res.stderr
    assert "hint: target.path and draft.path look swapped" in res.stderr


def test_draft_given_as_both_paths(tiny_qwen3_pair: TinyPair, recipe: str, tmp_path: Path) -> None:
    res = _build_convert(recipe, tmp_path, "--set", f"target.path={tiny_qwen3_pair.draft_dir}")
    assert_one_error(res, 1, "target checkpoint is a DFlash draft")
    assert "hint: point target.path at the model the draft was trained for" in res.stderr


def test_target_given_as_the_draft_says_it_is_not_a_draft(
    tiny_qwen3_pair: TinyPair, recipe: str, tmp_path: Path
) -> None:
    """The reverse mistake was already clear; it stays so."""
    res = _build_convert(recipe, tmp_path, "--set", f"draft.path={tiny_qwen3_pair.target_dir}")
    assert_one_error(res, 1, "not a DFlash draft checkpoint")
    assert "hint: point draft.path at a DFlash draft" in res.stderr


# --- 6. config vocab_size against the embedding rows --------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("vocab", [390, 410])
def test_convert_refuses_a_vocab_size_the_weights_disagree_with(
    request: pytest.FixtureRequest, tmp_path: Path, family: str, vocab: int
) -> None:
    """Was: convert passed, export failed with the hint `dflash build --force` (which cannot fix it)."""
    pair = request.getfixturevalue(f"tiny_{family}_pair").copy_to(tmp_path / "pair")
    config = pair.target_dir / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "vocab_size": vocab}))
    res = _build_convert(str(pair.write_recipe(tmp_path / "r.yaml")), tmp_path / "cache")
    assert_one_error(res, 1, f"vocab_size {vocab}", "model.embed_tokens.weight has 400 rows", str(config))
    assert "hint: the checkpoint is inconsistent: set vocab_size to 400 in its config.json" in res.stderr


def test_lm_head_rows_are_checked_too(tiny_llama_pair: TinyPair, tmp_path: Path) -> None:
    """An untied lm_head with other rows than config and embedding agree on: re-download, not edit config."""
    from safetensors.torch import load_file, save_file

    pair = tiny_llama_pair.copy_to(tmp_path / "pair")
    weights = pair.target_dir / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:390].clone()
    save_file(tensors, str(weights), metadata={"format": "pt"})
    res = _build_convert(str(pair.write_recipe(tmp_path / "r.yaml")), tmp_path / "cache")
    assert_one_error(res, 1, "vocab_size 400", "lm_head.weight has 390 rows")
    assert "differ too" in res.stderr


# --- layers of a kind we do not compute (would be computed as full attention) ---------------------


@pytest.mark.parametrize(
    "role, edit, kind",
    [
        ("draft", {"layer_types": ["linear_attention", "full_attention"]}, "linear_attention"),
        ("draft", {"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention"),  # no window
        (
            "target",
            {"layer_types": None, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
            "sliding_attention",
        ),
    ],
)
def test_layers_we_do_not_compute_are_refused_at_convert(
    tiny_qwen3_pair: TinyPair, tmp_path: Path, role: str, edit: dict, kind: str
) -> None:
    pair = tiny_qwen3_pair.copy_to(tmp_path / "pair")
    config = (pair.draft_dir if role == "draft" else pair.target_dir) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **edit}))
    res = _build_convert(str(pair.write_recipe(tmp_path / "r.yaml")), tmp_path / "cache")
    assert_one_error(res, 1, f"{role} layer", kind, "only full attention is supported", str(config))


def test_a_draft_window_that_could_bind_is_refused_with_the_ctx_len_that_fits(
    tiny_qwen3_pair: TinyPair, tmp_path: Path
) -> None:
    """A draft's sliding window is computed only where it never binds (DFlash2 drafts have one per layer)."""
    pair = tiny_qwen3_pair.copy_to(tmp_path / "pair")
    config = pair.draft_dir / "config.json"
    edit = {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 64}
    config.write_text(json.dumps({**json.loads(config.read_text()), **edit}))
    recipe = str(pair.write_recipe(tmp_path / "r.yaml"))
    res = invoke("build", "-r", recipe, "--cache-dir", str(tmp_path / "cache"), "--upto", "export")
    assert_one_error(res, 1, "sliding window of 64 positions", "export.ctx_len 128")
    assert "hint: set export.ctx_len to 64 or less" in res.stderr
