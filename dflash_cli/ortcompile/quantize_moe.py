"""Mixture-of-experts nodes (com.microsoft.MoE, modeling/moe.py) to ONNX Runtime's QMoE, for int8 / int4.

Each expert's two weights are quantised on their own, block-wise along K like MatMulNBits, and stored
as ONNX Runtime's raw layout: [experts, N, K * bits / 8] bytes and [experts, N, K / block] scales,
symmetric (the default zero point). Experts are read one at a time, from the checkpoint (else the
memory-mapped export), so a layer's fp32 experts are never in memory at once; the packed stack of one
layer is.

Token locality: QMoE at 8 bits is per-token for any number of rows; at 4 bits it takes another kernel
for an expert with a single row, which the graph's doubled rows rule out (modeling/moe.py). The build's
call-length check runs on the result either way (ortcompile/checks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from dflash_cli.exporting.onnx_data import read_initializer


def quantize_experts(
    graph,
    inits: dict,
    write: Callable,
    src_dir: Path,
    *,
    bits: int,
    block_size: int,
    accuracy_level: int,
    done: dict,
    identity: Callable,
    quantize_kn: Callable,
    progress: Callable[[str], None],
    source=None,
) -> tuple[dict[int, object], set[str]]:
    """QMoE nodes for the graph's MoE nodes: ({id(MoE node): QMoE node}, names of the fp32 expert tensors
    they replace). `write(base, packed, scales)` stores a pair and returns (tensors, places); `done` and
    `identity` let the prefix-cache graph point at the first graph's quantised copy; `quantize_kn(w [K, N],
    bits, block)` is ONNX Runtime's block quantiser (packed [N, blocks, blob], scales [N, blocks]); `source`
    (weight_sources.SourceReader) reads the experts from the checkpoint, one at a time, where it can."""
    from onnx import helper

    from dflash_cli.errors import DFlashError

    nodes = [n for n in graph.node if n.op_type == "MoE" and n.domain == "com.microsoft"]
    replaced: dict[int, object] = {}
    dropped: set[str] = set()
    for i, node in enumerate(nodes):
        quantised = []
        for name in (node.input[2], node.input[4]):  # fc1 (gate/up interleaved), fc2 (down)
            weight = inits.get(name)
            if weight is None or len(weight.dims) != 3:
                raise DFlashError(f"compile: MoE node {node.name} has no constant expert weights", hint="a dflash bug")
            experts, n_out, k_in = weight.dims
            if k_in % block_size:
                raise DFlashError(
                    f"compile: expert width {k_in} is not a multiple of compile.ort.block_size {block_size}",
                    hint="set compile.ort.block_size to a power of two that divides it (32 or 64)",
                )
            key = ("experts", identity(weight), bits, block_size)
            dropped.add(name)
            if key[1] is not None and key in done:
                quantised.append(done[key])
                continue
            slabs = source.slabs(weight) if source is not None else None
            if slabs is None:
                slabs = iter(read_initializer(weight, src_dir))
            packed = np.empty((experts, n_out, k_in * bits // 8), np.uint8)
            scales = np.empty((experts, n_out, k_in // block_size), np.float32)
            for e in range(experts):
                w = np.asarray(next(slabs), np.float32).reshape(n_out, k_in)
                p, s = quantize_kn(np.ascontiguousarray(w.T), bits, block_size)
                packed[e], scales[e] = p.reshape(n_out, -1), s
            del slabs, w
            tensors, _ = write(f"{name}.q{bits}", packed, scales)
            quantised.append(tensors)
            if key[1] is not None:
                done[key] = tensors
        (w1, s1), (w2, s2) = quantised
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attrs |= {"expert_weight_bits": bits, "block_size": block_size, "accuracy_level": accuracy_level}
        q = helper.make_node(
            "QMoE",
            # MoE inputs: x, router, fc1, fc1 bias, fc2, fc2 bias; QMoE's: x, router, fc1, its scales, fc1 bias, ...
            [node.input[0], node.input[1], w1.name, s1.name, _input(node, 3), w2.name, s2.name, _input(node, 5)],
            list(node.output),
            name=(node.name or node.output[0]) + "_q",
            domain="com.microsoft",
            **attrs,
        )
        replaced[id(node)] = (q, [w1, s1, w2, s2])
        progress(f"experts of {i + 1}/{len(nodes)} layers to int{bits}")
    return replaced, dropped


def _input(node, index: int) -> str:
    return node.input[index] if len(node.input) > index else ""
