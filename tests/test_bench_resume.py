"""The JSONL results log: a killed run resumes without repeating or losing a sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_cli.bench import BenchSettings, ResultsLog, build_document, default_results_path, run_bench
from dflash_cli.bench.datasets import Sample
from dflash_cli.errors import DFlashError
from tests.test_bench_fakes import FakeEngine

SAMPLES = [Sample(f"s{i}", [f"prompt number {i}"]) for i in range(5)]
SETTINGS = BenchSettings(dataset="fake.jsonl", max_new_tokens=10)


def _records(path: Path) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["type"] == "header"
    return lines[1:]


def _keys(path: Path) -> list[tuple[str, int]]:
    return [(r["sample_id"], r["turn"]) for r in _records(path)]


def test_log_holds_header_and_one_line_per_turn(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    run_bench(FakeEngine(), SAMPLES, SETTINGS, results_log=ResultsLog(path))
    header = json.loads(path.read_text().splitlines()[0])
    assert header["settings"]["max_new_tokens"] == 10
    assert header["settings"]["block_size"] == 4
    assert header["settings"]["recipe"] == "fake"
    assert header["settings"]["artifact_keys"] == {"convert": "k1", "export": "k2"}
    records = _records(path)
    assert _keys(path) == [(s.id, 0) for s in SAMPLES]
    assert set(records[0]["results"]) == {"plain", "dflash", "lookup"}
    assert records[0]["results"]["dflash"]["accept_lengths"]


def test_resume_after_interrupt_loses_and_repeats_nothing(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    killed = FakeEngine(interrupt_after=7)  # two samples done (6 calls), killed inside the third
    with pytest.raises(KeyboardInterrupt):
        run_bench(killed, SAMPLES, SETTINGS, results_log=ResultsLog(path))
    assert _keys(path) == [("s0", 0), ("s1", 0)]

    resumed = FakeEngine()
    result = run_bench(resumed, SAMPLES, SETTINGS, results_log=ResultsLog(path, resume=True))
    assert len(resumed.calls) == 3 * (len(SAMPLES) - 2)
    assert _keys(path) == [(s.id, 0) for s in SAMPLES]
    assert [r.resumed for r in result.records] == [True, True, False, False, False]

    # the resumed run reports the same numbers as one uninterrupted run
    full = FakeEngine()
    fresh = run_bench(full, SAMPLES, SETTINGS)
    assert resumed.calls == full.calls[6:]  # exactly the samples the killed run had not finished
    doc, fresh_doc = build_document(result, env={}), build_document(fresh, env={})
    assert doc["dflash"] == fresh_doc["dflash"] and doc["decode_speedup"] == fresh_doc["decode_speedup"]


def test_resume_of_a_finished_run_generates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    run_bench(FakeEngine(), SAMPLES, SETTINGS, results_log=ResultsLog(path))
    again = FakeEngine()
    result = run_bench(again, SAMPLES, SETTINGS, results_log=ResultsLog(path, resume=True))
    assert again.calls == [] and len(result.records) == len(SAMPLES)
    assert _keys(path) == [(s.id, 0) for s in SAMPLES]


def test_truncated_last_line_is_dropped_and_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    run_bench(FakeEngine(), SAMPLES, SETTINGS, results_log=ResultsLog(path))
    data = path.read_bytes()
    path.write_bytes(data[:-25])  # killed in the middle of writing the last sample

    resumed = FakeEngine()
    run_bench(resumed, SAMPLES, SETTINGS, results_log=ResultsLog(path, resume=True))
    assert len(resumed.calls) == 3 and resumed.calls[0][1] == "plain"  # only the torn sample s4 again
    assert _keys(path) == [(s.id, 0) for s in SAMPLES]


def test_resume_with_other_settings_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    run_bench(FakeEngine(), SAMPLES[:1], SETTINGS, results_log=ResultsLog(path))
    other = BenchSettings(dataset="fake.jsonl", max_new_tokens=20)
    with pytest.raises(DFlashError, match=r"settings differ.*max_new_tokens: 10 -> 20") as info:
        run_bench(FakeEngine(), SAMPLES, other, results_log=ResultsLog(path, resume=True))
    assert "--resume" in info.value.hint
    with pytest.raises(DFlashError, match="block_size"):
        run_bench(FakeEngine(block_size=8), SAMPLES, SETTINGS, results_log=ResultsLog(path, resume=True))


def test_resume_without_a_file_starts_fresh(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.jsonl"
    run_bench(FakeEngine(), SAMPLES[:2], SETTINGS, results_log=ResultsLog(path, resume=True))
    assert _keys(path) == [("s0", 0), ("s1", 0)]


def test_without_resume_the_file_starts_over(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    run_bench(FakeEngine(), SAMPLES, SETTINGS, results_log=ResultsLog(path))
    engine = FakeEngine()
    run_bench(engine, SAMPLES[:1], SETTINGS, results_log=ResultsLog(path))
    assert len(engine.calls) == 3 and _keys(path) == [("s0", 0)]


def test_corrupt_middle_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    run_bench(FakeEngine(), SAMPLES[:3], SETTINGS, results_log=ResultsLog(path))
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = "{garbage\n"
    path.write_text("".join(lines))
    with pytest.raises(DFlashError, match="corrupt at line 3"):
        run_bench(FakeEngine(), SAMPLES, SETTINGS, results_log=ResultsLog(path, resume=True))


def test_multi_turn_resume_rebuilds_history_from_the_log(tmp_path: Path) -> None:
    samples = [Sample("m", ["first", "second"])]
    path = tmp_path / "r.jsonl"
    uninterrupted = FakeEngine()
    run_bench(uninterrupted, samples, SETTINGS)

    with pytest.raises(KeyboardInterrupt):
        run_bench(FakeEngine(interrupt_after=3), samples, SETTINGS, results_log=ResultsLog(path))
    assert _keys(path) == [("m", 0)]
    resumed = FakeEngine()
    run_bench(resumed, samples, SETTINGS, results_log=ResultsLog(path, resume=True))
    assert resumed.calls == uninterrupted.calls[3:]  # same second-turn prompt, nothing repeated
    assert _keys(path) == [("m", 0), ("m", 1)]


def test_default_results_path(tmp_path: Path) -> None:
    path = default_results_path(tmp_path, "qwen3-8b", "my data", 16)
    assert path == tmp_path / "bench" / "qwen3-8b-my_data-b16.jsonl"


def test_resume_refuses_a_changed_stop_list_or_template(tmp_path: Path) -> None:
    """Answers made with another stop list, chat template or thinking switch must not be mixed in."""
    from types import SimpleNamespace

    def engine(stop: list[str], template: bool = False) -> FakeEngine:
        e = FakeEngine()
        e.recipe = SimpleNamespace(run=SimpleNamespace(chat_template=template, enable_thinking=False, stop=stop))
        return e

    path = tmp_path / "r.jsonl"
    run_bench(engine(["\n\n"]), SAMPLES[:1], SETTINGS, results_log=ResultsLog(path))
    with pytest.raises(DFlashError, match="run"):
        run_bench(engine(["###"]), SAMPLES, SETTINGS, results_log=ResultsLog(path, resume=True))
    with pytest.raises(DFlashError, match="run"):
        run_bench(engine(["\n\n"], template=True), SAMPLES, SETTINGS, results_log=ResultsLog(path, resume=True))
    run_bench(engine(["\n\n"]), SAMPLES, SETTINGS, results_log=ResultsLog(path, resume=True))
