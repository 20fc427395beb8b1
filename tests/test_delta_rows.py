"""The delta rule row by row (modeling/delta_scan.py, exporting/row_scans.py): the same numbers as the block
form, and in ONNX Runtime a row of a long call is bit-equal to a one-token call from the same state, as is
the state after folding the rows a verify accepted to the state after one-token calls."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from dflash_cli.modeling.delta_rollback import RollbackDeltaLayer
from dflash_cli.modeling.delta_scan import delta_fold, delta_rows

HEADS, DK, DV, ROWS = 3, 16, 8, 9  # 3 heads: no shape here is a multiple of a vector width


def _config() -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        hidden_size=48, num_hidden_layers=1, intermediate_size=96, vocab_size=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=HEADS,
        linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=4,
    )  # fmt: skip


@torch.no_grad()
def test_row_by_row_equals_the_block_form() -> None:
    torch.manual_seed(0)
    layer = RollbackDeltaLayer(_config(), squarings=4).eval()
    for p in layer.parameters():
        p.normal_(0.0, 0.3)
    x = torch.randn(2, ROWS, 48)
    valid = torch.ones(2, ROWS, dtype=torch.bool)
    valid[1, -3:] = False  # padding rows leave the state alone
    fresh, none = torch.ones(2, 1, dtype=torch.bool), torch.zeros(2, 1, dtype=torch.bool)
    conv, state = layer.zero_states(2)
    state.normal_()
    rows = layer.empty_rows(2, 1)
    outs = []
    for row_by_row in (False, True):
        layer.row_by_row = row_by_row
        outs.append(layer.step(x, valid, fresh & False, none, None, None, conv, state, rows))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _Call(torch.nn.Module):
    """One call of a linear layer's recurrence: fold the pending rows taken, then run the call's rows."""

    def forward(self, state, pk, pu, pg, take, q, k, v, a, b, rate, valid):
        state = delta_fold(state, pk, pu, pg, take)
        o, u, g = delta_rows(state, q, k, v, a, b, rate, valid)
        return o, u, state, g


@pytest.fixture(scope="module")
def scan_session(tmp_path_factory):
    """_Call exported as the build exports it (custom ops, then Scans), in an ONNX Runtime session."""
    from dflash_cli.exporting.row_scans import expand_scans
    from dflash_cli.modeling import delta_scan

    t, r = torch.export.Dim("t", min=1, max=64), torch.export.Dim("r", min=1, max=64)
    example = _inputs(np.random.default_rng(0), 3, 4)
    dims = [None, {2: r}, {2: r}, {2: r}, {1: r}, {2: t}, {2: t}, {2: t}, {2: t}, {2: t}, None, {1: t}]
    program = torch.onnx.export(
        _Call(),
        tuple(torch.from_numpy(a) for a in example),
        dynamo=True,
        input_names=list(NAMES),
        output_names=["o", "u", "state_out", "g"],
        dynamic_shapes=dims,
        custom_translation_table=delta_scan.onnx_translations(),
        optimize=False,
    )
    assert expand_scans(program.model) == 2
    assert {n.op_type for n in program.model.graph} == {"Scan"}
    path = tmp_path_factory.mktemp("scan") / "call.onnx"
    program.save(str(path))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


NAMES = ("state", "pk", "pu", "pg", "take", "q", "k", "v", "a", "b", "rate", "valid")


def _inputs(rng, pending: int, rows: int) -> list[np.ndarray]:
    def f(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    return [
        f(1, HEADS, DK, DV),
        unit(f(1, HEADS, pending, DK)),
        f(1, HEADS, pending, DV),
        -np.abs(f(1, HEADS, pending)),
        np.arange(pending)[None] < pending - 1,  # the last pending row was rejected
        unit(f(1, HEADS, rows, DK)),
        unit(f(1, HEADS, rows, DK)),
        f(1, HEADS, rows, DV),
        f(1, HEADS, rows),
        f(1, HEADS, rows),
        -np.exp(f(HEADS)),
        np.arange(rows)[None] < rows - 1 if rows > 2 else np.ones((1, rows), bool),  # a padding row last
    ]


def test_a_verify_equals_one_token_calls_bit_for_bit(scan_session) -> None:
    """A call of ROWS rows, then the same rows one call each, each folding the row before it: every row's
    output and correction, and the state after folding any number of accepted rows, are the same bits."""
    feeds = dict(zip(NAMES, _inputs(np.random.default_rng(1), 3, ROWS)))
    o, u, base, g = scan_session.run(None, feeds)
    k = feeds["k"]
    step = dict(feeds)
    for t in range(ROWS):
        step.update(
            {n: feeds[n][:, :, t : t + 1] for n in ("q", "k", "v", "a", "b")}, valid=feeds["valid"][:, t : t + 1]
        )
        o1, u1, state, g1 = scan_session.run(None, step)
        same = [np.array_equal(x1[:, :, 0], x[:, :, t]) for x1, x in ((o1, o), (u1, u), (g1, g))]
        assert all(same), f"row {t}"
        # the next call folds this row; a verify's next call folds the first t+1 rows of the verify instead
        step.update(state=state, pk=k[:, :, t : t + 1], pu=u1, pg=g[:, :, t : t + 1], take=np.ones((1, 1), bool))
        if t == 0:
            assert not np.array_equal(state, feeds["state"])
        accepted = dict(feeds, state=base, pk=k, pu=u, pg=g, take=(np.arange(ROWS) <= t)[None])
        folded = scan_session.run(None, accepted)[2]
        after_rows = scan_session.run(None, step)[2]
        assert np.array_equal(folded, after_rows), f"state after {t + 1} accepted rows"
