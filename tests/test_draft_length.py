"""How many rows a DFlash step drafts (decoding/draft_length.py): the choice, and that any choice stays lossless."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_cli.decoding.draft_length import EXPLORE, DraftLength
from dflash_cli.decoding.verify_length import VerifyBudget

MAX_NEW = 32


def _taught(block: int, committed: list[int], draft_ms_per_row: float) -> DraftLength:
    """Whole-block steps committing each of `committed` (exact), drafts timed at 1 ms plus `draft_ms_per_row` a row."""
    choice = DraftLength(block)
    for _ in range(20):
        for c in committed:
            choice.verified(c, block)
        choice.drafted_block(block, 0.001 + draft_ms_per_row / 1000 * block, context=2)
        choice.drafted_block(2, 0.001 + draft_ms_per_row / 1000 * 2, context=2)
    return choice


def _rows(choice: DraftLength, rate: float, verify_line) -> int:
    choice.steps = 0  # away from an exploring step
    return choice.rows(rate, verify_line)


def test_the_whole_block_until_costs_are_known():
    choice = DraftLength(8)
    assert choice.rows(None, None) == 8
    assert choice.rows(100.0, lambda n: 0.001) == 8  # no draft timed yet


def test_costly_rows_are_not_drafted_past_what_steps_commit():
    short = [1, 2, 2, 3, 3, 3, 2, 1]  # steps that rarely commit more than 3
    flat = lambda n: 0.002  # noqa: E731 - a verify costs the same whatever its length
    # 1 ms a row at 100 tokens/s: a row is worth drafting only if it adds 0.1 token
    assert _rows(_taught(8, short, draft_ms_per_row=1.0), 100.0, flat) == 3
    # rows that cost nothing: the whole block (the verify length is chosen afterwards)
    assert _rows(_taught(8, short, draft_ms_per_row=0.0), 100.0, flat) == 8
    long = [8, 8, 7, 8, 6, 8]
    assert _rows(_taught(8, long, draft_ms_per_row=1.0), 100.0, flat) == 8


def test_verify_cost_counts_too():
    """A row drafted is a row verified: a steep verify cost shortens drafts that would otherwise pay."""
    medium = [4, 5, 3, 6, 4, 5]
    steep = lambda n: 0.005 * n  # noqa: E731 - half a token of cost per verified row at 100 tokens/s
    flat = lambda n: 0.002  # noqa: E731
    assert _rows(_taught(8, medium, draft_ms_per_row=0.1), 100.0, flat) > _rows(
        _taught(8, medium, draft_ms_per_row=0.1), 100.0, steep
    )


def test_short_verifies_that_took_everything_count_as_at_least():
    """Steps cut short by the draft length say "at least D": they do not teach that steps stop at D."""
    choice = DraftLength(8)
    for _ in range(50):
        choice.verified(3, 3)  # drafted 3 rows, all taken
    assert choice.committed.expected(8) > 5.0


def test_draft_cost_per_row_is_told_apart_from_the_context_it_takes_in():
    """Long drafts tend to follow long accepted runs, which bring more context: rows must not take its cost."""
    from dflash_cli.decoding.draft_length import DraftCost

    cost, rng = DraftCost(), np.random.default_rng(0)
    for _ in range(200):
        rows = int(rng.integers(2, 9))
        context = rows + int(rng.integers(0, 3))  # correlated with the rows
        cost.add(rows, context, 0.001 + 0.0001 * rows + 0.0004 * context)
    assert abs(cost.per_row() - 0.0001) < 1e-6


def test_every_few_steps_the_whole_block_is_drafted():
    choice = _taught(8, [1, 2, 1, 2, 1, 1], draft_ms_per_row=1.0)
    flat = lambda n: 0.002  # noqa: E731
    picks = [choice.rows(100.0, flat) for _ in range(2 * EXPLORE)]
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
