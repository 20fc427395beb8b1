"""Op check: every op a graph uses must be on the QAIC allowlist.

The allowlist shipped here (qaic_ops_allowlist.txt) records where each op came from. On a host
with the SDK, `qaic-compile -operators-supported=onnx` writes the SDK's own list
(OnnxSupportedOperators.txt); point DFLASH_QAIC_OPS_FILE (or `ops_file=`) at it to use that
instead. Its exact layout is not documented to us, so it is read leniently: the first word of
each non-comment line is taken as an op name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

ALLOWLIST_FILE = Path(__file__).with_name("qaic_ops_allowlist.txt")
OPS_FILE_ENV = "DFLASH_QAIC_OPS_FILE"
_DEFAULT_DOMAINS = ("", "ai.onnx")
_OP_RE = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_]*)")


def parse_ops_file(text: str) -> frozenset[str]:
    """Op names: first word per line; `#` starts a comment; blank lines ignored."""
    ops = set()
    for line in text.splitlines():
        m = _OP_RE.match(line.split("#", 1)[0])
        if m:
            ops.add(m.group(1))
    return frozenset(ops)


def load_allowlist(ops_file: Path | None = None) -> tuple[frozenset[str], str]:
    """(allowed ops, where they came from): ops_file, else $DFLASH_QAIC_OPS_FILE, else ours."""
    chosen = ops_file or (Path(os.environ[OPS_FILE_ENV]) if os.environ.get(OPS_FILE_ENV) else None)
    path = Path(chosen) if chosen else ALLOWLIST_FILE
    source = str(path) if chosen else "dflash built-in allowlist (not the SDK's)"
    return parse_ops_file(path.read_text(encoding="utf-8")), source


def graph_ops(model: onnx.ModelProto) -> set[str]:
    """Op types used anywhere: main graph, subgraphs (If/Loop/Scan) and local function bodies.

    A call to a local function is not an op (its body is checked instead). Ops from other
    domains are named "domain::Op" so they never match a default-domain allowlist entry.
    """
    local = {(f.domain, f.name) for f in model.functions}
    found: set[str] = set()

    def visit(nodes: list[onnx.NodeProto]) -> None:
        for node in nodes:
            for attr in node.attribute:
                if attr.HasField("g"):
                    visit(list(attr.g.node))
                for sub in attr.graphs:
                    visit(list(sub.node))
            if (node.domain, node.op_type) in local:
                continue
            found.add(node.op_type if node.domain in _DEFAULT_DOMAINS else f"{node.domain}::{node.op_type}")

    visit(list(model.graph.node))
    for fn in model.functions:
        visit(list(fn.node))
    return found


def unsupported_ops(used: set[str], allowed: frozenset[str]) -> list[str]:
    return sorted(op for op in used if op not in allowed)
