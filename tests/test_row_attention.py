"""Attention one row at a time (modeling/row_attention.py, exporting/row_scans.py): the numbers of the
masked matrix form, and in ONNX Runtime a row of a long call bit-equal to a one-token call at its position."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from dflash_cli.modeling.layers import grouped_attention
from dflash_cli.modeling.row_attention import row_attention

HEADS, KV_HEADS, DIM, PAST, ROWS = 6, 2, 40, 21, 70  # 70 rows: past where a MatMul over the call changes kernels


def _inputs(rng, rows: int):
    def f(*shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))

    slots = PAST + rows
    return f(1, HEADS, rows, DIM), f(1, KV_HEADS, slots, DIM), f(1, KV_HEADS, slots, DIM)


def test_equals_the_masked_matrix_form() -> None:
    q, k, v = _inputs(np.random.default_rng(0), 9)
    positions = torch.arange(PAST, PAST + 9)[None]
    visible = (torch.arange(PAST + 9)[None, None, :] <= positions[:, :, None])[:, None]
    want = grouped_attention(q, k, v, visible)
    got = row_attention(q, k, v, positions, DIM**-0.5).transpose(1, 2).reshape(1, 9, -1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _Attend(torch.nn.Module):
    def forward(self, q, k, v, positions):
        return row_attention(q, k, v, positions, DIM**-0.5)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from dflash_cli.exporting.row_scans import expand_scans
    from dflash_cli.modeling import row_attention as module

    rows, slots = torch.export.Dim("rows", min=1, max=256), torch.export.Dim("slots", min=2, max=512)
    q, k, v = _inputs(np.random.default_rng(0), 3)
    program = torch.onnx.export(
        _Attend(),
        (q, k, v, torch.arange(PAST, PAST + 3)[None]),
        dynamo=True,
        input_names=["q", "k", "v", "positions"],
        output_names=["out"],
        dynamic_shapes=[{2: rows}, {2: slots}, {2: slots}, {1: rows}],
        custom_translation_table=module.onnx_translations(),
        optimize=False,
    )
    assert expand_scans(program.model) == 1
    path = tmp_path_factory.mktemp("attend") / "attend.onnx"
    program.save(str(path))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def test_a_long_call_equals_one_token_calls_bit_for_bit(session) -> None:
    q, k, v = (t.numpy() for t in _inputs(np.random.default_rng(1), ROWS))
    positions = np.arange(PAST, PAST + ROWS)[None]
    whole = session.run(None, {"q": q, "k": k, "v": v, "positions": positions})[0]
    reference = row_attention(*(torch.from_numpy(a) for a in (q, k, v, positions)), DIM**-0.5).numpy()
    np.testing.assert_allclose(whole, reference, rtol=1e-5, atol=1e-6)
    for t in range(ROWS):
        seen = PAST + t + 1  # a one-token call at position PAST + t holds the slots up to it
        one = session.run(None, {"q": q[:, :, t : t + 1], "k": k[:, :, :seen], "v": v[:, :, :seen],
                                 "positions": positions[:, t : t + 1]})[0]  # fmt: skip
        assert np.array_equal(one[:, :, 0], whole[:, :, t]), f"row {t}"
