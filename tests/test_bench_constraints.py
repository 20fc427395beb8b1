"""`dflash bench` dataset rows that carry a `json_schema` or a `regex`: every mode's constrained answer equals
constrained plain decoding's (bench's own lossless check) and follows the row's constraint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dflash_cli.bench import BenchSettings, run_bench
from dflash_cli.bench.datasets import load_dataset
from dflash_cli.errors import DatasetError

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


def test_constrained_rows_are_lossless_in_every_mode_and_follow_their_constraint(qwen3_logits_engine, tmp_path):
    rows = [
        {"id": "schema", "prompt": "give me a number", "json_schema": SCHEMA},
        {"id": "regex", "prompt": "a date:", "regex": r"[0-9]{4}-[0-9]{2}"},
        {"id": "free", "prompt": "def f(x):"},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = load_dataset(str(path))
    assert [s.constraint.kind if s.constraint else None for s in samples] == ["json_schema", "regex", None]
    modes = ("plain", "dflash", "lookup", "hybrid")
    result = run_bench(qwen3_logits_engine, samples, BenchSettings(dataset=str(path), max_new_tokens=24), modes=modes)
    assert result.lossless_checked and not result.mismatches
    eos = set(qwen3_logits_engine.eos_token_ids)
    by_id = {r.sample_id: r for r in result.records}
    texts = {
        i: qwen3_logits_engine.decode([t for t in by_id[i].results["plain"].tokens if t not in eos]) for i in by_id
    }
    doc = json.loads(texts["schema"])
    assert set(doc) == {"n", "ok"} and 0 <= doc["n"] <= 9
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}", texts["regex"])


@pytest.mark.parametrize(
    "row, words",
    [
        ({"prompt": "x", "json_schema": "not an object"}, "must be a JSON schema object"),
        ({"prompt": "x", "regex": ""}, "non-empty string"),
        ({"prompt": "x", "regex": "a", "json_schema": {}}, "both"),
    ],
)
def test_bad_constraint_fields_name_the_line(tmp_path: Path, row, words):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=words):
        load_dataset(str(path))
