"""Continuous batching: requests decoded together give exactly what each gives alone (decoding/batching.py)."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from dflash_cli.decoding.batched_engine import batched_views, batching_refusal
from dflash_cli.decoding.batching import CallBatcher, SlotSession, _Call, groups
from tests.engines import mixed_prompts


def run_together(engine, prompts, slots: int = 4, arrivals: int = 0, **kwargs) -> tuple[list, object]:
    """Every prompt on a thread of its own, at most `slots` at once, each starting after a random pause
    (requests arriving at random times); returns the results in prompt order and the batcher."""
    views, batcher = batched_views(engine, slots)
    free, lock, gate = list(range(slots)), threading.Lock(), threading.Semaphore(slots)
    results: list = [None] * len(prompts)
    errors: list = []
    pauses = random.Random(arrivals).choices([0.0, 0.001, 0.005, 0.02], k=len(prompts))

    def work(k: int) -> None:
        time.sleep(pauses[k])
        with gate:
            with lock:
                slot = free.pop()
            batcher.enter(slot)
            try:
                results[k] = views[slot].generate(prompts[k], **kwargs)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
            finally:
                batcher.leave(slot)
                with lock:
                    free.append(slot)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    batcher.close()
    assert not errors, errors[0]
    return results, batcher


@pytest.mark.parametrize("which", ["qwen3_engine", "llama_engine"])
def test_build_checks_batch_invariance(which, request):
    engine = request.getfixturevalue(which)
    facts = engine.compile_facts["batch_invariance"]
    assert facts["equal"] and facts["sequences"] == 3
    assert set(facts["max_diff"]) == {"tokens", "context_features"}
    assert batching_refusal(engine) is None


@pytest.mark.parametrize("mode", ["dflash", "plain", "lookup", "hybrid"])
@pytest.mark.parametrize("which", ["qwen3_engine", "llama_engine"])
def test_batched_greedy_equals_each_request_alone(which, mode, request):
    engine = request.getfixturevalue(which)
    prompts = mixed_prompts(engine.tokenizer.vocab_size, n=32)
    alone = [engine.generate(p, mode=mode, max_new_tokens=24).tokens for p in prompts]
    together, batcher = run_together(engine, prompts, mode=mode, max_new_tokens=24)
    assert [r.tokens for r in together] == alone
    assert batcher.stats.largest >= 2  # calls really carried several sequences
    assert batcher.stats.mean("target") > 1.0


@pytest.fixture(scope="module")
def logits_engine(qwen3_logits_engine):
    return qwen3_logits_engine


@pytest.mark.parametrize("mode", ["dflash", "plain"])
def test_batched_sampling_equals_each_request_alone(logits_engine, mode):
    prompts = mixed_prompts(logits_engine.tokenizer.vocab_size, n=12, seed=3)
    kw = {"mode": mode, "max_new_tokens": 16, "temperature": 0.8, "seed": 11}
    alone = [logits_engine.generate(p, **kw).tokens for p in prompts]
    together, _ = run_together(logits_engine, prompts, **kw)
    assert [r.tokens for r in together] == alone


@pytest.mark.parametrize("mode", ["dflash", "hybrid"])
def test_batched_constrained_answers_and_logprobs_equal_each_request_alone(logits_engine, mode):
    """A grammar and logprobs ride along in a shared call: each request's rows are its own."""
    from dflash_cli.decoding.constraint import ConstraintSpec

    prompts = mixed_prompts(logits_engine.tokenizer.vocab_size, n=8, seed=4)
    kw = {"mode": mode, "max_new_tokens": 16, "logprobs": 2, "constraint": ConstraintSpec("regex", "[a-f0-9 ]{4,40}")}
    alone = [logits_engine.generate(p, **kw) for p in prompts]
    together, _ = run_together(logits_engine, prompts, **kw)
    assert [(r.tokens, r.logprobs) for r in together] == [(r.tokens, r.logprobs) for r in alone]


def test_greedy_and_sampled_requests_share_calls(logits_engine):
    prompts = mixed_prompts(logits_engine.tokenizer.vocab_size, n=8, seed=5)
    settings = [{"temperature": 0.0}, {"temperature": 0.9, "seed": 3}] * 4
    alone = [logits_engine.generate(p, max_new_tokens=12, **s).tokens for p, s in zip(prompts, settings)]
    views, batcher = batched_views(logits_engine, 2)
    out: list = [None] * len(prompts)

    def work(slot: int) -> None:
        batcher.enter(slot)
        try:
            for k in range(slot, len(prompts), 2):  # slot 0 greedy, slot 1 sampled
                out[k] = views[slot].generate(prompts[k], max_new_tokens=12, **settings[k]).tokens
        finally:
            batcher.leave(slot)

    threads = [threading.Thread(target=work, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    batcher.close()
    assert out == alone


def _call(graph: str, width: int, slot: int = 0) -> _Call:
    key = "context_position_ids" if graph == "draft" else "input_ids"
    return _Call(slot, graph, {key: np.zeros((1, width), np.int64)})


def test_groups_keep_call_lengths_close():
    calls = [_call("target", w, k) for k, w in enumerate([16, 1, 2, 128, 16, 9])] + [_call("draft", 3, 9)]
    got = [[c.slot for c in g] for g in groups(calls)]
    # draft apart; short calls together (<= 4); 9 and 16 together (within 2x); the long prefill chunk alone
    assert got == [[9], [1, 2], [5, 0, 4], [3]]


class _Recorder:
    ctx_len = 64
    variable_length = True  # a batched graph's trait (SlotSession copies it)

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def run(self, slots, feeds):
        self.calls.append(list(slots))
        return [{"slot": s} for s in slots]


def test_batcher_waits_for_every_live_request_then_not_longer_than_its_grace():
    graph = _Recorder()
    batcher = CallBatcher({"target": graph}, grace_s=0.2)
    for slot in (0, 1):
        batcher.enter(slot)
    feeds = {"input_ids": np.zeros((1, 1), np.int64)}
    got = {}
    t = threading.Thread(target=lambda: got.setdefault(0, batcher.call(0, "target", feeds)))
    t.start()
    time.sleep(0.05)
    assert graph.calls == []  # slot 1 is live and has not called yet
    assert batcher.call(1, "target", feeds) == {"slot": 1}
    t.join(5)
    assert graph.calls == [[0, 1]] and got[0] == {"slot": 0}
    started = time.monotonic()
    assert batcher.call(0, "target", feeds) == {"slot": 0}  # slot 1 stays silent: the grace runs out
    assert 0.15 <= time.monotonic() - started < 5
    batcher.leave(1)
    batcher.close()


def test_a_slot_shares_its_calls_with_every_live_request():
    batcher = CallBatcher({"target": _Recorder()}, grace_s=0.01)
    view = SlotSession(batcher, "target", 0)
    assert view.sharing == 1  # none live yet: it counts as one
    for slot in (0, 1, 2):
        batcher.enter(slot)
    assert view.sharing == 3
    batcher.leave(2)
    assert view.sharing == 2
    batcher.close()


def test_a_failing_call_reaches_every_request_of_its_group():
    class Broken(_Recorder):
        def run(self, slots, feeds):
            raise RuntimeError("kernel refused")

    batcher = CallBatcher({"target": Broken()}, grace_s=0.01)
    batcher.enter(0)
    with pytest.raises(RuntimeError, match="kernel refused"):
        batcher.call(0, "target", {"input_ids": np.zeros((1, 1), np.int64)})
    batcher.close()


def test_builds_that_cannot_batch_say_why(tiny_qwen3_pair, tmp_path):
    from tests.engines import open_engine

    engine = open_engine(tiny_qwen3_pair, tmp_path, compile={"ort": {"fuse": False}})
    assert "in-place" in batching_refusal(engine)


def test_closing_the_batcher_releases_requests_still_waiting():
    batcher = CallBatcher({"target": _Recorder()}, grace_s=60)
    for slot in (0, 1):
        batcher.enter(slot)  # slot 1 never calls: slot 0 would wait out the grace
    errors = []
    t = threading.Thread(target=lambda: _call_or_note(batcher, errors))
    t.start()
    time.sleep(0.05)
    batcher.close()
    t.join(5)
    assert not t.is_alive() and "closed" in str(errors[0])


def _call_or_note(batcher, errors) -> None:
    try:
        batcher.call(0, "target", {"input_ids": np.zeros((1, 1), np.int64)})
    except RuntimeError as exc:
        errors.append(exc)


def test_batch_invariance_is_checked_where_the_other_checks_are_too_big(tiny_qwen3_pair, tmp_path, monkeypatch):
    """A build whose graphs exceed the check budget (an fp32 build of a real pair) still checks what serving
    several requests at once needs, so serve can batch it."""
    import json
    from pathlib import Path

    import dflash_cli.ortcompile.checks as checks
    from tests.engines import build_recipe

    real = checks.graph_weight_bytes
    big = lambda path: 10 << 30 if Path(path).stem in ("target", "draft") else real(path)  # noqa: E731
    monkeypatch.setattr(checks, "graph_weight_bytes", big)  # the static graphs as an fp32 8B pair's
    _, cache = build_recipe(tiny_qwen3_pair, tmp_path)
    facts = json.loads(next((tmp_path / "cache").glob("artifacts/compile/*/compile.json")).read_text())
    assert facts["checks"].startswith("skipped") and "batch invariance checked" in facts["checks"]
    assert facts["batch_invariance"]["equal"] and facts["batch_invariance"]["sequences"] == 3


def test_batch_check_opens_one_more_target_session(tiny_qwen3_pair, tmp_path, monkeypatch):
    """The build's batch check serves its one-sequence calls with the prefix session already open: one more
    copy of the target's weights in memory (for the 3-sequence calls), not two (the 4B int4 build passed its
    memory bound when it opened both)."""
    import dflash_cli.backends.ort_batched as batched
    from tests.engines import build_recipe

    opened, real = [], batched._open
    monkeypatch.setattr(batched, "_open", lambda path, *a, **k: opened.append(path.name) or real(path, *a, **k))
    build_recipe(tiny_qwen3_pair, tmp_path)
    assert opened == ["target_prefix.onnx"]


@pytest.mark.parametrize("equal", [True, False])
def test_serve_checks_batch_invariance_where_the_build_could_not(qwen3_engine, monkeypatch, equal):
    """A build too big for its own batch check (an fp32 build of a real pair) is checked by `serve` on the
    sessions it opens to batch: it batches where the check passes and serves one at a time where it fails."""
    import dflash_cli.backends.batch_invariance as bi
    from dflash_cli.serve.metrics import ServerMetrics
    from dflash_cli.serve.scheduler import Scheduler

    real, seen = bi.check_target, []

    def check(target, B, vocab):
        seen.append(target.slots)
        return real(target, B, vocab) if equal else {"sequences": 3, "max_diff": {"tokens": 0.5}, "equal": False}

    monkeypatch.setattr(bi, "check_target", check)
    facts = dict(qwen3_engine.compile_facts)
    monkeypatch.setattr(qwen3_engine, "compile_facts", {k: v for k, v in facts.items() if k != "batch_invariance"})
    assert batching_refusal(qwen3_engine) is None  # not refused: checked at start instead
    scheduler = Scheduler(qwen3_engine, 2, ServerMetrics("m", qwen3_engine.block_size), "dflash", max_batch=3)
    try:
        assert seen == [3]
        if equal:
            assert scheduler.slots == 3 and scheduler.batch_refusal is None
            assert scheduler.batch_check["equal"] and scheduler.batch_check["sequences"] == 3
        else:
            assert scheduler.slots == 1 and "checked at start" in scheduler.batch_refusal
    finally:
        scheduler.close()


def test_slots_are_sized_by_a_session_and_a_cache_each(monkeypatch):
    """Each slot past the first costs a packed copy of the target's weights and its sequence's K/V buffers:
    with 20 GB available at the 4B int4 shape (2.8 GB of weights, 1.2 GB of K/V per sequence), 3 slots fit
    in half of it, not the 4 that counting weights alone allowed."""
    import types

    import dflash_cli.host.memory as pm
    from dflash_cli.decoding.batched_engine import affordable_slots

    kv = types.SimpleNamespace(nbytes=1_200_000_000)
    engine = types.SimpleNamespace(
        weight_bytes={"target": 2_800_000_000},
        target=types.SimpleNamespace(_arrays={"past_key_0": kv}, compiled_slots=False),
    )
    monkeypatch.setattr(pm, "available_bytes", lambda: 20_000_000_000)
    assert affordable_slots(engine, 8) == 3
    assert affordable_slots(engine, 2) == 2
    monkeypatch.setattr(pm, "available_bytes", lambda: 4_000_000_000)
    assert affordable_slots(engine, 8) == 1
