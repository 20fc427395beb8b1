"""torch.onnx export with only `seq_len` symbolic (batch 1, static ctx_len), as accelerators want."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from dflash_cli.errors import DFlashError

# Above this many parameter bytes the graph keeps its weights in a side `.data` file (protobuf's 2 GB cap).
EXTERNAL_DATA_BYTES = 1 << 30


def export_module(
    module: torch.nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    input_names: list[str],
    output_names: list[str],
    symbolic_inputs: dict[str, int],
    path: Path,
    *,
    opset: int = 18,
    exporter: str = "dynamo",
) -> Path:
    """Export `module`; `symbolic_inputs` maps an input name to the axis that is `seq_len`."""
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    external = param_bytes > EXTERNAL_DATA_BYTES
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            seq = torch.export.Dim("seq_len", min=1, max=8192)
            dynamic = {_arg(n): ({symbolic_inputs[n]: seq} if n in symbolic_inputs else None) for n in input_names}
            module = _ExplicitArgs(module, input_names)
            try:
                program = torch.onnx.export(
                    module,
                    example_inputs,
                    dynamo=True,
                    opset_version=opset,
                    input_names=input_names,
                    output_names=output_names,
                    dynamic_shapes=dynamic,
                    optimize=True,
                    verbose=False,
                )
            except Exception as exc:  # the exporter's own error text is the useful part
                raise DFlashError(
                    f"ONNX export (dynamo) failed: {str(exc).splitlines()[0][:300]}",
                    hint="retry with `--set export.exporter=torchscript`; DFLASH_DEBUG=1 shows the traceback",
                ) from exc
            program.save(str(path), external_data=external)
        else:
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
    _name_seq_dims(path, external)
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


def _name_seq_dims(path: Path, external: bool) -> None:
    """Make every symbolic dim of graph inputs/outputs carry the name `seq_len` (dynamo names them s0...)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    changed = False
    for vi in [*model.graph.input, *model.graph.output]:
        for dim in vi.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param != "seq_len":
                dim.dim_param = "seq_len"
                changed = True
    if changed:
        onnx.save_model(model, str(path))
