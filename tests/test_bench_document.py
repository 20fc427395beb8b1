"""The bench JSON document: field names CI relies on, values from the scripted engine, gates, sweep."""

from __future__ import annotations

import json

import pytest

from dflash_cli.bench import (
    BenchSettings,
    build_document,
    build_sweep_document,
    check_floors,
    check_lossless,
    run_bench,
)
from dflash_cli.bench.datasets import Sample
from dflash_cli.bench.environment import cpu_model, environment
from dflash_cli.bench.report import report_renderables
from dflash_cli.errors import LosslessError, ThresholdError
from tests.test_bench_fakes import FakeEngine

SAMPLES = [Sample(f"s{i}", [f"prompt number {i}"]) for i in range(4)]
SETTINGS = BenchSettings(dataset="/data/gsm8k.jsonl", max_new_tokens=13)


def _doc(**engine_kw: object) -> dict:
    return build_document(run_bench(FakeEngine(**engine_kw), SAMPLES, SETTINGS))


def test_top_level_fields() -> None:
    doc = _doc()
    assert set(doc) == {
        "schema_version",
        "environment",
        "settings",
        "dataset",
        "baseline",
        "dflash",
        "lookup",
        "pld",  # schema 2: lookup's section again under its schema-1 name
        "decode_speedup",
        "decode_speedup_median",
        "mean_acceptance_length",
        "acceptance_histogram",
        "per_position_acceptance",
        "repetition_rate",
        "decomposition",
        "lossless",
        # v2 additions (nothing above was dropped): provenance, the speedup's spread, vLLM's names.
        "timestamp",
        "tool_commit",
        "hybrid",
        "decode_speedup_bootstrap",
        "spec_decode_num_drafts",
        "spec_decode_draft_tokens",
        "spec_decode_accepted_tokens",
        "spec_decode_acceptance_length",
        "spec_decode_acceptance_rate",
        "spec_decode_per_position_acceptance_rates",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "output_throughput",
        "completed",
        "duration",
    }
    assert doc["schema_version"] == 2
    assert doc["pld"] is doc["lookup"]
    json.dumps(doc, allow_nan=False)  # strict JSON: no NaN/inf sneaks in


def test_environment_and_dataset() -> None:
    doc = _doc()
    env = doc["environment"]
    for key in ("python", "dflash", "torch", "onnxruntime", "platform", "cpu", "provider", "recipe", "artifact_keys"):
        assert key in env
    assert env["provider"] == "CPUExecutionProvider" and env["recipe"] == "fake"
    assert doc["dataset"] == {
        "name": "gsm8k",
        "spec": "/data/gsm8k.jsonl",
        "n_samples": 4,
        "n_turns": 4,
        "sample_ids": ["s0", "s1", "s2", "s3"],
    }
    for key in ("max_new_tokens", "temperature", "seed", "block_size", "recipe", "artifact_keys", "modes"):
        assert key in doc["settings"]


def test_mode_sections_and_values() -> None:
    doc = _doc()
    for section in ("baseline", "dflash", "lookup"):
        for key in ("decode_tokens_per_s", "tpot_s", "ttft_s", "mean_acceptance_length", "repetition_rate"):
            assert key in doc[section], (section, key)
    for key in ("acceptance_histogram", "per_position_acceptance", "decode_speedup"):
        assert key in doc["dflash"] and key in doc["lookup"]
    # fake: 12 decode tokens per sample; plain 2 ms/token; dflash accepts 4,3,1,2,2 -> 5 steps of 3 ms
    assert doc["baseline"]["tpot_s"] == pytest.approx(0.002)
    assert doc["dflash"]["tpot_s"] == pytest.approx(0.015 / 12)
    assert doc["decode_speedup"] == pytest.approx(0.002 / (0.015 / 12))
    assert doc["mean_acceptance_length"] == pytest.approx(12 / 5)
    assert doc["acceptance_histogram"]["counts"] == [4, 8, 4, 4]
    assert doc["per_position_acceptance"] == pytest.approx([16 / 20, 8 / 16, 4 / 8])
    # lookup accepts 1,2 repeating: 8 steps per sample
    assert doc["lookup"]["mean_acceptance_length"] == pytest.approx(12 / 8)
    # every sample has the same steps, so averaging per sample first changes nothing here
    assert doc["dflash"]["mean_acceptance_length_per_sample"] == pytest.approx(12 / 5)
    assert doc["lookup"]["decode_speedup"] == pytest.approx(0.002 / (0.024 / 12))
    assert doc["baseline"]["ttft_s"] == pytest.approx(0.010)


def test_decomposition() -> None:
    dec = _doc()["decomposition"]
    assert set(dec) >= {
        "t1_s",
        "t_verify_s",
        "t_draft_s",
        "ceiling_speedup",
        "measured_speedup",
        "weight_bandwidth_gb_s",
        "loop_overhead_fraction",
    }
    assert dec["ceiling_speedup"] == pytest.approx(2.4 * 0.002 / 0.003)
    # dflash: 5 steps in 15 ms per sample -> 333.3 steps/s x 2.5 GB
    assert dec["weight_bandwidth_gb_s"]["dflash"] == pytest.approx(2.5 * 1000 / 3)
    assert dec["weight_bandwidth_gb_s"]["plain"] == pytest.approx(2.0 * 500)
    assert dec["loop_overhead_fraction"] == pytest.approx(0.5 / 3)


def test_repetition_and_lossless_sections() -> None:
    doc = _doc()
    assert set(doc["repetition_rate"]) == {"median", "plain", "dflash", "lookup"}
    assert doc["lossless"] == {"checked": True, "mismatches": []}
    bad = _doc(mismatch={"lookup": 3})
    first = bad["lossless"]["mismatches"][0]
    assert first == {
        "sample_id": "s0",
        "turn": 0,
        "mode": "lookup",
        "position": 3,
        "expected": first["expected"],
        "got": first["expected"] + 1,
    }
    with pytest.raises(LosslessError, match="lookup output differs.*sample 's0' at generated token 3"):
        check_lossless(bad)


@pytest.mark.parametrize(
    ("facts", "cause"),
    [
        ({}, "a rollback or cache-position bug"),
        ({"precision": "int4", "checks": "smoke + causal invariance"}, "passed the causal-invariance check"),
        ({"precision": "int8", "checks": "skipped: too big"}, "not checked for causal invariance"),
    ],
)
def test_lossless_hint_names_the_likely_cause(facts: dict, cause: str) -> None:
    bad = _doc(mismatch={"dflash": 2})
    bad["environment"]["compile"] = facts
    with pytest.raises(LosslessError) as exc:
        check_lossless(bad)
    assert cause in exc.value.hint


def test_without_baseline_speedups_are_null() -> None:
    doc = build_document(run_bench(FakeEngine(), SAMPLES, SETTINGS, modes=("dflash",)))
    assert doc["baseline"] is None and doc["decode_speedup"] is None
    assert doc["decomposition"]["measured_speedup"] is None
    assert doc["mean_acceptance_length"] == pytest.approx(12 / 5)
    with pytest.raises(ThresholdError, match="not measured"):
        check_floors(doc, min_speedup=1.0)


def test_floors() -> None:
    doc = _doc()  # speedup 1.6x, tau 2.4
    check_floors(doc, min_speedup=1.5, min_tau=2.0)
    with pytest.raises(ThresholdError, match=r"decode speedup 1.60x < floor 2.00x") as info:
        check_floors(doc, min_speedup=2.0)
    assert info.value.exit_code == 4
    with pytest.raises(ThresholdError, match=r"speedup 1.60x < floor 3.00x; mean acceptance length 2.40 < floor 5"):
        check_floors(doc, min_speedup=3.0, min_tau=5.0)


def test_sweep_document_names_the_fastest() -> None:
    docs = {}
    for block, accepts in ((4, (2,)), (8, (6,))):
        engine = FakeEngine(block_size=block, dflash_accepts=accepts, mismatch={"dflash": 1} if block == 4 else None)
        docs[block] = build_document(run_bench(engine, SAMPLES, SETTINGS), env={})
    doc = build_sweep_document(docs)
    assert doc["sweep"]["fastest_block_size"] == 8
    assert [r["block_size"] for r in doc["sweep"]["runs"]] == [4, 8]
    assert doc["settings"]["block_size"] == 8
    assert doc["sweep"]["runs"][0]["lossless_mismatches"] == 4
    assert {m["block_size"] for m in doc["lossless"]["mismatches"]} == {4}
    with pytest.raises(LosslessError, match=r"block size 4"):
        check_lossless(doc)


def test_tables_render_from_the_document() -> None:
    from rich.console import Console

    doc = _doc(mismatch={"dflash": 2})
    console = Console(record=True, width=160)
    for part in report_renderables(doc):
        console.print(part)
    text = console.export_text()
    for needle in ("decode tok/s", "TPOT ms", "tau", "speedup", "prompt lookup", "ceiling", "mismatch"):
        assert needle in text


def test_tables_render_a_hybrid_that_verified_past_the_block() -> None:
    """The hybrid's lookup steps may verify past the block: its histogram and per-position rows run longer
    than the other modes', and the tables show every row."""
    from rich.console import Console

    doc = _doc()
    n = len(doc["dflash"]["acceptance_histogram"]["lengths"]) + 3
    doc["hybrid"] = {
        **doc["dflash"],
        "acceptance_histogram": {"lengths": list(range(1, n + 1)), "counts": [7] * n, "fractions": [1 / n] * n},
        "per_position_acceptance": [0.25] * (n - 1),
    }
    console = Console(record=True, width=160)
    for part in report_renderables(doc):
        console.print(part)
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in console.export_text().splitlines()]
    assert any(row[:1] == [str(n)] and row[-2].startswith("7 (") and row[1] == "" for row in cells)
    assert sum("25.0%" in row for row in cells) == n - 1


def test_cpu_model_and_environment(tmp_path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\n")
    assert cpu_model(info) == "Test CPU 9000"
    assert cpu_model(tmp_path / "missing")  # falls back to platform facts
    env = environment({"provider": "qaic", "recipe": "r", "artifact_keys": {"a": "b"}})
    assert env["provider"] == "qaic" and env["artifact_keys"] == {"a": "b"}


def test_progress_lines_without_a_terminal() -> None:
    import io

    from rich.console import Console

    from dflash_cli.bench.report import LiveProgress
    from dflash_cli.bench.runner import BenchProgress

    buffer = io.StringIO()
    with LiveProgress(Console(file=buffer), "bench b=4", live=False) as progress:
        progress.update(BenchProgress(done=1, total=2, sample_id="[x]", turn=0, resumed=True, tau=2.5))
    assert buffer.getvalue() == "bench b=4 [1/2] [x]#0 (resumed) tau 2.50\n"

    terminal = io.StringIO()
    with LiveProgress(Console(file=terminal, force_terminal=True), "bench", live=True) as progress:
        progress.update(BenchProgress(done=2, total=2, sample_id="s", turn=0, resumed=False, tau=None))
    assert "2/2" in terminal.getvalue()
