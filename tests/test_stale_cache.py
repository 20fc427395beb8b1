"""The exported graphs ignore cache slots nobody wrote, NaN included.

On a card the retained KV buffers are never fed by the host (QEfficient's convention, and ours):
a new sequence starts on whatever the device memory holds. Every output must then equal a run
from a zero cache, through a padded prefill, a verify block and the draft.
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash_cli.backends.ort import OrtSession


def _sessions(engine, graph: str) -> tuple[OrtSession, OrtSession]:
    path = engine.export_dir / f"{graph}.onnx"
    zero, stale = OrtSession(path, graph), OrtSession(path, graph)
    zero.reset()
    stale.reset(fill=float("nan"))
    return zero, stale


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if b[name].dtype.kind == "f":
            assert np.isfinite(b[name]).all(), name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_target_and_draft_ignore_unwritten_slots(qwen3_engine, fill: float) -> None:
    engine = qwen3_engine
    prefill = engine.recipe.export.prefill_seq_len
    t0, t1 = _sessions(engine, "target")
    t1.reset(fill=fill)
    ids = np.zeros((1, prefill), np.int64)
    ids[0, :5] = [5, 9, 2, 7, 11]
    pos = np.full((1, prefill), -1, np.int64)  # a 5-token prompt padded to the prefill length
    pos[0, :5] = np.arange(5)
    first = {"input_ids": ids, "position_ids": pos}
    a, b = t0.run(first), t1.run(first)
    _assert_same(a, b)
    block = engine.block_size
    verify = {
        "input_ids": np.arange(3, 3 + block).reshape(1, -1),
        "position_ids": np.arange(5, 5 + block).reshape(1, -1),
    }
    _assert_same(t0.run(verify), t1.run(verify))

    d0, d1 = _sessions(engine, "draft")
    d1.reset(fill=fill)
    draft = {
        "input_ids": np.full((1, block), engine.mask_token_id, np.int64),
        "position_ids": np.arange(5, 5 + block).reshape(1, -1),
        "context_features": a["context_features"],
        "context_position_ids": pos,
    }
    _assert_same(d0.run(draft), d1.run(draft))
