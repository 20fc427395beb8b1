"""run_bench with a scripted engine: interleaving, losslessness, multi-turn history, progress."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_cli.bench import BenchSettings, ResultsLog, build_document, check_lossless, run_bench
from dflash_cli.bench.datasets import Sample
from dflash_cli.bench.runner import first_difference
from dflash_cli.decoding.result import GenerationResult
from dflash_cli.errors import GenerationError, LosslessError
from tests.test_bench_fakes import FakeEngine

SAMPLES = [Sample(f"s{i}", [f"prompt number {i}"]) for i in range(4)]
SETTINGS = BenchSettings(dataset="fake.jsonl", max_new_tokens=12)


def test_modes_run_back_to_back_with_alternating_order() -> None:
    engine = FakeEngine()
    run_bench(engine, SAMPLES[:2], SETTINGS)
    modes = [mode for _, mode in engine.calls]
    assert modes == ["plain", "dflash", "lookup", "lookup", "dflash", "plain"]
    # every mode of a sample sees the same prompt ids
    assert len({ids for ids, _ in engine.calls[:3]}) == 1
    assert len({ids for ids, _ in engine.calls[3:]}) == 1


def test_lossless_run_passes() -> None:
    engine = FakeEngine()
    result = run_bench(engine, SAMPLES, SETTINGS)
    assert result.lossless_checked and result.mismatches == []
    assert [r.sample_id for r in result.records] == ["s0", "s1", "s2", "s3"]
    assert engine.step_time_calls == 1
    assert result.step_times == {"t1": 0.002, "t_verify": 0.0025, "t_draft": 0.0005}
    check_lossless(build_document(result, env={}))


def test_mismatch_is_recorded_then_fails_after_the_run(tmp_path: Path) -> None:
    engine = FakeEngine(mismatch={"dflash": 5})
    log_path = tmp_path / "r.jsonl"
    result = run_bench(engine, SAMPLES, SETTINGS, results_log=ResultsLog(log_path))
    assert len(engine.calls) == 3 * len(SAMPLES)  # the bench went on to the end
    assert [(m.sample_id, m.mode, m.position) for m in result.mismatches] == [(s.id, "dflash", 5) for s in SAMPLES]
    with pytest.raises(LosslessError, match=r"sample 's0' at generated token 5") as info:
        check_lossless(build_document(result, env={}))
    assert info.value.exit_code == 3
    assert len(log_path.read_text().splitlines()) == 1 + len(SAMPLES)  # every sample kept


def test_sampling_runs_skip_the_lossless_check() -> None:
    settings = BenchSettings(dataset="fake.jsonl", max_new_tokens=12, temperature=0.7)
    result = run_bench(FakeEngine(mismatch={"dflash": 2}), SAMPLES, settings)
    assert not result.lossless_checked and result.mismatches == []


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_progress_reports_running_tau() -> None:
    events = []
    run_bench(FakeEngine(), SAMPLES[:3], SETTINGS, on_progress=events.append)
    assert [(e.done, e.total) for e in events] == [(1, 3), (2, 3), (3, 3)]
    assert all(e.tau is not None and 1.0 <= e.tau <= 4.0 for e in events)


def test_plain_only_has_no_tau_and_no_step_times() -> None:
    engine = FakeEngine()
    events = []
    result = run_bench(engine, SAMPLES[:1], SETTINGS, modes=("plain",), on_progress=events.append)
    assert events[0].tau is None and result.step_times is None and engine.step_time_calls == 0
    assert not result.lossless_checked


def test_multi_turn_without_chat_template_joins_with_blank_lines() -> None:
    engine = FakeEngine(stop_token=0)
    run_bench(engine, [Sample("m", ["first question", "second question"])], SETTINGS)
    plain_reply = engine.generate(engine.encode_prompt("first question"), mode="plain", max_new_tokens=12).tokens
    assert plain_reply[-1] == 0
    reply_text = engine.decode(plain_reply[:-1])  # the stop token is not part of the history
    assert engine.prompts[:2] == ["first question", f"first question\n\n{reply_text}\n\nsecond question"]
    second_turn_ids = {ids for ids, _ in engine.calls[3:6]}
    assert len(second_turn_ids) == 1  # all modes answer the same second prompt


def test_multi_turn_with_chat_template_passes_messages() -> None:
    engine = FakeEngine(chat_template="{{ messages }}")
    run_bench(engine, [Sample("m", ["a", "b", "c"])], SETTINGS)
    last = engine.prompts[-1]
    assert [m["role"] for m in last] == ["user", "assistant", "user", "assistant", "user"]
    assert [last[0]["content"], last[2]["content"], last[4]["content"]] == ["a", "b", "c"]


def test_generation_errors_name_the_sample() -> None:
    class Failing(FakeEngine):
        def generate(self, prompt_ids, **kw) -> GenerationResult:  # type: ignore[override]
            raise GenerationError("prompt longer than ctx_len", hint="raise export.ctx_len")

    with pytest.raises(GenerationError, match=r"sample 's0' turn 0 \(plain\): prompt longer") as info:
        run_bench(Failing(), SAMPLES, SETTINGS)
    assert info.value.hint == "raise export.ctx_len"


def test_invalid_modes() -> None:
    from dflash_cli.errors import DFlashError

    with pytest.raises(DFlashError, match="invalid modes"):
        run_bench(FakeEngine(), SAMPLES, SETTINGS, modes=("plain", "eagle"))
