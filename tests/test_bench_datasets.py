"""Bench datasets: HumanEval offline, local JSONL/TXT files, seeded subsets, and the error wording."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from dflash_cli.bench.datasets import Sample, dataset_name, load_dataset, select_samples
from dflash_cli.errors import DatasetError


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_humaneval_loads_164_single_turn_problems() -> None:
    samples = load_dataset("humaneval")
    assert len(samples) == 164
    assert samples[0].id == "HumanEval/0"
    assert all(len(s.turns) == 1 and s.turns[0].strip() for s in samples)
    assert "def " in samples[0].turns[0]


def test_jsonl_turns_and_prompt(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "mt.jsonl",
        [{"turns": ["hi", "and then?"], "question_id": 81}, {"prompt": "solve x"}, ""],
    )
    samples = load_dataset(str(path))
    assert samples == [Sample("81", ["hi", "and then?"]), Sample("mt/2", ["solve x"])]


def test_jsonl_gz(tmp_path: Path) -> None:
    path = tmp_path / "g.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"turns": ["q"]}) + "\n")
    assert load_dataset(str(path)) == [Sample("g/1", ["q"])]
    assert dataset_name(str(path)) == "g"


def test_txt_one_prompt_per_line(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("first\n\n  second  \n", encoding="utf-8")
    assert [s.turns for s in load_dataset(str(path))] == [["first"], ["second"]]


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"turns": ["ok"]}, "", "{not json"])
    with pytest.raises(DatasetError, match=r"line 3 of .*bad\.jsonl"):
        load_dataset(str(path))


@pytest.mark.parametrize("row", [[1, 2], {"text": "x"}, {"turns": []}, {"turns": ["ok", 3]}, {"prompt": "  "}])
def test_line_without_usable_turns(tmp_path: Path, row: object) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(DatasetError, match="line 2"):
        load_dataset(str(path))


def test_empty_dataset(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DatasetError, match="no samples"):
        load_dataset(str(path))


def test_missing_file_has_hint(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not found") as info:
        load_dataset(str(tmp_path / "nope.jsonl"))
    assert info.value.hint


def test_unknown_name_lists_available_datasets() -> None:
    with pytest.raises(DatasetError) as info:
        load_dataset("wikitext")
    assert "available: alpaca, gsm8k, humaneval, math500, mbpp, mt-bench" in info.value.message
    assert ".jsonl" in info.value.hint and ".txt" in info.value.hint


@pytest.mark.parametrize("name", ["gsm8k", "math500", "mbpp", "mt-bench", "alpaca"])
def test_named_dataset_missing_says_where_it_looked(name: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_DATASETS_DIR", str(tmp_path))
    with pytest.raises(DatasetError) as info:
        load_dataset(name)
    assert str(tmp_path / f"{name}.jsonl") in info.value.message
    assert "Hugging Face datasets cache" in info.value.message and "split" in info.value.message


# A few rows of each dataset in its own Hugging Face columns, and the prompts z-lab's benchmark.py makes.
NAMED_ROWS = {
    "gsm8k": (
        [{"question": "What is 2+3?", "answer": "5"}],
        [["What is 2+3?\nPlease reason step by step, and put your final answer within \\boxed{}."]],
        ["gsm8k/0"],
    ),
    "math500": (
        [{"problem": "Solve x+1=2.", "solution": "1", "answer": "1", "unique_id": "test/algebra/1.json"}],
        [["Solve x+1=2.\nPlease reason step by step, and put your final answer within \\boxed{}."]],
        ["math500/test/algebra/1.json"],
    ),
    "mbpp": (
        [{"task_id": 602, "prompt": "Write a python function to find the first repeated character.", "code": ""}],
        [["Write a python function to find the first repeated character."]],
        ["mbpp/602"],
    ),
    "mt-bench": (
        [{"prompt_id": 81, "prompt": ["Compose a blog post.", "Rewrite it in limericks."], "category": "writing"}],
        [["Compose a blog post.", "Rewrite it in limericks."]],
        ["mt-bench/81"],
    ),
    "alpaca": (
        [
            {"instruction": "Give three tips.", "input": "", "output": "..."},
            {"instruction": "Translate.", "input": "Bonjour", "output": "Hello"},
        ],
        [["Give three tips."], ["Translate.\n\nBonjour"]],
        ["alpaca/0", "alpaca/1"],
    ),
}


@pytest.mark.parametrize("name", sorted(NAMED_ROWS))
def test_named_dataset_from_a_local_copy(name: str, tmp_path: Path, monkeypatch) -> None:
    import json

    rows, turns, ids = NAMED_ROWS[name]
    monkeypatch.setenv("DFLASH_DATASETS_DIR", str(tmp_path))
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    samples = load_dataset(name)
    assert [s.turns for s in samples] == turns and [s.id for s in samples] == ids


def test_named_dataset_with_wrong_columns(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_DATASETS_DIR", str(tmp_path))
    (tmp_path / "gsm8k.jsonl").write_text('{"text": "no question here"}\n', encoding="utf-8")
    with pytest.raises(DatasetError) as info:
        load_dataset("gsm8k")
    assert "lacks the field 'question'" in info.value.message and "openai/gsm8k" in info.value.hint


def test_unsupported_extension(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("a\n", encoding="utf-8")
    with pytest.raises(DatasetError, match="unsupported"):
        load_dataset(str(path))


def test_duplicate_ids_are_refused(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    with pytest.raises(DatasetError, match="two samples with id 'a'"):
        load_dataset(str(path))


def test_max_samples_is_seeded_and_sorted() -> None:
    full = load_dataset("humaneval")
    picked = load_dataset("humaneval", max_samples=10, seed=3)
    expected = sorted(random.Random(3).sample(range(164), 10))
    assert [s.id for s in picked] == [full[i].id for i in expected]
    assert picked == load_dataset("humaneval", max_samples=10, seed=3)
    assert picked != load_dataset("humaneval", max_samples=10, seed=4)


def test_max_samples_at_or_above_size_keeps_all() -> None:
    samples = [Sample(str(i), ["p"]) for i in range(5)]
    assert select_samples(samples, max_samples=5, seed=0) == samples
    assert select_samples(samples, max_samples=50, seed=0) == samples
    with pytest.raises(DatasetError):
        select_samples(samples, max_samples=0, seed=0)


def test_dataset_name() -> None:
    assert dataset_name("humaneval") == "humaneval"
    assert dataset_name("/data/gsm8k.jsonl") == "gsm8k"
    assert dataset_name("prompts.txt") == "prompts"


@pytest.mark.parametrize(
    ("name", "make", "said"), [("gone.png", None, "is not found"), ("adir", "dir", "is a directory")]
)
def test_an_image_row_says_what_its_path_is(tmp_path: Path, name: str, make: str | None, said: str) -> None:
    if make == "dir":
        (tmp_path / name).mkdir()
    data = _write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "what is here?", "images": [name]}])
    with pytest.raises(DatasetError, match=f"line 1 of .*: image .*{name} {said}"):
        load_dataset(str(data))
