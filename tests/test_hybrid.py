"""Hybrid drafting: per step the suffix lookup or the DFlash draft proposes; output stays the target's own."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from typer.testing import CliRunner

from dflash_cli.cli.app import create_app
from dflash_cli.decoding.learnt import Learnt
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
    engine.learnt = Learnt()  # learn from scratch
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
        engine.learnt = Learnt()
    assert sources.get("lookup", 0) > 0 and sources.get("dflash", 0) > 0, sources


def test_draft_catches_up_after_lookup_steps(qwen3_engine, monkeypatch):
    """Forced to alternate (lookup, lookup, draft, ...), the draft catches up on the skipped context
    in chunked calls and the output is still the target's own."""
    from dflash_cli.decoding.hybrid import HybridProposer

    calls = iter(range(10**6))

    def alternate(self, n, limit=None):
        return ("lookup" if next(calls) % 3 != 2 else "dflash"), self.block

    monkeypatch.setattr(HybridProposer, "choose", alternate)
    prompt = [5, 6, 7, 8] * 6
    hybrid = qwen3_engine.generate(prompt, mode="hybrid", max_new_tokens=MAX_NEW)
    assert hybrid.step_sources[:3] == ["lookup", "lookup", "dflash"]
    assert hybrid.tokens == qwen3_engine.generate(prompt, mode="plain", max_new_tokens=MAX_NEW).tokens
    dflash_only = qwen3_engine.generate(prompt, mode="dflash", max_new_tokens=MAX_NEW)
    assert hybrid.tokens == dflash_only.tokens


def _stats_with(block: int, lookup: dict[int, int], dflash: dict[int, int], steps: int = 20):
    """HybridStats whose sources commit exactly the given tokens per step, for match lengths n."""
    from dflash_cli.decoding.hybrid import HybridStats

    stats = HybridStats(block_size=block)
    for table, counts in ((stats.lookup, lookup), (stats.dflash, dflash)):
        for n, count in counts.items():
            for _ in range(steps):
                table[n].add(count, exact=True)
    return stats


def test_decision_weighs_extra_tokens_against_the_draft_cost():
    from dflash_cli.decoding.hybrid import HybridProposer

    stats = _stats_with(16, lookup={0: 1, 5: 8}, dflash={0: 3, 5: 3})
    stats.t_draft = [0.05, 10]  # 5 ms a draft
    stats.add_verify(16, 0.01)
    hybrid = HybridProposer(types.SimpleNamespace(draft=None), 16, stats)
    stats.recent = [200.0, 1.0]  # tokens/s lately: ~2 extra tokens are worth ~10 ms > 5 ms
    assert hybrid.choose(0) == ("dflash", 16) and hybrid.choose(5) == ("lookup", 16)
    stats.recent = [500.0, 1.0]  # ... now they are worth ~4 ms < 5 ms
    assert hybrid.choose(0) == ("lookup", 16)


def test_short_verify_where_the_session_takes_any_length():
    """With calls of any length, a step that will commit ~1 token verifies 2, not the whole block;
    a long match still verifies the whole block. A static session always verifies the block."""
    from dflash_cli.decoding.hybrid import HybridProposer

    stats = _stats_with(8, lookup={0: 1, 5: 8}, dflash={0: 1, 5: 1})
    stats.t_draft = [0.5, 10]
    for length, ms in ((2, 2.9), (8, 4.0)):
        stats.add_verify(length, ms / 1000)
    stats.recent = [300.0, 1.0]
    variable = HybridProposer(types.SimpleNamespace(draft=None), 8, stats, variable_length=True)
    assert variable.choose(0) == ("lookup", 2) and variable.choose(5) == ("lookup", 8)
    fixed = HybridProposer(types.SimpleNamespace(draft=None), 8, stats, variable_length=False)
    assert fixed.choose(0) == ("lookup", 8)


def test_sequences_sharing_the_call_make_its_rows_dearer():
    """Batched serving: a verify's rows delay every sequence in the call, so they are charged at the total rate
    of the sequences sharing it (the draft's time, already the whole batched call's, at the request's own)."""
    from dflash_cli.decoding.hybrid import HybridProposer

    stats = _stats_with(8, lookup={0: 1, 5: 8}, dflash={0: 1, 5: 1})
    stats.t_draft = [0.5, 10]
    for length, ms in ((2, 2.9), (8, 4.0)):
        stats.add_verify(length, ms / 1000)
    stats.recent = [300.0, 1.0]

    def hybrid(sharing: int) -> HybridProposer:
        draft = types.SimpleNamespace(session=types.SimpleNamespace(sharing=sharing))
        return HybridProposer(types.SimpleNamespace(draft=draft), 8, stats, variable_length=True)

    # 6 more tokens for 1.1 ms more verify: worth it at 300 tok/s (0.33 tokens), not at 40 x 300 (13 tokens)
    assert hybrid(1).choose(5) == ("lookup", 8) and hybrid(40).choose(5) == ("lookup", 2)


def test_dear_steps_do_not_make_time_look_cheap():
    """The rate time is charged at is at least the cheapest step's (lookup, 2 tokens, no draft). Here the loop's
    own rate is low because its steps were dear (an MoE target's 16-token verify costs ~8x a short one): charged at
    that rate the unsure draft's whole block would look worth it again and again."""
    from dflash_cli.decoding.hybrid import HybridProposer

    stats = _stats_with(16, lookup={0: 1}, dflash={0: 1}, steps=3)  # a cold start: the draft's prior still counts
    stats.t_draft = [0.4, 1]
    for length, seconds in ((2, 0.5), (16, 3.9)):
        stats.add_verify(length, seconds)
    stats.recent = [1.0, 4.5]  # one token in 4.5 s: the loop's own rate, 0.22 tok/s
    hybrid = HybridProposer(types.SimpleNamespace(draft=None), 16, stats, variable_length=True)
    assert hybrid.choose(0) == ("lookup", 2)
    hybrid._rate_floor = lambda line: 0.0
    source, length = hybrid.choose(0)  # charged at 0.22 tok/s, most of the block looked worth its ~4 s
    assert source == "dflash" and length >= 12
    del hybrid._rate_floor
    assert hybrid._rate_floor(stats.verify_line()) == pytest.approx(2.0)  # 1 / 0.5 s; a faster loop keeps its own
    stats.add_step(1, 0.75, overhead=0.5)  # the loop's own time counts too: the cheapest step takes 1 s
    assert hybrid._rate_floor(stats.verify_line()) == pytest.approx(1.0)


def test_untried_verify_lengths_are_guessed_optimistically():
    from dflash_cli.decoding.hybrid import HybridStats

    stats = HybridStats(block_size=8)
    assert stats.verify_seconds(4) is None
    stats.add_verify(8, 0.004)
    assert stats.verify_seconds(2) == 0.001  # below the shortest tried: proportional, so it gets tried
    stats.add_verify(2, 0.003)
    assert abs(stats.verify_seconds(5) - 0.0035) < 1e-12  # between: on the fitted line
    assert abs(stats.verify_seconds(2) - 0.003) < 1e-12


def test_verify_cost_is_one_line_fitted_to_every_verify():
    """A length timed a few times in a slow moment does not keep a bad mean: all lengths share one fit."""
    from dflash_cli.decoding.hybrid import HybridStats

    stats = HybridStats(block_size=8)
    for _ in range(200):
        for length in (2, 8):
            stats.add_verify(length, 0.001 + 0.0001 * length)
    for _ in range(3):
        stats.add_verify(7, 0.005)  # three slow calls at 7
    assert stats.verify_seconds(7) < 0.002 < 0.005
    assert abs(stats.verify_seconds(4) - 0.0014) < 2e-4


def test_survival_counts_short_verifies_as_at_least():
    """A fully accepted short verify says "at least L", so it does not drag the estimate down to L."""
    from dflash_cli.decoding.hybrid import Survival

    exact, censored = Survival(8, prior=6), Survival(8, prior=6)
    for _ in range(50):
        exact.add(2, exact=True)
        censored.add(2, exact=False)
    assert exact.expected(8) < 2.2
    assert censored.expected(8) > 5.0
    stops_at_3 = Survival(8, prior=3)
    for _ in range(50):
        stops_at_3.add(3, exact=True)
    assert stops_at_3.expected(2) == 2.0 and abs(stops_at_3.expected(8) - 3.0) < 0.1


def test_a_few_stops_past_the_tried_lengths_do_not_shut_out_longer_verifies():
    """200 verifies of 8 all accepted ("at least 8") and 3 that ran on and stopped at 9: a hazard of 1
    at 9 from those 3 would make every longer verify look worthless, so none would ever be tried again.
    Shrunk towards the pooled hazard, longer verifies keep their worth."""
    from dflash_cli.decoding.hybrid import Survival

    s = Survival(32, prior=8, prior_exact=False)
    for _ in range(200):
        s.add(8, exact=False)
    for _ in range(3):
        s.add(9, exact=True)
    assert s.expected(32) > s.expected(9) + 10


def test_a_long_copy_verifies_past_the_block_where_the_session_takes_any_length():
    from dflash_cli.decoding.hybrid import HybridProposer, HybridStats

    stats = HybridStats(block_size=8, longest=32)
    for _ in range(50):
        stats.lookup[8].add(32, exact=True)  # long matches: copies that run on
        stats.lookup[1].add(1, exact=True)  # a 1-token match: rejected at once
    stats.t_draft = [0.5, 10]
    for length, ms in ((2, 1.0), (8, 1.6), (32, 2.75)):  # the demo pair's measured curve
        stats.add_verify(length, ms / 1000)
    stats.recent = [3000.0, 1.0]
    variable = HybridProposer(types.SimpleNamespace(draft=None), 8, stats, variable_length=True)
    assert variable.longest == 32
    assert variable.choose(8) == ("lookup", 32)
    assert variable.choose(8, limit=12) == ("lookup", 12)  # the generation needs only 12 more tokens
    assert variable.choose(8, limit=3) == ("lookup", 8)  # ... a block is always allowed
    assert variable.choose(1) == ("lookup", 2)
    fixed = HybridProposer(types.SimpleNamespace(draft=None), 8, stats, variable_length=False)
    assert fixed.longest == 8 and fixed.choose(8) == ("lookup", 8)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_hybrid_verifies_past_the_block_in_a_copy_and_stays_lossless(family, request, monkeypatch):
    """Where the output loops, lookup steps verify up to LOOKUP_BLOCKS blocks at once, never more than the
    generation still needs; the output is still plain greedy decoding's."""
    from dflash_cli.decoding.hybrid import LOOKUP_BLOCKS, HybridStats

    # Verify times as a quiet machine gives this tiny pair's (a row costs ~1% of a call), not as a loaded one
    # does: one slow long verify under load steepens the fitted line and the choice, not the mechanism, changes.
    add_verify = HybridStats.add_verify
    monkeypatch.setattr(HybridStats, "add_verify", lambda self, n, s: add_verify(self, n, 1e-3 * (1 + 0.01 * n)))
    engine = request.getfixturevalue(f"{family}_engine")
    engine.learnt = Learnt()
    longest, block, new = 0, engine.block_size, 60
    try:
        for prompt in ([5, 6, 7, 8, 9] * 12, [3, 4] * 10, [11, 12, 13] * 9) * 2:
            plain = engine.generate(prompt, mode="plain", max_new_tokens=new)
            hybrid = engine.generate(prompt, mode="hybrid", max_new_tokens=new)
            assert hybrid.tokens == plain.tokens
            have = 1  # the first token comes with the prompt
            for length, accepted in zip(hybrid.verify_lengths, hybrid.accept_lengths):
                assert accepted <= length <= min(LOOKUP_BLOCKS * block, max(block, new - have))
                have += accepted
            longest = max(longest, *hybrid.verify_lengths)
    finally:
        engine.learnt = Learnt()
    assert longest > block


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
    assert json.loads(res.stdout)["mode"] == "lookup"
    res = _run(qwen3_engine, "-p", "x", "--max-new-tokens", "4", "--mode", "pld", "--json")  # lookup's old name
    assert json.loads(res.stdout)["mode"] == "lookup"
    res = _run(qwen3_engine, "-p", "x", "--mode", "hybird")
    assert res.exit_code == 2 and "hybrid" in res.stderr


def test_recipe_drafter_sets_the_default_mode(qwen3_engine):
    res = _run(qwen3_engine, "-p", "x", "--max-new-tokens", "4", "--set", "run.drafter=hybrid", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["mode"] == "hybrid"


def test_bench_reports_hybrid_with_its_source_split(qwen3_engine, tmp_path):
    from dflash_cli.decoding.hybrid import LOOKUP_BLOCKS

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a b a b a b", "def f(x):", "1 2 3 1 2 3"]))
    recipe, cache = str(qwen3_engine.recipe.source), str(qwen3_engine.compile_dir.parents[2])
    args = ["bench", "-r", recipe, "--cache-dir", cache, "--dataset", str(data), "--max-new-tokens", "16"]
    res = CliRunner().invoke(create_app(), [*args, "--modes", "plain,dflash,lookup,hybrid", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    hybrid = doc["hybrid"]
    assert hybrid["decode_speedup"] is not None and hybrid["mean_acceptance_length"] >= 1
    sources = hybrid["sources"]
    assert sum(s["steps"] for s in sources.values()) == hybrid["steps"]
    assert abs(sum(s["share"] for s in sources.values()) - 1) < 1e-9
    block = qwen3_engine.block_size
    assert 2 <= sources.get("dflash", {"mean_verify_tokens": 2})["mean_verify_tokens"] <= block
    assert 2 <= sources["lookup"]["mean_verify_tokens"] <= LOOKUP_BLOCKS * block  # lookup may verify past the block
    histogram = hybrid["acceptance_histogram"]  # runs to the longest verify
    assert len(histogram["lengths"]) >= block and sum(histogram["counts"]) == hybrid["steps"]
    assert len(hybrid["per_position_acceptance"]) == len(histogram["lengths"]) - 1
    assert doc["lossless"]["mismatches"] == []


def test_every_proposer_implements_the_one_protocol():
    """DFlash draft, prompt lookup and hybrid are Proposers with one `propose` signature; the optional members
    have the protocol's defaults where a proposer has nothing to say."""
    import inspect

    from dflash_cli.decoding.hybrid import HybridProposer
    from dflash_cli.decoding.loops import DFlashProposer, LookupProposer
    from dflash_cli.decoding.proposer import Proposer

    dflash = DFlashProposer(types.SimpleNamespace(calls=0, seconds=0.0), 4, 0, 8)
    lookup = LookupProposer(PromptLookupDrafter(4))
    hybrid = HybridProposer(dflash, 4)
    signature = inspect.signature(Proposer.propose)
    for proposer in (dflash, lookup, hybrid):
        assert isinstance(proposer, Proposer) and proposer.longest == 4
        assert inspect.signature(type(proposer).propose) == signature, type(proposer)
    assert lookup.draft is None and list(lookup.sources) == [] and list(dflash.sources) == []
    assert hybrid.draft is dflash.draft and hybrid.sources == []
    assert (dflash.mode, lookup.mode, hybrid.mode) == ("dflash", "lookup", "hybrid")
    assert lookup.propose([1, 2, 3, 1, 2], 2, 4, 4) == [3, 1, 2]
    assert not isinstance(object(), Proposer)


def test_engine_generates_every_mode_and_the_old_name(qwen3_engine):
    from dflash_cli.decoding.modes import ALIASES, MODES
    from dflash_cli.errors import GenerationError

    prompt = [5, 6, 7, 5, 6, 7, 5]
    plain = qwen3_engine.generate(prompt, mode="plain", max_new_tokens=6)
    for mode in (*MODES, *ALIASES):
        res = qwen3_engine.generate(prompt, mode=mode, max_new_tokens=6)
        assert res.mode == ALIASES.get(mode, mode) and res.tokens == plain.tokens, mode
    with pytest.raises(GenerationError, match="unknown mode"):
        qwen3_engine.generate(prompt, mode="pldx", max_new_tokens=6)
