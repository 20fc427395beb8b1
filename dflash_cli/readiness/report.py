"""The readiness report: per graph, per specialization, static shapes and op support."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MAX_LISTED = 5  # tensors named per line in the text rendering; to_dict() has them all


@dataclass
class ShapeCheck:
    """One specialization of one graph: which tensors stay non-static with seq_len fixed."""

    specialization: str  # "prefill" | "verify" | "decode"
    seq_len: int
    non_static: list[str] = field(default_factory=list)  # "name (OpType): [1, seq_len, 8]"
    error: str | None = None  # shape inference itself failed

    @property
    def static(self) -> bool:
        return self.error is None and not self.non_static


@dataclass
class GraphReadiness:
    graph: str  # "target" | "draft"
    onnx: str
    shapes: list[ShapeCheck]
    ops: list[str]  # every op type used (functions and subgraphs included), sorted
    unsupported_ops: list[str]  # ops not in the allowlist
    ops_source: str  # which allowlist decided
    fp16_hazards: list[dict[str, str]] = field(default_factory=list)  # readiness.fp16_lint findings

    @property
    def ok(self) -> bool:
        return not self.unsupported_ops and not self.fp16_hazards and all(s.static for s in self.shapes)


@dataclass
class Report:
    graphs: list[GraphReadiness]
    # What the checks can and cannot tell, carried with the data so no reader over-trusts it.
    notes: list[str] = field(
        default_factory=lambda: [
            "static shapes are judged by ONNX shape inference, not by the QAIC compiler",
            "the op allowlist is not the SDK's; `qaic-compile -operators-supported=onnx` is authoritative",
        ]
    )

    @property
    def ok(self) -> bool:
        return all(g.ok for g in self.graphs)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        for graph, data in zip(self.graphs, out["graphs"]):
            data["ok"] = graph.ok
            for shape, shape_data in zip(graph.shapes, data["shapes"]):
                shape_data["static"] = shape.static
        return out

    def render_text(self) -> str:
        """One line per graph x specialization, then the notes."""
        lines = []
        for g in self.graphs:
            ops = "ops ok" if not g.unsupported_ops else "unsupported ops: " + ", ".join(g.unsupported_ops)
            for s in g.shapes:
                if s.error:
                    static = f"static: no ({s.error})"
                elif s.non_static:
                    shown = "; ".join(s.non_static[:MAX_LISTED])
                    more = f"; +{len(s.non_static) - MAX_LISTED} more" if len(s.non_static) > MAX_LISTED else ""
                    static = f"static: no ({shown}{more})"
                else:
                    static = "static: yes"
                lines.append(f"{g.graph} {s.specialization} (seq_len={s.seq_len}): {static}; {ops}")
            kinds: dict[str, list[dict[str, str]]] = {}
            for h in g.fp16_hazards:
                kinds.setdefault(h["kind"], []).append(h)
            for kind, found in kinds.items():
                lines.append(
                    f"{g.graph}: fp16 hazard {kind} x{len(found)} (e.g. {found[0]['detail']}); hint: {found[0]['hint']}"
                )
            if not g.fp16_hazards:
                lines.append(f"{g.graph}: no fp16 hazards (mask constant, RoPE angles, unscaled RMSNorm square)")
        lines.append(f"readiness: {'PASS' if self.ok else 'FAIL'}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
