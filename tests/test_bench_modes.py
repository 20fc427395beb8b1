"""One list of modes (decoding/modes.py) that bench, reports, compare and the CLI derive from; `pld`, lookup's
old name, as an alias: accepted as input, read from old documents and results logs, reported as `lookup`."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_cli.bench import BenchSettings, ResultsLog, build_document, run_bench
from dflash_cli.bench.compare import HEADLINE, compare, load_documents
from dflash_cli.bench.datasets import Sample
from dflash_cli.bench.document import MODE_SECTIONS, PLD_ALIAS, section_key, upgrade_document
from dflash_cli.bench.formats import mode_rows
from dflash_cli.cli.app import create_app
from dflash_cli.cli.bench_args import parse_modes
from dflash_cli.decoding.modes import ALIASES, MODES, MODES_INFO, SPECULATIVE_MODES, canonical
from dflash_cli.errors import DFlashError
from tests.test_bench_fakes import FakeEngine

SAMPLES = [Sample(f"s{i}", [f"prompt number {i}"]) for i in range(3)]
SETTINGS = BenchSettings(dataset="fake.jsonl", max_new_tokens=10)
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_each_mode_once_and_every_list_derives_from_it():
    assert len(set(MODES)) == len(MODES) == len(MODES_INFO)
    assert not set(ALIASES) & set(MODES) and set(ALIASES.values()) <= set(MODES)
    assert SPECULATIVE_MODES == tuple(m for m in MODES if m != "plain")
    sections = dict(MODE_SECTIONS)
    assert all(sections[section_key(m.name)] == m.label for m in MODES_INFO)
    assert {mode for _, mode, _, _ in HEADLINE} - {"baseline"} == set(SPECULATIVE_MODES)
    assert parse_modes(",".join(MODES)) == MODES
    # The recipe's run.drafter choices are the speculative modes' names.
    from dflash_cli.recipe.schema import RunConfig

    drafters = typing.get_args(RunConfig.model_fields["drafter"].annotation)
    assert set(drafters) == set(SPECULATIVE_MODES)


def test_bench_runs_and_reports_every_mode():
    engine = FakeEngine()
    engine.accepts["hybrid"] = (3, 1)
    doc = build_document(run_bench(engine, SAMPLES, SETTINGS, modes=MODES))
    assert {mode for _, mode in engine.calls} == set(MODES)
    assert doc["settings"]["modes"] == list(MODES)
    for mode in MODES:
        assert doc[section_key(mode)]["n_generations"] == len(SAMPLES)
    assert [r["mode"] for r in mode_rows(doc)] == [m.label for m in MODES_INFO]
    assert doc[PLD_ALIAS] is doc["lookup"]  # schema 2's alias, the same section


def test_pld_is_accepted_as_lookup_and_reported_as_lookup():
    assert canonical("pld") == "lookup" and parse_modes("plain,pld") == ("plain", "lookup")
    with pytest.raises(DFlashError):
        parse_modes("plain,pld,lookup")  # the same mode twice
    engine = FakeEngine()
    result = run_bench(engine, SAMPLES, SETTINGS, modes=("plain", "pld"))
    assert result.modes == ("plain", "lookup") and {m for _, m in engine.calls} == {"plain", "lookup"}


def test_bench_cli_names_the_alias(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`--modes pld` runs lookup and says so; the settings and document say lookup."""
    import dflash_cli.cli.bench as bench_cli

    seen = {}

    def fake_bench_one(recipe, overrides, cache_dir, samples, settings, modes, *args, **kwargs):
        seen["modes"] = modes
        return 4, build_document(run_bench(FakeEngine(), samples, settings, modes=modes), env={})

    monkeypatch.setattr(bench_cli, "_bench_one", fake_bench_one)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "x"}) + "\n")
    res = CliRunner().invoke(
        create_app(), ["bench", "--dataset", str(data), "--max-new-tokens", "5", "--modes", "plain,pld", "--json"]
    )
    assert res.exit_code == 0, res.output
    assert seen["modes"] == ("plain", "lookup") and "pld is lookup's old name" in res.stderr
    doc = json.loads(res.stdout)
    assert doc["settings"]["modes"] == ["plain", "lookup"] and doc["lookup"] == doc["pld"]


def test_compare_reads_old_documents_with_pld():
    old = [
        RESULTS / "hybrid" / "demo-humaneval-4modes-rev12.json",
        RESULTS / "hybrid" / "demo-humaneval-4modes-rev13.json",
    ]
    docs = load_documents(old)
    assert all(json.loads(p.read_text())["schema_version"] == 1 for p in old)
    rows = {r["metric"]: r for r in compare(docs, [p.name for p in old])["rows"]}
    lookup = rows["prompt lookup speedup"]["values"]
    assert lookup == [json.loads(p.read_text())["pld"]["decode_speedup"] for p in old] and None not in lookup
    # ... beside a schema-2 document, which names it lookup
    new = upgrade_document({"schema_version": 2, "lookup": {"decode_speedup": 2.0}, "pld": None})
    assert new["lookup"] == {"decode_speedup": 2.0}


def test_resume_reads_an_old_log_that_names_lookup_pld(tmp_path: Path):
    path = tmp_path / "r.jsonl"
    first = run_bench(FakeEngine(), SAMPLES, SETTINGS, results_log=ResultsLog(path))
    # Make it a log written before the rename: the header's modes and each turn's results say "pld".
    old = path.read_text().replace('"lookup"', '"pld"')
    assert '"pld"' in old and '"lookup"' not in old
    path.write_text(old)
    engine = FakeEngine()
    resumed = run_bench(engine, SAMPLES, SETTINGS, results_log=ResultsLog(path, resume=True))
    assert engine.calls == [] and all(r.resumed for r in resumed.records)
    assert [r.results["lookup"].mode for r in resumed.records] == ["lookup"] * len(SAMPLES)
    a, b = build_document(first, env={}), build_document(resumed, env={})
    assert a["lookup"]["decode_tokens_per_s"] == b["lookup"]["decode_tokens_per_s"]
