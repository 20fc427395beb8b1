"""Skip torch.onnx's decomposition re-trace when the captured graph needs none.

torch.onnx.export captures the module with torch.export, then traces the whole program a second
time to decompose every ATen op ONNX has no translation for: more than half of each export's CPU
time here (one-layer Qwen3-0.6B template: ~1.5 s instead of ~4 s). Our models' captured graphs hold
only ops torchlib translates directly, plus assertion nodes (dropped afterwards anyway) and
`aten.to.dtype`, which the re-trace turns into `_to_copy` or, to the same dtype, into nothing (and
`reshape` into views). So when every op is one of those, `_prepare_exported_program_for_export` is
replaced by those small rewrites and the exporter's own type-promotion and assertion passes; any
other op (or a torch whose private exporter API has moved) takes the full path. The graphs come out
the same up to node names and the order of independent nodes (tests/test_no_retrace.py).
DFLASH_EXPORT_RETRACE=1 always takes the full path.
"""

from __future__ import annotations

import contextlib
import operator
import os

import torch

# Non-ATen callables torch.export leaves in a graph for symbolic sizes; they translate as they are.
_SYMBOLIC = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.floordiv,
    operator.truediv,
    operator.mod,
    operator.neg,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.getitem,
    torch.sym_not,
    torch.sym_max,
    torch.sym_min,
    torch.sym_float,
    torch.sym_int,
}


def _rewritable() -> set:
    aten = torch.ops.aten
    return {
        aten.to.dtype,
        aten._assert_scalar.default,
        aten._assert_tensor_metadata.default,
        aten.sym_constrain_range_for_size.default,
        aten._assert_async.default,
        aten._assert_async.msg,
    }


def needs_decomposition(graph_module: torch.fx.GraphModule, implemented: set) -> bool:
    """True when some node is neither translatable as it is nor one `_lower_to_dtype` handles."""
    extra = _rewritable()
    for node in graph_module.graph.nodes:
        if node.op == "call_function":
            target = node.target
            if isinstance(target, torch._ops.OpOverload):
                if target not in implemented and target not in extra:
                    return True
                if target is torch.ops.aten.to.dtype and not _plain_to_dtype(node):
                    return True
            elif target not in _SYMBOLIC:
                return True
        elif node.op not in ("placeholder", "output", "get_attr"):
            return True  # call_module / call_method: not what torch.export emits for our models
    return False


def _plain_to_dtype(node) -> bool:
    """aten.to.dtype(x, dtype) without non_blocking, copy or memory_format."""
    args, kwargs = node.args, node.kwargs
    if len(args) != 2 or set(kwargs) - {"non_blocking", "copy", "memory_format"}:
        return False
    return not kwargs.get("non_blocking") and not kwargs.get("copy") and kwargs.get("memory_format") is None


def _lower_to_dtype(graph_module: torch.fx.GraphModule) -> None:
    """aten.to.dtype -> nothing when the dtype is unchanged, else aten._to_copy (as the re-trace does)."""
    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.to.dtype:
            x, dtype = node.args
            if x.meta["val"].dtype == dtype:
                node.replace_all_uses_with(x)
            else:
                with graph.inserting_before(node):
                    copy = graph.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": dtype})
                copy.meta = dict(node.meta)
                node.replace_all_uses_with(copy)
            graph.erase_node(node)
    graph_module.recompile()


def _reshape_as_view(graph_module: torch.fx.GraphModule) -> None:
    """aten.reshape -> aten._unsafe_view, as the re-trace leaves it (a view, or a copy then a view): both
    translate to Reshape(allowzero=1) where reshape gives allowzero=0. Done after type promotion, which
    re-runs the graph on fake tensors and would refuse a view of a non-contiguous tensor."""
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.reshape.default:
            node.target = torch.ops.aten._unsafe_view.default
    graph_module.recompile()


@contextlib.contextmanager
def skip_retrace():
    """Within: torch.onnx.export prepares a graph that needs no decomposition without re-tracing it."""
    try:
        from torch.onnx._internal.exporter import _core, _decomp, _fx_passes

        original = _core._prepare_exported_program_for_export
        implemented_overloads = _decomp.get_onnx_implemented_overloads
    except (ImportError, AttributeError):
        yield
        return
    if os.environ.get("DFLASH_EXPORT_RETRACE") == "1":
        yield
        return

    def prepare(exported_program, *, registry):
        graph_module = exported_program.graph_module
        if needs_decomposition(graph_module, set(implemented_overloads(registry))):
            return original(exported_program, registry=registry)
        _lower_to_dtype(graph_module)
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            _fx_passes.insert_type_promotion_nodes(graph_module)
        graph_module = _fx_passes.remove_assertion_nodes(graph_module)
        _reshape_as_view(graph_module)
        exported_program._graph_module = graph_module
        return exported_program

    _core._prepare_exported_program_for_export = prepare
    try:
        yield
    finally:
        _core._prepare_exported_program_for_export = original
