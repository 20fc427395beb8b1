"""fp16 emulation: run a graph the way `qaic-compile -convert-to-fp16` computes it, on ONNX Runtime.

QAIC computes in fp16 even when the ONNX is fp32. Overflow (e.g. an unscaled `fc`, see
REFERENCE section 4) or a mask constant of float32's minimum show up only there, so before a
card is involved we convert the graph to fp16 and compare against fp32 on the CPU.

The converter is onnxruntime's maintained `onnxruntime.transformers.float16` (the successor
of onnxconverter-common's, shipped with onnxruntime, so no extra dependency). Unlike the
onnxconverter-common 1.16 converter it also rewrites existing `Cast(to=float)` nodes (every
RMSNorm has one) and converts graphs over 2 GB from a path. Its clipping of out-of-range constants
is turned off: -convert-to-fp16 does not clip, so a constant beyond fp16's range (float32's minimum
as a mask value) becomes inf here as it would on the card, and its NaNs show.

Limits of the emulation (documented, not hidden): ONNX Runtime's CPU provider runs ops that
lack an fp16 kernel in fp32 behind inserted casts, and the device's fp16 kernels accumulate
differently; agreement here is evidence, not proof, of agreement on a card. mxfp6/mxint8 are
not emulated.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

FP16_MAX = 65504.0
# float16's smallest subnormal; smaller magnitudes flush to it rather than to zero.
FP16_MIN_POSITIVE = 5.96e-08
_EXTERNAL_DATA_BYTES = 1 << 30  # write weights beside the .onnx above 1 GiB (protobuf caps at 2 GiB)


def to_fp16(onnx_path: Path, out_path: Path, *, keep_io_types: bool = True) -> Path:
    """Write an fp16-compute copy of `onnx_path` to `out_path`; returns `out_path`.

    Every float32 initializer, constant, Cast target and intermediate becomes float16
    (op_block_list is empty: -convert-to-fp16 converts everything). int64 ids and positions
    are untouched. With keep_io_types (default) the float inputs and outputs stay float32,
    with Casts at the boundary, so the same feeds and readers work for both graphs.
    Local functions are inlined first: the converter does not descend into them.
    """
    import onnx
    from onnx.inliner import inline_local_functions

    # Imported here: importing onnxruntime.transformers appends its own dir to sys.path.
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from dflash_cli.exporting.onnx_data import load_with_data

    onnx_path, out_path = Path(onnx_path), Path(out_path)
    model = load_with_data(onnx_path)  # external data loaded: initializers must be converted
    if model.functions:
        model = inline_local_functions(model)
    _overflow_to_inf(model)
    big = model.ByteSize() > _EXTERNAL_DATA_BYTES
    model = convert_float_to_float16(
        model,
        min_positive_val=FP16_MIN_POSITIVE,
        max_finite_val=FP16_MAX,  # clips only finite values: the ones made inf above stay inf
        keep_io_types=keep_io_types,
        disable_shape_infer=big,  # in-memory shape inference cannot take > 2 GB protos
        op_block_list=[],
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if big:
        onnx.save_model(
            model,
            str(out_path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=out_path.name + ".data",
        )
    else:
        onnx.save_model(model, str(out_path))
    return out_path


def _overflow_to_inf(model) -> None:
    """Set float constants beyond fp16's range to +-inf, as a cast to fp16 does (the converter would
    clip them to +-65504, which the card does not). Initializers, Constant and ConstantOfShape values."""
    import onnx
    from onnx import numpy_helper

    def fix(tensor) -> None:
        if tensor.data_type != onnx.TensorProto.FLOAT:
            return
        array = numpy_helper.to_array(tensor)
        over = np.abs(array) > FP16_MAX
        if np.any(over & np.isfinite(array)):
            array = np.where(over, np.copysign(np.inf, array), array).astype(np.float32)
            tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))

    def visit(graph) -> None:
        for init in graph.initializer:
            fix(init)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    fix(attr.t)
                for sub in list(attr.graphs) + ([attr.g] if attr.HasField("g") else []):
                    visit(sub)

    visit(model.graph)


def detect_nonfinite(outputs: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Output name -> count of NaN/inf values, for floating outputs that have any."""
    found: dict[str, int] = {}
    for name, array in outputs.items():
        array = np.asarray(array)
        if np.issubdtype(array.dtype, np.floating):
            count = int(array.size - np.count_nonzero(np.isfinite(array)))
            if count:
                found[name] = count
    return found
