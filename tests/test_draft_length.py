"""How many rows a DFlash step drafts (decoding/draft_length.py): the choice, and that any choice stays lossless."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_cli.decoding.draft_length import EXPLORE, DraftLength
from dflash_cli.decoding.verify_length import VerifyBudget

MAX_NEW = 32


def _taught(block: int, confidence: list[float], draft_ms_per_row: float) -> DraftLength:
    """Whole-block drafts of `confidence`, each timed at 1 ms plus `draft_ms_per_row` per row (two lengths)."""
    choice = DraftLength(block)
    for _ in range(10):
        choice.learn(confidence, 0.001 + draft_ms_per_row / 1000 * block)
        choice.cost.add(2, 0.001 + draft_ms_per_row / 1000 * 2)
    return choice


def _rows(choice: DraftLength, rate: float, verify_line) -> int:
    choice.steps = 0  # away from an exploring step
    return choice.rows(rate, verify_line, accept=lambda p: p)


def test_the_whole_block_until_costs_are_known():
    choice = DraftLength(8)
    assert choice.rows(None, None, accept=lambda p: p) == 8
    assert choice.rows(100.0, lambda n: 0.001, accept=lambda p: p) == 8  # no draft timed yet


def test_costly_rows_are_not_drafted_past_what_is_likely_accepted():
    unsure = [0.9, 0.2, 0.05, 0.05, 0.05, 0.05, 0.05]
    flat = lambda n: 0.002  # noqa: E731 - a verify costs the same whatever its length
    # 1 ms a row at 100 tokens/s: a row is worth drafting only if it adds 0.1 token
    assert _rows(_taught(8, unsure, draft_ms_per_row=1.0), 100.0, flat) == 3
    # rows that cost nothing: the whole block (the verify length is chosen afterwards)
    assert _rows(_taught(8, unsure, draft_ms_per_row=0.0), 100.0, flat) == 8
    sure = [0.95] * 7
    assert _rows(_taught(8, sure, draft_ms_per_row=1.0), 100.0, flat) == 8


def test_verify_cost_counts_only_where_the_verify_would_take_the_rows():
    """A steep verify cost stops the verify early whatever was drafted: rows past it are not worth drafting."""
    sure = [0.95] * 7
    steep = lambda n: 0.01 * n  # noqa: E731 - 1 token of cost per verified row at 100 tokens/s
    assert _rows(_taught(8, sure, draft_ms_per_row=0.5), 100.0, steep) == 2


def test_every_few_steps_the_whole_block_is_drafted():
    choice = _taught(8, [0.9, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05], draft_ms_per_row=1.0)
    flat = lambda n: 0.002  # noqa: E731
    picks = [choice.rows(100.0, flat, accept=lambda p: p) for _ in range(2 * EXPLORE)]
    assert picks.count(8) == 2 and set(picks) == {2, 8}, picks


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_any_draft_length_stays_lossless(family, request, monkeypatch):
    """Whatever number of rows is drafted (here: random ones), greedy DFlash equals greedy plain."""
    engine = request.getfixturevalue(f"{family}_engine")
    assert getattr(engine.draft, "any_block_rows", False), "the draft's prefix graph should take any block"
    rng = np.random.default_rng(7)
    monkeypatch.setattr(VerifyBudget, "draft_rows", lambda self: int(rng.integers(2, self.block + 1)))
    drafted = []
    run = type(engine.draft).run

    def counting(self, feeds):
        drafted.append(feeds["input_ids"].shape[1])
        return run(self, feeds)

    monkeypatch.setattr(type(engine.draft), "run", counting)
    old = engine.recipe
    engine.recipe = old.model_copy(update={"run": old.run.model_copy(update={"verify": "auto"})})
    engine.verify_budget = None
    try:
        for i, prompt in enumerate(rng.integers(2, engine.tokenizer.vocab_size, size=(12, 9)).tolist()):
            plain = engine.generate(prompt, mode="plain", max_new_tokens=MAX_NEW)
            dflash = engine.generate(prompt, mode="dflash", max_new_tokens=MAX_NEW)
            assert dflash.tokens == plain.tokens, f"prompt {i}: dflash with short drafts differs from plain"
    finally:
        engine.recipe, engine.verify_budget = old, None
    assert set(drafted) == set(range(2, engine.block_size + 1)), sorted(set(drafted))  # every length was drafted


def test_draft_prefix_graph_names_its_block_axis(qwen3_engine):
    import onnx

    from dflash_cli.exporting.names import BLOCK_ROWS

    model = onnx.load(str(qwen3_engine.compile_dir / "draft_prefix.onnx"), load_external_data=False)
    dims = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.input}
    outs = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.output}
    assert dims["input_ids"][1] == dims["position_ids"][1] == BLOCK_ROWS
    assert dims["context_features"][1] != BLOCK_ROWS
    assert outs["draft_tokens"][1] == BLOCK_ROWS + "-1"
