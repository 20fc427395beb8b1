"""torch.onnx export with only `seq_len` symbolic (batch 1, static ctx_len), as accelerators want.

`trace_template` (the dynamo exporter) traces a module whose parameters live on the meta device,
so tracing holds no weights; `save_streamed` then streams each initializer from the checkpoint
into external data (see external_data.py): peak memory is the largest tensor, not the model. `export_module` (the
TorchScript exporter) needs real weights and is kept for small models and as a fallback.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch

from dflash_cli.errors import DFlashError
from dflash_cli.exporting.external_data import Initializer, WrittenTensors, write_initializers
from dflash_cli.exporting.names import BLOCK_ROWS, PROPOSAL_ROWS, WRAPPER_PREFIX
from dflash_cli.exporting.no_retrace import skip_retrace

PENDING_ROWS = "pending_rows"
BATCH = "batch"  # axis 0 of a batched prefix graph's inputs (sequences per call)
SLOT_BATCH = "batch_size"  # the same in a graph with `batch_index` (QEfficient's name for it)
PENDING_ROWS_INPUTS = ("past_delta.", "past_delta_positions")  # a hybrid target's inputs with that dim

# Above this many parameter bytes the TorchScript graph keeps its weights in a side `.data` file (protobuf's 2 GB cap).
EXTERNAL_DATA_BYTES = 1 << 30


def trace_template(
    module: torch.nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    input_names: list[str],
    output_names: list[str],
    symbolic_inputs: dict[str, int],
    sources: dict[str, Initializer],
    opset: int = 18,
    past_len_inputs: tuple[str, ...] = (),
    pending_rows_inputs: tuple[str, ...] = (),
    batch_inputs: tuple[str, ...] = (),
    block_inputs: tuple[str, ...] = (),
    moe_ops: str = "ort",
):
    """The traced, optimised graph of `module` (parameters on the meta device) whose weight initializers
    read `sources` lazily, and {graph initializer name: its source}. Reads no weight bytes. `sources`
    maps a parameter/buffer name of `module` to the producer of its bytes; `past_len_inputs` get a
    second symbolic dim, `past_len`, on axis 1 (the prefix-cache graphs' filled slots); `pending_rows_inputs`
    one of their own, `pending_rows` (a hybrid target's rows of the previous call, modeling/delta_rollback.py);
    `batch_inputs` a symbolic axis 0, `batch` (the prefix graphs that serve several sequences per call);
    `block_inputs` a symbolic axis 1 of their own, `block_len` (a draft prefix graph's block, as many rows as it
    is handed: `dflash bench` times shorter drafts from one build); `moe_ops` how experts are written
    (exporting/options.py)."""
    import onnxscript.rewriter.onnx_fusions

    from dflash_cli.exporting.row_scans import expand_scans
    from dflash_cli.modeling import delta_scan, moe, moe_gathered, row_attention, slot_cache

    seq = torch.export.Dim("seq_len", min=1, max=8192)
    past_len = torch.export.Dim("past_len", min=1, max=1 << 20)
    dynamic = {_arg(n): ({symbolic_inputs[n]: seq} if n in symbolic_inputs else None) for n in input_names}
    dynamic |= {_arg(n): {1: past_len} for n in past_len_inputs}
    pending = torch.export.Dim(PENDING_ROWS, min=1, max=1 << 20)
    dynamic |= {_arg(n): {1: pending} for n in pending_rows_inputs}
    batch = torch.export.Dim(BATCH, min=1, max=1024)
    rows = torch.export.Dim(BLOCK_ROWS, min=2, max=1024)
    dynamic |= {_arg(n): {1: rows} for n in block_inputs}
    if PROPOSAL_ROWS in input_names:  # a DFlash draft's prefix graph: how many proposals reach its head
        dynamic[_arg(PROPOSAL_ROWS)] = {1: torch.export.Dim(PROPOSAL_ROWS, min=1, max=1024)}
    for n in batch_inputs:
        dynamic[_arg(n)] = {**(dynamic[_arg(n)] or {}), 0: batch}
    with warnings.catch_warnings(), torch.no_grad(), _one_op_registry(), skip_retrace():
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                _ExplicitArgs(module, input_names),
                example_inputs,
                dynamo=True,
                opset_version=opset,
                input_names=input_names,
                output_names=output_names,
                dynamic_shapes=dynamic,
                optimize=False,  # folding needs values; it runs below, once weights are lazily readable
                verbose=False,
                # mixture-of-experts MLPs; the K/V writes of a cache of several sequences; the delta rule row by row
                custom_translation_table={
                    **(moe_gathered if moe_ops == "gathered" else moe).onnx_translations(),
                    **slot_cache.onnx_translations(),
                    **delta_scan.onnx_translations(),
                    **row_attention.onnx_translations(),
                },
            )
        except Exception as exc:  # the exporter's own error text is the useful part
            raise DFlashError(
                f"ONNX export (dynamo) failed: {str(exc).splitlines()[0][:300]}",
                hint="DFLASH_DEBUG=1 shows the traceback",
            ) from exc
    model = program.model
    expand_scans(model)  # a hybrid target's delta rule, one row at a time
    by_graph_name = {}
    for value in model.graph.initializers.values():
        name = value.name.removeprefix(WRAPPER_PREFIX)
        src = sources.get(name)
        if src is None:
            if value.const_value is None or _is_meta(value.const_value):
                raise DFlashError(f"export: no weights for initializer {name}", hint="this is a dflash bug")
            continue
        old = value.const_value
        value.const_value = lazy_weight(src, old.dtype, tuple(old.shape), value.name)
        by_graph_name[value.name] = src
    # The exporter's usual clean-up, except that nothing computed from a weight is folded into a new
    # constant: weights stay the checkpoint's tensors (streamed, shareable with the other graph).
    weights = {v for v in model.graph.initializers.values() if v.name in by_graph_name}
    _optimize(model, should_fold=lambda node: False if weights & set(node.inputs) else None)
    onnxscript.rewriter.onnx_fusions.fuse(model)
    return model, by_graph_name


def save_streamed(
    model, path: Path, by_graph_name, written: WrittenTensors, progress=None, digest=True, defer=False
) -> int:
    """Stream the initializers into `path`.data, save the graph at `path`; returns data bytes.
    `digest=False`: the data file is not hashed for the cache (a file that is never published).
    `defer`: checkpoint weights are left out (a lean export, external_data.DEFERRED)."""
    import onnx_ir as ir

    nbytes = write_initializers(
        model, path.parent, path.name + ".data", by_graph_name, written, progress, digest, defer
    )
    ir.save(model, str(path))
    _name_seq_dims(path)
    return nbytes


def lazy_weight(src: Initializer, dtype, shape: tuple[int, ...], name: str):
    """An onnx_ir tensor whose bytes come from `src` when written."""
    import onnx_ir as ir

    return ir.LazyTensor(_reader(src, dtype, shape), dtype=dtype, shape=ir.Shape(shape), name=name)


_REGISTRIES: dict = {}  # opset -> torch.onnx's table of ATen -> ONNX functions, built once per process


@contextlib.contextmanager
def _one_op_registry():
    """Let torch.onnx build its op registry once per process instead of once per export call (~1 s of
    every call on 2 cores, four calls a build). Private API: when it moves, each call builds its own."""
    try:
        from torch.onnx._internal.exporter import _registration

        cls = _registration.ONNXRegistry
        original = cls.__dict__["from_torchlib"]
    except (ImportError, AttributeError, KeyError):
        yield
        return

    def from_torchlib(klass, *args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in _REGISTRIES:
            _REGISTRIES[key] = original.__func__(klass, *args, **kwargs)
        return _REGISTRIES[key]

    cls.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        cls.from_torchlib = original


def _optimize(model, should_fold) -> None:
    """onnxscript's optimize_ir (fold, rewrite, clean up) without merging initializers of equal content:
    two layers whose norm weights happen to be equal (all ones in a fresh model) keep their own, as
    a graph grown from one traced layer must (replicate.py), and as any other checkpoint may differ."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    from onnxscript import rewriter
    from onnxscript.optimizer import _constant_folding

    passes = ir.passes.Sequential(
        common.InlinePass(),
        ir.passes.PassManager(
            [
                _constant_folding.FoldConstantsPass(
                    shape_inference=True,
                    input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                    output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                    should_fold=should_fold,
                ),
                rewriter.RewritePass(rewriter._DEFAULT_REWRITE_RULES),
                common.RemoveUnusedNodesPass(),
                common.RemoveUnusedFunctionsPass(),
                common.RemoveUnusedOpsetsPass(),
            ],
            steps=2,
            early_stop=True,
        ),
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    )
    passes(model)


def _reader(src: Initializer, dtype, shape: tuple[int, ...]):
    import numpy as np
    import onnx_ir as ir

    def read():
        data = np.concatenate([np.asarray(b).reshape(-1) for b in src.produce()]).view(dtype.numpy())
        return ir.Tensor(data.reshape(shape), dtype=dtype)

    return read


def _is_meta(tensor) -> bool:
    raw = getattr(tensor, "raw", None)
    return isinstance(raw, torch.Tensor) and raw.is_meta


def export_module(
    module: torch.nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    input_names: list[str],
    output_names: list[str],
    symbolic_inputs: dict[str, int],
    path: Path,
    *,
    opset: int = 17,
) -> Path:
    """TorchScript export of a module with real weights; `symbolic_inputs` maps an input to its `seq_len` axis."""
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    external = param_bytes > EXTERNAL_DATA_BYTES
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        axes = {n: {ax: "seq_len"} for n, ax in symbolic_inputs.items()}
        torch.onnx.export(
            module,
            example_inputs,
            str(path),
            dynamo=False,
            opset_version=min(opset, 17),
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=axes,
        )
        if external:
            import onnx

            model = onnx.load(str(path))
            onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data")
    _name_seq_dims(path)
    return path


def _arg(name: str) -> str:
    return name.replace(".", "_")


class _ExplicitArgs(torch.nn.Module):
    """forward(input_ids, position_ids, past_key_0, ...) instead of *past: torch.export's dynamic
    shapes cannot describe varargs, so the signature is generated from the input names."""

    def __init__(self, inner: torch.nn.Module, input_names: list[str]) -> None:
        super().__init__()
        self.inner = inner
        args = ", ".join(_arg(n) for n in input_names)
        scope: dict = {}
        exec(f"def forward(self, {args}):\n    return self.inner({args})", scope)  # noqa: S102 - names are ours
        self.forward = scope["forward"].__get__(self)


def _name_seq_dims(path: Path) -> None:
    """Name the symbolic dims of graph inputs/outputs (dynamo names them s0...): axis 1 of a `past_*` input
    is `past_len` (prefix-cache graphs) or, for pending rows, `pending_rows`; axis 0 `batch`; axis 1 of a draft's
    block inputs and outputs, where it varies, `block_len`; every other one `seq_len`."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    changed = False
    # a batched prefix graph's token inputs have a symbolic axis 0 (a vision tower's axis 0 is its patches)
    batched = any(i.name == "input_ids" and i.type.tensor_type.shape.dim[0].dim_param for i in model.graph.input)
    block = _block_rows(model)
    proposal_rows = any(i.name == PROPOSAL_ROWS for i in model.graph.input)
    slot_graph = any(i.name == "batch_index" for i in model.graph.input)
    for vi in [*model.graph.input, *model.graph.output]:
        is_past = vi.name.startswith("past_") and vi in model.graph.input
        for axis, dim in enumerate(vi.type.tensor_type.shape.dim):
            rows = vi.name.startswith(PENDING_ROWS_INPUTS)
            want = (PENDING_ROWS if rows else "past_len") if is_past and axis == 1 else "seq_len"
            if axis == 1 and block and vi.name.startswith("draft_"):  # the proposals: all rows but the first
                want = PROPOSAL_ROWS if proposal_rows else BLOCK_ROWS + "-1"
            if axis == 1 and vi.name == PROPOSAL_ROWS:
                want = PROPOSAL_ROWS
            want = BLOCK_ROWS if axis == 1 and vi.name in block else want
            # a "_cb" graph's calls: `batch_size`, the symbol QAIC's specializations fix (qaic/specs.py)
            want = (SLOT_BATCH if slot_graph else BATCH) if axis == 0 and batched else want
            if dim.HasField("dim_param") and dim.dim_param != want:
                dim.dim_param = want
                changed = True
    if changed:
        onnx.save_model(model, str(path))


def _block_rows(model) -> set[str]:
    """A draft graph's inputs and outputs along its block: those whose axis 1 is input_ids' symbolic axis 1
    where context_features' is another (a draft that drafts any number of rows)."""
    dims = {vi.name: vi.type.tensor_type.shape.dim for vi in [*model.graph.input, *model.graph.output]}
    if "context_features" not in dims or len(dims.get("input_ids", ())) < 2:
        return set()
    block = dims["input_ids"][1].dim_param
    if not block or block == dims["context_features"][1].dim_param:
        return set()
    return {n for n, d in dims.items() if len(d) > 1 and d[1].dim_param == block}
