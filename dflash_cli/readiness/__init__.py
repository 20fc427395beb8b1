"""QAIC readiness: what can be checked about the exported graphs without the SDK or a card.

  check_graph(onnx_path, {"prefill": 128, "verify": 16}) -> GraphReadiness
  readiness_report(export_dir) -> Report      (every graph, specializations from export.json)

(a) static shapes per specialization (static_shapes), (b) ops against an allowlist (ops),
(c) fp16 hazards named from graph patterns (fp16_lint), (d) fp16 emulation helpers for the
fp16-vs-fp32 agreement checks run by the caller (fp16, fp16_agreement, fp16_bands).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from dflash_cli.readiness.report import GraphReadiness, Report, ShapeCheck

__all__ = ["GraphReadiness", "Report", "ShapeCheck", "check_graph", "readiness_report"]


def check_graph(
    onnx_path: Path,
    specializations: Mapping[str, int],
    *,
    graph_name: str | None = None,
    ops_file: Path | None = None,
    batch_size: int = 0,
) -> GraphReadiness:
    """Check one graph; `specializations` maps a name to its seq_len ({"prefill": 128, ...}); `batch_size`: the
    sequences per call of a graph with batch_index (its largest specialization)."""
    import onnx

    from dflash_cli.readiness.fp16_lint import fp16_hazards
    from dflash_cli.readiness.ops import graph_ops, load_allowlist, unsupported_ops
    from dflash_cli.readiness.static_shapes import check_static_shapes

    onnx_path = Path(onnx_path)
    # Weights are not needed for shapes or op types; skipping them keeps big graphs cheap.
    model = onnx.load(str(onnx_path), load_external_data=False)
    allowed, source = load_allowlist(ops_file)
    used = graph_ops(model)
    return GraphReadiness(
        graph=graph_name or onnx_path.stem,
        onnx=str(onnx_path),
        shapes=[check_static_shapes(model, name, seq_len, batch_size) for name, seq_len in specializations.items()],
        ops=sorted(used),
        unsupported_ops=unsupported_ops(used, allowed),
        ops_source=source,
        fp16_hazards=[h.to_dict() for h in fp16_hazards(model)],
    )


def readiness_report(export_dir: Path, *, ops_file: Path | None = None) -> Report:
    """The graphs of an export artifact (target, draft, and a vision-language target's tower), each at the
    seq_lens export.json lists for it."""
    from dflash_cli.qaic.specs import GRAPHS, program_graph, read_export_json

    export_dir = Path(export_dir)
    info = read_export_json(export_dir)
    names = [*GRAPHS, *(["vision"] if "seq_lens" in info["graphs"].get("vision", {}) else [])]
    graphs = [
        check_graph(
            export_dir / program_graph(info, g)["onnx"],
            program_graph(info, g)["seq_lens"],
            graph_name=g,
            ops_file=ops_file,
            batch_size=program_graph(info, g).get("full_batch_size", 0),
        )
        for g in names
    ]
    return Report(graphs=graphs)
