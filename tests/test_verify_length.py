"""DFlash verify lengths chosen from the draft's confidence: the choice, its calibration, and losslessness."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dflash_cli.decoding.learnt import Learnt
from dflash_cli.decoding.verify_length import Calibration, VerifyBudget, choose_length, expected_committed

MAX_NEW = 32


def test_expected_committed_counts_the_target_token_and_proposals_accepted_in_a_row():
    assert expected_committed([1.0, 1.0]) == [1.0, 2.0, 3.0]
    assert expected_committed([0.5, 0.5]) == [1.0, 1.5, 1.75]
    assert expected_committed([0.0, 1.0]) == [1.0, 1.0, 1.0]  # nothing past a sure rejection


def test_choice_weighs_expected_tokens_against_the_verify_cost():
    sure, unsure = [0.95] * 15, [0.9, 0.2] + [0.1] * 5
    flat = lambda length: 0.01  # noqa: E731 - a verify costs the same whatever its length
    steep = lambda length: 0.01 * length  # noqa: E731
    assert choose_length(sure, flat, rate=100.0) == 16
    assert choose_length(unsure, flat, rate=100.0) == 8  # free tokens are worth verifying however unlikely
    # 1 token of verify costs rate * 0.01 = 1 token: only proposals more likely than that to land are worth it.
    assert choose_length(unsure, steep, rate=100.0) == 1
    assert choose_length(unsure, steep, rate=50.0) == 2  # half a token per position: the first proposal pays
    assert choose_length(sure, steep, rate=50.0) == 14  # 0.95^k > 0.5 up to k = 13 proposals


def test_nothing_timed_yet_verifies_the_whole_block():
    assert choose_length([0.1] * 7, None, rate=10.0) == 8
    assert choose_length([0.1] * 7, lambda length: 1.0, rate=None) == 8


def test_calibration_learns_acceptance_per_confidence_bin():
    cal = Calibration()
    prior = cal.accept(0.95)
    for _ in range(200):  # a draft that says 0.95 and is right a third of the time
        cal.learn([0.95, 0.95, 0.95], [1, 2, 3], [1, 9])  # first accepted, second rejected, third not reached
    assert prior == pytest.approx(0.95)  # before any verify: the draft's own probability
    assert cal.accept(0.95) == pytest.approx((3.8 + 200) / (4 + 400))
    assert cal.accept(0.05) == pytest.approx(0.05)  # other bins keep their prior


def test_budget_shortens_verifies_once_long_ones_prove_costly():
    budget = VerifyBudget(8)
    conf = [0.9, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1]
    assert budget.length(conf) == 8  # nothing measured yet
    for _ in range(50):  # verifies cost 1 ms per token; the draft's first proposal lands, the second never
        budget.learn(conf, [1, 2, 3, 4, 5, 6, 7], [1, 0], verify_s=0.001 * 8, step_s=0.002 * 8)
        budget.learn(conf, [1, 2], [1, 0], verify_s=0.001 * 3, step_s=0.002 * 3)
    assert budget.length(conf) == 2


def test_budget_asks_the_draft_for_a_few_more_proposals_than_recent_verifies_used():
    from dflash_cli.decoding.verify_length import HEAD_MARGIN, HEAD_WINDOW

    budget = VerifyBudget(16)
    assert budget.proposal_rows(15) == 15  # nothing measured yet: every proposal, as `length` verifies them all
    conf = [0.5] * 15
    for _ in range(HEAD_WINDOW):  # verifies of 3 proposals out of 15 (costs known from here on)
        budget.learn(conf, [1, 2, 3], [1, 2, 3, 4], verify_s=0.004, step_s=0.01, draft_s=0.003)
    assert budget.proposal_rows(15) == 3 + HEAD_MARGIN
    # a step that verified all 5 it was given might have used more: the next draft is asked for twice as many
    budget.learn(conf[:5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6], verify_s=0.006, step_s=0.01, draft_s=0.003)
    assert budget.proposal_rows(15) == min(15, 10 + HEAD_MARGIN)
    for _ in range(HEAD_WINDOW):  # old choices leave the window
        budget.learn(conf, [], [7], verify_s=0.001, step_s=0.01, draft_s=0.003)
    assert budget.proposal_rows(15) == HEAD_MARGIN


def test_under_load_a_draft_that_does_not_pay_is_skipped_but_still_tried():
    """Batched serving: a drafted step that commits ~1.2 tokens for a 30 ms draft is not worth it when 4 sequences
    share the calls at 20 tokens/s each; alone the step always drafts; every EXPLORE-th step drafts anyway."""
    from dflash_cli.decoding.verify_length import EXPLORE

    budget = VerifyBudget(8)
    conf = [0.9, 0.2, 0.1]
    for k in range(40):  # drafted steps commit 1 or 2 tokens; 1 ms per verified token; 0.1 s a step
        committed = [1, 2] if k % 5 == 0 else [9]  # the first proposal rejected: the target's token
        budget.learn(conf, [1, 2, 3], committed, verify_s=0.004, step_s=0.1, draft_s=0.03)
        budget.learn(None, [], [7], verify_s=0.001, step_s=0.05)  # a plain step
    assert budget.draft_pays(sharing=1)
    # ~0.2 extra tokens against 20 tok/s x (4 x 3 ms + 30 ms) = 0.84 tokens: skip, but draft every EXPLORE-th step
    choices = [budget.draft_pays(sharing=4) for _ in range(2 * EXPLORE)]
    assert choices == ([False] * (EXPLORE - 1) + [True]) * 2
    for _ in range(60):  # drafting turns out to pay: 8 tokens a drafted step
        budget.learn(conf, [1] * 7, [1] * 8, verify_s=0.008, step_s=0.1, draft_s=0.03)
    assert budget.draft_pays(sharing=4)


def _with_verify(engine, verify: str):
    old = engine.settings
    engine.settings = dataclasses.replace(old, verify=verify)
    return old


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_any_verify_length_stays_lossless(family, request, monkeypatch):
    """Whatever length the budget picks (here: random ones), greedy DFlash equals greedy plain."""
    engine = request.getfixturevalue(f"{family}_engine")
    assert engine.target.variable_length
    rng = np.random.default_rng(5)
    monkeypatch.setattr(VerifyBudget, "length", lambda self, conf: int(rng.integers(1, len(conf) + 2)))
    seen = set()
    old, engine.learnt = _with_verify(engine, "auto"), Learnt()
    try:
        prompts = rng.integers(2, engine.tokenizer.vocab_size, size=(12, 9))
        for i, prompt in enumerate(prompts.tolist()):
            plain = engine.generate(prompt, mode="plain", max_new_tokens=MAX_NEW)
            dflash = engine.generate(prompt, mode="dflash", max_new_tokens=MAX_NEW)
            assert dflash.tokens == plain.tokens, f"prompt {i}: dflash with truncated verifies differs from plain"
            seen.update(dflash.verify_lengths)
    finally:
        engine.settings, engine.learnt = old, Learnt()
    assert 1 in seen and engine.block_size in seen and len(seen) > 2, seen


def test_block_setting_verifies_the_whole_block(qwen3_engine):
    old = _with_verify(qwen3_engine, "block")
    try:
        res = qwen3_engine.generate([5, 6, 7, 8], mode="dflash", max_new_tokens=MAX_NEW)
    finally:
        qwen3_engine.settings = old
    assert set(res.verify_lengths[:-1]) == {qwen3_engine.block_size}  # the last step may be cut by the length


def test_draft_graph_reports_its_probability_of_each_proposal(qwen3_engine):
    from dflash_cli.decoding.loops import DFlashProposer
    from dflash_cli.decoding.target_calls import TimedSession, prefill

    engine = qwen3_engine
    engine.target.reset()
    engine.draft.reset()
    res = prefill(TimedSession(engine.target), [3, 4, 5, 6, 7], engine.prefill_len)
    proposer = DFlashProposer(TimedSession(engine.draft), engine.block_size, engine.mask_token_id, engine.prefill_len)
    proposer.start(res["context_features"], int(res["tokens"][-1]), 5)
    conf = proposer._confidence
    assert conf is not None and len(conf) == engine.block_size - 1
    assert all(0.0 < p <= 1.0 for p in conf)


def test_confidence_is_checked_to_an_absolute_bound():
    """A probability moves by p(1-p) times its logit's error: its own bound, not the logits' relative one."""
    from dflash_cli.exporting.options import CONFIDENCE_ATOL
    from dflash_cli.exporting.validate import _diff

    ref = np.array([[0.5, 0.9]], np.float32)
    assert _diff("draft_confidence", ref + 0.01, ref) == pytest.approx((0.01, CONFIDENCE_ATOL["fp32"]))
    assert _diff("context_features", ref + 0.01, ref)[1] < 0.01  # features keep the tight relative bound


def test_confidence_matches_the_softmax():
    import torch

    from dflash_cli.modeling.draft import proposal_confidence

    logits = torch.randn(2, 5, 300) * 6
    tokens = torch.randint(0, 300, (2, 5))
    want = torch.softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(proposal_confidence(logits, tokens), want, atol=1e-6)
    big = proposal_confidence(logits * 40, logits.argmax(-1))  # exp of these would overflow even in float32
    assert torch.isfinite(big).all() and (big <= 1).all()


def test_confidence_of_a_real_vocabulary_has_no_constant_beyond_fp16(tmp_path):
    """A card converts the graph to fp16: the vocabulary size (151936 for Qwen3, 201088 for gpt-oss) as a
    constant would become inf there, and `dflash check` fails such a graph."""
    import onnx
    import torch

    from dflash_cli.modeling.draft import proposal_confidence
    from dflash_cli.readiness.fp16_lint import fp16_hazards

    class Confidence(torch.nn.Module):
        def forward(self, logits, tokens):
            return proposal_confidence(logits, tokens)

    vocab = 151936
    args = (torch.randn(1, 3, vocab), torch.zeros(1, 3, dtype=torch.int64))
    torch.onnx.export(Confidence(), args, str(tmp_path / "c.onnx"), dynamo=True, opset_version=18)
    assert fp16_hazards(onnx.load(str(tmp_path / "c.onnx"))) == []
    p = proposal_confidence(args[0] * 8, args[0].argmax(-1))
    assert torch.allclose(p, torch.softmax(args[0] * 8, -1).amax(-1), rtol=1e-5)


def test_draft_prefix_graph_takes_a_block_of_any_length(qwen3_engine):
    """Graph revision 12: the draft's prefix graph names its block axis, and `dflash bench` times shorter drafts
    with it (the break-even tau of drafting and verifying fewer rows, what a smaller dflash.block_size would buy)."""
    import onnx

    from dflash_cli.exporting.names import BLOCK_ROWS, PROPOSAL_ROWS

    model = onnx.load(str(qwen3_engine.compile_dir / "draft_prefix.onnx"), load_external_data=False)
    shape = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.input}
    outs = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.output}
    assert shape["input_ids"][1] == shape["position_ids"][1] == BLOCK_ROWS
    assert shape["context_features"][1] != BLOCK_ROWS
    assert outs["draft_tokens"][1] == shape[PROPOSAL_ROWS][1] == PROPOSAL_ROWS  # revision 15: as many as asked for
    assert qwen3_engine.draft.any_block_rows
    times = qwen3_engine.step_times(repeats=2)
    assert set(times["t_draft_curve"]) == set(times["t_draft_proposals_curve"]) == {2, qwen3_engine.block_size}
