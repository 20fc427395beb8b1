"""bench's baseline: plain decoding on its own target session with spinning threads (its best CPU setting)."""

from __future__ import annotations

from dflash_cli.bench import BenchSettings, build_document, run_bench
from dflash_cli.bench.datasets import Sample
from dflash_cli.bench.formats import to_markdown


def test_bench_runs_plain_on_its_own_spinning_session(qwen3_engine) -> None:
    engine = qwen3_engine
    try:
        samples = [Sample(f"s{i}", [f"def add_{i}(a, b):"]) for i in range(3)]
        settings = BenchSettings(dataset="t.jsonl", max_new_tokens=10)
        result = run_bench(engine, samples, settings, modes=("plain", "dflash"))
        assert result.engine_info["plain_session"] == "its own target session, spinning on"
        assert engine._plain_target is not None and engine._plain_target is not engine.target
        assert not result.mismatches  # the other session decodes the same tokens
        doc = build_document(result)
        assert doc["environment"]["plain_session"] == "its own target session, spinning on"
        assert "plain ran on its own target session, spinning on" in to_markdown(doc)
    finally:
        engine._plain_target = None  # other tests share this engine


def test_plain_same_keeps_one_session(qwen3_engine) -> None:
    samples = [Sample("s0", ["def add(a, b):"])]
    settings = BenchSettings(dataset="t.jsonl", max_new_tokens=6, plain_best=False)
    result = run_bench(qwen3_engine, samples, settings, modes=("plain", "dflash"))
    assert "plain_session" not in result.engine_info and qwen3_engine._plain_target is None
