"""The files qaic-compile reads besides the ONNX: specializations, custom IO, partitions.

Per graph directory (`<out>/target`, `<out>/draft`):
  specializations.json   one entry per static shape the program must serve
  custom_io.yaml         precision of every KV input / retained-state output
  mdp_partition.json     only when the program spans several devices
  qpc/                   the compiler's binary dir (programqpc.bin on success)
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Literal

from dflash_cli.errors import BackendError, CacheError

EXPORT_FILE = "export.json"
GRAPHS = ("target", "draft")


def programs_of(info: Mapping[str, Any]) -> tuple[str, ...]:
    """The programs an export compiles to: the pair, and a vision-language target's tower."""
    return (*GRAPHS, *(("vision",) if "vision" in info.get("graphs", {}) else ()))


def program_graph(info: Mapping[str, Any], program: str) -> Mapping[str, Any]:
    """The graph a program compiles from: where the export wrote one whose cache holds several sequences
    (compile.qaic.full_batch_size, "target_cb"), that one; else the one-sequence graph."""
    return info["graphs"].get(f"{program}_cb") or info["graphs"][program]


SPECIALIZATIONS_FILE = "specializations.json"
CUSTOM_IO_FILE = "custom_io.yaml"
PARTITION_FILE = "mdp_partition.json"
QPC_DIR = "qpc"
PROGRAM_FILE = "programqpc.bin"

KvPrecision = Literal["float16", "mxint8"]
SpecFormat = Literal["named", "legacy"]

# The compiler binds specialization symbols to the ONNX dim_params of the same name. Our export
# makes only `seq_len` symbolic (batch 1 and ctx_len are baked in), but the values of the other
# conventional symbols are known too, so a graph that kept them symbolic still compiles.
KNOWN_SYMBOLS = ("batch_size", "seq_len", "ctx_len")


def read_export_json(export_dir: Path) -> dict[str, Any]:
    """The export stage's description of both graphs (contract in the module docs of export)."""
    path = Path(export_dir) / EXPORT_FILE
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CacheError(
            f"cannot read {path}: {exc}", hint="re-run the export stage to rebuild the ONNX graphs"
        ) from exc
    missing = [k for k in ("block_size", "ctx_len", "prefill_seq_len", "graphs") if k not in info]
    missing += [f"graphs.{g}" for g in GRAPHS if g not in info.get("graphs", {})]
    if missing:
        raise CacheError(f"{path} lacks {', '.join(missing)}", hint="re-run the export stage")
    if info["prefill_seq_len"] % info["block_size"]:
        # Prefill chunks are followed by verify blocks in the same cache; QEfficient's DFlash
        # flow (and ours) assumes the prefill length is a whole number of blocks.
        raise CacheError(
            f"prefill_seq_len {info['prefill_seq_len']} is not a multiple of block_size {info['block_size']}",
            hint="set a prefill length that is a multiple of the block size and re-export",
        )
    return info


def onnx_dim_params(onnx_path: Path) -> set[str]:
    """Symbolic dim names on the graph's inputs and outputs (weights are not loaded)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    names: set[str] = set()
    for value in [*model.graph.input, *model.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                names.add(dim.dim_param)
    return names


def onnx_has_local_functions(onnx_path: Path) -> bool:
    """`-sub-functions` is only meaningful (and only passed) for graphs with local functions."""
    import onnx

    return len(onnx.load(str(onnx_path), load_external_data=False).functions) > 0


def specializations(
    graph_info: Mapping[str, Any],
    dim_params: Collection[str],
    *,
    ctx_len: int,
    batch_size: int = 1,
    fmt: SpecFormat = "named",
) -> dict[str, Any]:
    """specializations.json content, one entry per `graph_info["seq_lens"]` item, in order.

    Only symbols that are dim_params of the ONNX are listed: a symbol the graph does not
    have binds nothing, and we do not rely on how a given SDK treats one. A dim_param we
    have no value for is an export bug the compiler would reject later and less clearly.
    Two entries with identical symbols (prefill length == block size) collapse into one. A graph whose cache
    holds several sequences (`full_batch_size`) also serves each call kind but prefill with all of them at once
    (prefill chunks run one sequence at a time, as QEfficient's continuous batching does).
    """
    unknown = sorted(set(dim_params) - set(KNOWN_SYMBOLS))
    if unknown:
        raise BackendError(
            f"the {graph_info.get('onnx', 'ONNX')} graph has symbolic dims the compiler cannot fix: "
            f"{', '.join(unknown)}",
            hint="re-export; only seq_len (and batch_size, with batch_index) may be symbolic",
        )
    entries: list[tuple[str, dict[str, str]]] = []
    full = graph_info.get("full_batch_size", 0)
    kinds = [(kind, seq_len, batch_size, "") for kind, seq_len in graph_info["seq_lens"].items()]
    if full:
        kinds += [(kind, n, full, f"x{full}") for kind, n in graph_info["seq_lens"].items() if kind != "prefill"]
    for kind, seq_len, batch, tag in kinds:
        values = {"batch_size": batch, "seq_len": seq_len, "ctx_len": ctx_len}
        symbols = {k: str(values[k]) for k in KNOWN_SYMBOLS if k in dim_params}
        if all(symbols != seen for _, seen in entries):
            entries.append((kind.capitalize() + tag, symbols))
    if fmt == "legacy":
        # Older SDKs: a plain list of string dicts, no names.
        return {"specializations": [symbols for _, symbols in entries]}
    return {"specializations": [{"name": name, "symbols": symbols} for name, symbols in entries]}


# A hybrid target's retained state that is not a float tensor (the pending rows' positions, int64): it keeps
# its own type on the device, so custom_io.yaml does not name it.
INTEGER_STATES = ("past_delta_positions",)


def kv_io_names(graph_info: Mapping[str, Any]) -> list[str]:
    """Every cache input (past_*: K/V and a hybrid target's linear-attention states) then every
    retained-state output, in graph order."""
    inputs = [n for n in graph_info["inputs"] if n.startswith("past_")]
    outputs = [n for n in graph_info["outputs"] if n.endswith("_RetainedState")]
    return inputs + outputs


def has_retained_state(graph_info: Mapping[str, Any]) -> bool:
    return bool(kv_io_names(graph_info))


def custom_io_yaml(graph_info: Mapping[str, Any], kv_precision: KvPrecision) -> str:
    """custom_io.yaml: the retained buffers' device precision (fp32 is not allowed for the KV cache).

    mxint8 has no compiler flag; declaring it here for every KV input and output is how an int8 cache
    is requested. A hybrid target's linear-attention states (conv, recurrent state, pending rows) are
    retained buffers too, kept in float16 whatever the KV precision (mxint8 is a KV-cache format); their
    integer positions are left out (see INTEGER_STATES).
    """
    if kv_precision not in ("float16", "mxint8"):
        raise ValueError(f"kv_precision must be float16 or mxint8, not {kv_precision!r}")
    names = [n for n in kv_io_names(graph_info) if not n.startswith(INTEGER_STATES)]
    if not names:
        raise BackendError(
            f"the {graph_info.get('onnx', 'ONNX')} graph lists no past_* inputs or *_RetainedState outputs",
            hint="re-export with the retained-state KV convention",
        )
    kv = ("past_key.", "past_value.")
    return "".join(
        f"- IOName: {name}\n  Precision: {kv_precision if name.startswith(kv) else 'float16'}\n\n" for name in names
    )


def partition_config(num_devices: int, num_cores: int) -> dict[str, Any]:
    """Multi-device (tensor-sliced) partition: logical device ids 0..n-1, all cores each.

    Device ids here are positions inside the partition, not QIDs: the runtime maps them to
    real cards when the program is loaded, so the compiled artifact does not depend on which
    QIDs a host happens to use.
    """
    ids = list(range(num_devices))
    return {
        "connections": [{"devices": ids, "type": "p2p"}],
        "partitions": [{"name": "Partition0", "devices": [{"deviceId": i, "numCores": num_cores} for i in ids]}],
    }


def write_graph_inputs(
    graph_info: Mapping[str, Any],
    onnx_path: Path,
    dest: Path,
    *,
    ctx_len: int,
    kv_precision: KvPrecision,
    num_devices: int,
    num_cores: int,
    fmt: SpecFormat = "named",
) -> dict[str, Path]:
    """Write the compiler's side files for one graph into `dest`; returns name -> path."""
    dest.mkdir(parents=True, exist_ok=True)
    spec = specializations(graph_info, onnx_dim_params(onnx_path), ctx_len=ctx_len, fmt=fmt)
    files = {"specializations": dest / SPECIALIZATIONS_FILE}
    files["specializations"].write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")
    if has_retained_state(graph_info):  # the vision program keeps nothing between calls
        files["custom_io"] = dest / CUSTOM_IO_FILE
        files["custom_io"].write_text(custom_io_yaml(graph_info, kv_precision), encoding="utf-8")
    if num_devices > 1:
        files["partition"] = dest / PARTITION_FILE
        partition = partition_config(num_devices, num_cores)
        files["partition"].write_text(json.dumps(partition, indent=2) + "\n", encoding="utf-8")
    return files
