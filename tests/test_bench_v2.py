"""bench v2: repetitions and their spread, vLLM-named fields, report formats, `bench compare`, --endpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_cli.bench import BenchSettings, ResultsLog, build_document, run_bench
from dflash_cli.bench.datasets import Sample
from dflash_cli.bench.formats import to_csv, to_markdown
from dflash_cli.bench.spread import bootstrap, percentile, spread
from dflash_cli.bench.vllm_fields import latency_fields, spec_decode_fields
from dflash_cli.cli.app import create_app
from dflash_cli.decoding.result import GenerationResult
from tests.test_bench_fakes import FakeEngine

SAMPLES = [Sample(f"s{i}", [f"prompt number {i}"]) for i in range(4)]


def test_percentiles_and_spread_on_hand_made_timings():
    values = [10.0, 20.0, 30.0, 40.0, 100.0]
    assert percentile(values, 50) == 30.0
    assert percentile(values, 90) == pytest.approx(40 + 0.6 * 60)  # position 3.6 between 40 and 100
    assert percentile(values, 99) == pytest.approx(40 + 0.96 * 60)
    s = spread(values)
    assert s["mean"] == 40.0 and s["median"] == 30.0 and s["n"] == 5
    assert s["std"] == pytest.approx(math.sqrt(((30**2) + 20**2 + 10**2 + 0 + 60**2) / 4))
    assert spread([5.0])["std"] == 0.0 and spread([])["mean"] is None


def test_bootstrap_interval_covers_the_statistic_and_is_reproducible():
    groups = [[1.0], [2.0], [3.0], [4.0]]
    mean = lambda gs: sum(g[0] for g in gs) / len(gs)  # noqa: E731
    a, b = bootstrap(groups, mean, seed=3), bootstrap(groups, mean, seed=3)
    assert a == b and 1.0 <= a["ci95"][0] <= 2.5 <= a["ci95"][1] <= 4.0
    assert bootstrap([[2.0]] * 5, mean)["ci95"] == [2.0, 2.0]


def test_vllm_fields_on_a_hand_computed_example():
    """Block 4 (3 draft tokens a draft). Steps committing 1, 4, 2, 2 tokens accepted 0, 3, 1, 1 drafts."""
    r = GenerationResult("dflash", 5, list(range(9)), accept_lengths=[1, 4, 2, 2], prefill_s=0.05, decode_s=0.16)
    f = spec_decode_fields([r], block_size=4)
    assert f["spec_decode_num_drafts"] == 4 and f["spec_decode_draft_tokens"] == 12
    assert f["spec_decode_accepted_tokens"] == 5
    assert f["spec_decode_acceptance_length"] == pytest.approx(1 + 5 / 4)
    assert f["spec_decode_acceptance_rate"] == pytest.approx(5 / 12)
    # Unconditional: accepted at position i / all drafts = 3/4, 1/4, 1/4.
    assert f["spec_decode_per_position_acceptance_rates"] == pytest.approx([0.75, 0.25, 0.25])
    # Our conditional per_position_acceptance on the same steps: 3/4, then 1 of the 3 that reached 2, ...
    from dflash_cli.bench.metrics import per_position_acceptance

    assert per_position_acceptance([r], 4) == pytest.approx([0.75, 1 / 3, 1.0])
    lat = latency_fields([r])
    assert lat["mean_ttft_ms"] == pytest.approx(50.0) and lat["mean_tpot_ms"] == pytest.approx(20.0)
    assert lat["completed"] == 1 and lat["duration"] == pytest.approx(0.21)
    assert lat["output_throughput"] == pytest.approx(9 / 0.21)


def test_repeat_records_every_repetition_and_warmup_is_discarded(tmp_path: Path):
    engine = FakeEngine()
    settings = BenchSettings(dataset="fake.jsonl", max_new_tokens=10, repeat=3, warmup=2)
    log = tmp_path / "r.jsonl"
    result = run_bench(engine, SAMPLES, settings, results_log=ResultsLog(log))
    assert len(engine.calls) == 3 * (2 + 4 * 3)  # warmup: 2 samples x 3 modes, then 4 samples x 3 reps
    assert len(result.records) == 12 and len(log.read_text().splitlines()) == 13
    assert [(r.sample_id, r.rep) for r in result.records[:3]] == [("s0", 0), ("s0", 1), ("s0", 2)]
    # The mode order alternates between repetitions of a sample too.
    first = [mode for _, mode in engine.calls[6:15]]
    assert first == ["plain", "dflash", "lookup", "lookup", "dflash", "plain", "plain", "dflash", "lookup"]
    doc = build_document(result, env={})
    assert doc["dflash"]["tpot_ms_spread"]["n"] == 12
    assert doc["dflash"]["completed"] == 12 and doc["settings"]["repeat"] == 3
    boot = doc["decode_speedup_bootstrap"]
    assert boot["ci95"][0] <= doc["decode_speedup"] <= boot["ci95"][1]


def test_resume_continues_inside_the_repetitions(tmp_path: Path):
    settings = BenchSettings(dataset="fake.jsonl", max_new_tokens=10, repeat=2)
    log = tmp_path / "r.jsonl"
    with pytest.raises(KeyboardInterrupt):
        run_bench(FakeEngine(interrupt_after=9), SAMPLES, settings, results_log=ResultsLog(log))
    resumed = FakeEngine()
    result = run_bench(resumed, SAMPLES, settings, results_log=ResultsLog(log, resume=True))
    assert len(resumed.calls) == 3 * 8 - 9  # only what the killed run had not finished
    assert len(result.records) == 8


def test_markdown_and_csv_reports():
    doc = build_document(run_bench(FakeEngine(), SAMPLES, BenchSettings(dataset="x.jsonl", repeat=2)), env={})
    md = to_markdown(doc)
    assert "| dflash |" in md and "95% CI" in md and "repeat 2" in md
    rows = to_csv(doc).splitlines()
    assert rows[0].startswith("mode,decode_tok_s") and len(rows) == 4  # header + plain, dflash, lookup


def _bench(*args: str):
    return CliRunner().invoke(create_app(), ["bench", *args])


def test_compare_two_documents(tmp_path: Path):
    docs = []
    for i, engine_kw in enumerate(({}, {"dflash_accepts": (4,)})):
        doc = build_document(
            run_bench(FakeEngine(**engine_kw), SAMPLES, BenchSettings(dataset="x.jsonl", repeat=2)), env={}
        )
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(doc))
        docs.append(path)
    res = _bench("compare", str(docs[0]), str(docs[1]), "--json")
    assert res.exit_code == 0, res.output
    table = json.loads(res.stdout)
    rows = {r["metric"]: r for r in table["rows"]}
    speed = rows["dflash speedup"]
    assert speed["ratios"][0] == 1.0 and speed["ratios"][1] == pytest.approx(speed["values"][1] / speed["values"][0])
    assert speed["outside_spread"][1] in (True, False)
    assert rows["dflash tau"]["outside_spread"][1] is None  # no spread for tau
    res = _bench("compare", str(docs[0]), str(docs[1]))
    assert res.exit_code == 0 and "dflash speedup" in res.stdout and "run1.json / run0.json" in res.stdout
    res = _bench("compare", str(docs[0]))
    assert res.exit_code == 1 and "at least two" in res.stderr
    res = _bench("compare", str(docs[0]), str(tmp_path / "missing.json"))
    assert res.exit_code == 1 and "no such file" in res.stderr
    res = _bench("comprae", str(docs[0]))
    assert res.exit_code == 2


def test_bad_format_is_a_usage_error():
    res = _bench("--format", "yaml")
    assert res.exit_code == 2


def test_endpoint_against_a_server_with_spec_counters(qwen3_engine, tmp_path: Path):
    """The tiny pair served by `dflash serve`'s app; bench reads acceptance from its /metrics and, given
    the recipe as well, checks the served greedy text against local plain decoding."""
    from tests.serving import running_server

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "import os", "a b a b"]))
    recipe, cache = str(qwen3_engine.recipe.source), str(qwen3_engine.compile_dir.parents[2])
    with running_server(qwen3_engine) as (url, _):
        common = ["--endpoint", url, "--dataset", str(data), "--max-new-tokens", "12", "--repeat", "2"]
        res = _bench(*common, "--json", "-r", recipe, "--cache-dir", cache, "--warmup", "0")
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        ep = doc["endpoint"]
        assert ep["completed"] == 6 and ep["median_ttft_ms"] > 0
        assert ep["spec_decode_num_drafts"] > 0 and 1 <= ep["spec_decode_acceptance_length"] <= 4
        assert len(ep["spec_decode_per_position_acceptance_rates"]) == qwen3_engine.block_size - 1
        assert doc["lossless"] == {"checked": True, "mismatches": []}
        res = _bench(*common, "--format", "md")
        assert res.exit_code == 0 and "| endpoint |" in res.stdout


def test_endpoint_without_counters_reports_acceptance_unavailable(tmp_path: Path, monkeypatch):
    from dflash_cli.bench.endpoint import Endpoint
    from dflash_cli.bench.endpoint_run import run_endpoint

    monkeypatch.setattr(Endpoint, "counters", lambda self: None)
    replies = iter(range(100))

    def chat(self, model, messages, settings, seed):
        n = next(replies)
        return {"text": f"r{n}", "t0": 0.0, "first": 0.1, "last": 0.3, "end": 0.3, "usage": {"completion_tokens": 5}}

    monkeypatch.setattr(Endpoint, "chat", chat)
    out = run_endpoint(Endpoint("http://127.0.0.1:9"), "m", SAMPLES[:2], BenchSettings(dataset="x"))
    assert out["endpoint"]["spec_decode"].startswith("unavailable")
    assert out["endpoint"]["mean_tpot_ms"] == pytest.approx(50.0) and out["lossless"]["checked"] is False


def test_endpoint_unreachable_is_one_error_line(tmp_path: Path):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "x"}) + "\n")
    res = _bench("--endpoint", "http://127.0.0.1:9", "--dataset", str(data))
    assert res.exit_code == 1 and "cannot reach http://127.0.0.1:9" in res.stderr and "hint:" in res.stderr
