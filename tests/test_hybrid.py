"""Hybrid drafting: per step the suffix lookup or the DFlash draft proposes; output stays the target's own."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from typer.testing import CliRunner

from dflash_cli.cli.app import create_app
from dflash_cli.decoding.prompt_lookup import PromptLookupDrafter

MAX_NEW = 40


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    """Random prompts, and prompts that repeat a phrase (where lookup has long matches to use)."""
    rng = np.random.default_rng(seed)
    out = [list(map(int, rng.integers(2, vocab, size=int(n)))) for n in rng.integers(1, 30, size=10)]
    for n in (3, 5, 7):
        phrase = list(map(int, rng.integers(2, vocab, size=n)))
        out.append(phrase * (24 // n + 1))
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_hybrid_equals_plain_and_uses_both_proposers(family, request):
    engine = request.getfixturevalue(f"{family}_engine")
    sources: dict[str, int] = {}
    engine.hybrid_stats = None  # learn from scratch
    try:
        for i, prompt in enumerate(_prompts(engine.tokenizer.vocab_size, seed=3)):
            plain = engine.generate(prompt, mode="plain", max_new_tokens=MAX_NEW)
            hybrid = engine.generate(prompt, mode="hybrid", max_new_tokens=MAX_NEW)
            assert hybrid.tokens == plain.tokens, f"prompt {i}: hybrid differs from plain"
            assert len(hybrid.step_sources) == len(hybrid.accept_lengths)
            for s in hybrid.step_sources:
                sources[s] = sources.get(s, 0) + 1
            # A lookup step costs one verify and no draft call; the context it skipped reaches the draft
            # on the next DFlash step, in at most this many chunked calls.
            chunks = -(-(MAX_NEW + engine.block_size) // engine.prefill_len)
            assert hybrid.target_calls == len(hybrid.accept_lengths)
            assert hybrid.draft_calls <= hybrid.step_sources.count("dflash") * chunks
    finally:
        engine.hybrid_stats = None
    assert sources.get("lookup", 0) > 0 and sources.get("dflash", 0) > 0, sources


def test_draft_catches_up_after_lookup_steps(qwen3_engine, monkeypatch):
    """Forced to alternate (lookup, lookup, draft, ...), the draft catches up on the skipped context
    in chunked calls and the output is still the target's own."""
    from dflash_cli.decoding.hybrid import HybridProposer

    calls = iter(range(10**6))
    monkeypatch.setattr(HybridProposer, "use_lookup", lambda self, n: next(calls) % 3 != 2)
    prompt = [5, 6, 7, 8] * 6
    hybrid = qwen3_engine.generate(prompt, mode="hybrid", max_new_tokens=MAX_NEW)
    assert hybrid.step_sources[:3] == ["lookup", "lookup", "dflash"]
    assert hybrid.tokens == qwen3_engine.generate(prompt, mode="plain", max_new_tokens=MAX_NEW).tokens
    dflash_only = qwen3_engine.generate(prompt, mode="dflash", max_new_tokens=MAX_NEW)
    assert hybrid.tokens == dflash_only.tokens


def test_decision_weighs_extra_tokens_against_the_draft_cost():
    from dflash_cli.decoding.hybrid import HybridProposer, HybridStats

    stats = HybridStats(block_size=16)
    stats.lookup[0] = [10.0, 10]  # lookup without a match: 1 token a step
    stats.dflash[0] = [30.0, 10]  # the draft there: 3 tokens a step
    stats.lookup[5] = [80.0, 10]  # a long match: 8 tokens a step
    stats.t_draft = [0.5, 10]  # 50 ms a draft
    hybrid = HybridProposer(types.SimpleNamespace(draft=None), 16, stats)
    hybrid.rate = 20.0  # tokens/s lately: 2 extra tokens are worth 100 ms > 50 ms
    assert not hybrid.use_lookup(0) and hybrid.use_lookup(5)
    hybrid.rate = 50.0  # ... now they are worth 40 ms < 50 ms
    assert hybrid.use_lookup(0)


def test_lookup_reports_its_match_length():
    drafter = PromptLookupDrafter(block_size=4, max_ngram=8)
    assert drafter.propose_with_match([1, 2, 3, 9, 1, 2, 3]) == ([9, 1, 2], 3)
    assert drafter.propose_with_match([1, 2, 3]) == ([3, 3, 3], 0)
    assert drafter.propose([1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2]


def test_one_pass_proposal_and_evidence_agree_with_the_scans():
    """The hybrid's single backward pass gives prompt lookup's proposal (latest match of a suffix of at
    most 3 tokens) and the longest earlier match up to 8, as the per-n scans do."""
    rng = np.random.default_rng(0)
    for _ in range(3000):
        committed = [int(t) for t in rng.integers(0, int(rng.choice([2, 3, 5, 20])), size=int(rng.integers(1, 50)))]
        block = int(rng.choice([2, 4, 8, 16]))
        three, eight = PromptLookupDrafter(block, max_ngram=3), PromptLookupDrafter(block, max_ngram=8)
        proposal, evidence = three.propose_and_evidence(committed, 8)
        assert proposal == three.propose(committed)
        assert evidence == eight.propose_with_match(committed)[1]


def _run(engine, *args):
    recipe, cache = str(engine.recipe.source), str(engine.compile_dir.parents[2])
    return CliRunner().invoke(create_app(), ["run", "-r", recipe, "--cache-dir", cache, *args])


def test_run_mode_option(qwen3_engine):
    res = _run(qwen3_engine, "-p", "a b a b a b", "--max-new-tokens", "8", "--mode", "hybrid", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["mode"] == "hybrid"
    res = _run(qwen3_engine, "-p", "x", "--max-new-tokens", "4", "--mode", "lookup", "--json")
    assert json.loads(res.stdout)["mode"] == "pld"
    res = _run(qwen3_engine, "-p", "x", "--mode", "hybird")
    assert res.exit_code == 2 and "hybrid" in res.stderr


def test_recipe_drafter_sets_the_default_mode(qwen3_engine):
    res = _run(qwen3_engine, "-p", "x", "--max-new-tokens", "4", "--set", "run.drafter=hybrid", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["mode"] == "hybrid"


def test_bench_reports_hybrid_with_its_source_split(qwen3_engine, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a b a b a b", "def f(x):", "1 2 3 1 2 3"]))
    recipe, cache = str(qwen3_engine.recipe.source), str(qwen3_engine.compile_dir.parents[2])
    args = ["bench", "-r", recipe, "--cache-dir", cache, "--dataset", str(data), "--max-new-tokens", "16"]
    res = CliRunner().invoke(create_app(), [*args, "--modes", "plain,dflash,pld,hybrid", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    hybrid = doc["hybrid"]
    assert hybrid["decode_speedup"] is not None and hybrid["mean_acceptance_length"] >= 1
    sources = hybrid["sources"]
    assert sum(s["steps"] for s in sources.values()) == hybrid["steps"]
    assert abs(sum(s["share"] for s in sources.values()) - 1) < 1e-9
    assert doc["lossless"]["mismatches"] == []
