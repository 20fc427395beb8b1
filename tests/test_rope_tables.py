"""RoPE in the exported graphs is a table lookup: fp16-safe at long positions (QAIC runs fp16)."""

from __future__ import annotations

import onnx
import pytest
import torch
from transformers import Qwen3Config

from dflash_cli.modeling.layers import Rotary


def test_angles_in_fp16_break_at_long_positions_tables_do_not():
    """Qwen3's theta 1e6, head_dim 128, positions to 4096: the angle position x inv_freq computed in fp16
    (what -convert-to-fp16 makes of the computed form) is off by whole radians; fp16 table values are not."""
    cfg = Qwen3Config(hidden_size=1024, num_attention_heads=8, head_dim=128, rope_theta=1e6)
    rotary = Rotary(cfg)
    cos, _ = rotary.tables(4096)
    positions = torch.arange(4096)
    angle16 = (positions.half()[:, None] * rotary.inv_freq.half()).float()
    computed16 = torch.cat((angle16, angle16), -1).cos()
    band = slice(2048, 4096)
    assert (computed16[band] - cos[band]).abs().max() > 0.5  # the issue measured ~1.9 here
    assert (cos.half().float() - cos).abs().max() < 1e-3  # a table value in fp16: ~5e-4 at most


def test_lookup_equals_computed_and_padding_takes_position_zero():
    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=1e6)
    computed, looked_up = Rotary(cfg), Rotary(cfg)
    looked_up.use_tables(*looked_up.tables(64))
    positions = torch.tensor([[0, 5, 63, -1]])
    for a, b in zip(computed(positions), looked_up(positions)):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a[..., 3, :], a[..., 0, :])  # padding (-1) reads position 0


@pytest.mark.parametrize("graph", ["target", "draft"])
def test_exported_graphs_look_rope_up(qwen3_engine, graph):
    model = onnx.load(str(qwen3_engine.export_dir / f"{graph}.onnx"), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"Cos", "Sin"}, "angles are computed in the graph"
    tables = {i.name: list(i.dims) for i in model.graph.initializer if i.name.endswith(("cos_table", "sin_table"))}
    assert len(tables) == 2 and all(dims[0] == qwen3_engine.ctx_len for dims in tables.values())


@pytest.mark.parametrize("graph", ["target", "draft"])
def test_exported_ops_stay_on_the_qaic_allow_list(qwen3_engine, graph):
    """What the export emits (RoPE lookup, padding map) must stay within the ops `dflash check` accepts."""
    from dflash_cli.readiness.ops import graph_ops, load_allowlist, unsupported_ops

    model = onnx.load(str(qwen3_engine.export_dir / f"{graph}.onnx"), load_external_data=False)
    allowed, _ = load_allowlist()
    assert unsupported_ops(graph_ops(model), allowed) == []
