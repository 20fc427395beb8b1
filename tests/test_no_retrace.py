"""Skipping torch.onnx's decomposition re-trace gives the graphs the re-trace gives, up to names and order."""

from __future__ import annotations

import hashlib
from collections import Counter

import onnx
import pytest
import torch
from onnx import numpy_helper

from dflash_cli.exporting import no_retrace

pytestmark = pytest.mark.slow  # builds or exports pairs: left out of `make test-fast`

GRAPHS = ("target", "target_prefix", "draft", "draft_prefix")


def _shape(graph) -> tuple[Counter, list[str]]:
    """The graph as a multiset of node fingerprints plus its outputs' fingerprints. A value's fingerprint
    is its producer's op, attributes and input fingerprints (graph inputs and weights by name, small
    constants by content), so node and value names and the order of independent nodes do not matter."""
    model = graph
    value: dict[str, str] = {i.name: "in:" + i.name for i in model.graph.input}
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            value[init.name] = "w:" + init.name
        else:
            arr = numpy_helper.to_array(init)
            value[init.name] = (
                "c:" + hashlib.sha256(arr.tobytes() + str(arr.dtype).encode() + str(arr.shape).encode()).hexdigest()
            )
    nodes = Counter()
    pending = list(model.graph.node)
    while pending:  # topological by readiness, whatever the stored order
        rest = []
        for node in pending:
            if all(i == "" or i in value for i in node.input):
                attrs = sorted((a.name, str(onnx.helper.get_attribute_value(a))) for a in node.attribute)
                key = hashlib.sha256(
                    repr((node.op_type, node.domain, attrs, [value.get(i, "") for i in node.input])).encode()
                ).hexdigest()
                nodes[key] += 1
                for k, o in enumerate(node.output):
                    value[o] = f"{key}:{k}"
            else:
                rest.append(node)
        assert len(rest) < len(pending), "graph has a cycle or an undefined input"
        pending = rest
    return nodes, [value[o.name] for o in model.graph.output]


@pytest.fixture(params=["qwen3", "llama"])
def exports(request, shared_exports):
    return shared_exports.get(request.param, "retraced"), shared_exports.get(request.param, "replicated")


def test_the_same_graphs_without_the_retrace(exports) -> None:
    retraced, direct = exports
    for g in GRAPHS:
        a = onnx.load(str(retraced / f"{g}.onnx"), load_external_data=False)
        b = onnx.load(str(direct / f"{g}.onnx"), load_external_data=False)
        assert [i.name for i in a.graph.input] == [i.name for i in b.graph.input], g
        assert [o.name for o in a.graph.output] == [o.name for o in b.graph.output], g
        assert _shape(a) == _shape(b), g
        data = f"{g}.onnx.data"
        if (retraced / data).exists():
            assert (retraced / data).read_bytes() == (direct / data).read_bytes(), data


def _tiny_program(module: torch.nn.Module, *args):
    return torch.export.export(module, args, strict=False)


class _Rms(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],)).to(torch.float32)


class _Cast(torch.nn.Module):
    def forward(self, x):
        return x.to(torch.float16) + x.to(torch.float32).sum().to(torch.float16)


def _implemented() -> set:
    from torch.onnx._internal.exporter import _constants, _decomp, _registration

    registry = _registration.ONNXRegistry.from_torchlib(opset_version=_constants.TORCHLIB_OPSET)
    return set(_decomp.get_onnx_implemented_overloads(registry))


def test_an_op_onnx_cannot_translate_takes_the_full_path() -> None:
    program = _tiny_program(_Rms(), torch.ones(2, 4))
    assert no_retrace.needs_decomposition(program.graph_module, _implemented())


def test_casts_are_lowered_as_the_retrace_lowers_them() -> None:
    program = _tiny_program(_Cast(), torch.ones(2, 4))
    assert not no_retrace.needs_decomposition(program.graph_module, _implemented())
    no_retrace._lower_to_dtype(program.graph_module)
    targets = [n.target for n in program.graph_module.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.to.dtype not in targets
    assert targets.count(torch.ops.aten._to_copy.default) == 2  # to fp16 twice; fp32 -> fp32 is gone
    x = torch.randn(2, 4)
    assert torch.equal(program.module()(x), _Cast()(x))
