"""Are two export artifacts the same graphs and weights? Byte for byte where the files are; otherwise
node for node and tensor for tensor (a data file may hold the same tensors in another order).

    python benchmarks/compare_exports.py OLD_EXPORT_DIR NEW_EXPORT_DIR     # exit 1 on any difference

For each `*.onnx`: whether the .onnx and .onnx.data files are identical; if not, whether the graphs are
(nodes, inputs, outputs, initializer names, types and shapes, with external-data offsets set aside) and
every initializer's bytes are. Set aside as well: the exporter's stack traces in node metadata (they name
the source files and lines of the code that traced), the checkpoint's path in weight_sources.json, and
export.json's timings and data-file sizes (alignment padding follows the order tensors are written in).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

STACK_TRACE = "pkg.torch.onnx.stack_trace"
PLACE_FIELDS = ("key", "dtype", "rows", "offset", "length")  # of a weight_sources.json record


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _graph_differences(a: Path, b: Path) -> list[str]:
    import onnx

    from dflash_cli.exporting.onnx_data import read_initializer

    ga, gb = (onnx.load(str(p), load_external_data=False) for p in (a, b))
    problems = []
    for g in (ga, gb):
        for node in g.graph.node:
            kept = [p for p in node.metadata_props if p.key != STACK_TRACE]
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
    for what in ("node", "input", "output"):
        la = [x.SerializeToString() for x in getattr(ga.graph, what)]
        lb = [x.SerializeToString() for x in getattr(gb.graph, what)]
        if la != lb:
            problems.append(f"{what}s differ ({len(la)} vs {len(lb)})")
    ia = {t.name: t for t in ga.graph.initializer}
    ib = {t.name: t for t in gb.graph.initializer}
    if set(ia) != set(ib):
        problems.append(f"initializer names differ: {sorted(set(ia) ^ set(ib))[:5]}")
    for name in sorted(set(ia) & set(ib)):
        ta, tb = ia[name], ib[name]
        if (ta.data_type, list(ta.dims)) != (tb.data_type, list(tb.dims)):
            problems.append(f"{name}: type/shape differ")
        elif not np.array_equal(read_initializer(ta, a.parent), read_initializer(tb, b.parent)):
            problems.append(f"{name}: values differ")
    return problems


def _without_timings(info: dict) -> dict:
    for facts in info.get("graphs", {}).values():
        for key in ("seconds", "traced_by", "data_bytes"):
            facts.pop(key, None)
    return info


def _sources(doc: dict) -> dict:
    return {
        graph: {name: [rec.get(f) for f in PLACE_FIELDS] for name, rec in table.items()}
        for graph, table in doc["graphs"].items()
    }


def compare(old: Path, new: Path) -> list[str]:
    problems = []
    names = sorted({p.name for p in old.glob("*.onnx")} | {p.name for p in new.glob("*.onnx")})
    for name in names:
        a, b = old / name, new / name
        if not (a.exists() and b.exists()):
            problems.append(f"{name}: only in {'old' if a.exists() else 'new'}")
            continue
        data = name + ".data"
        same_files = _digest(a) == _digest(b) and (
            not (old / data).exists() or _digest(old / data) == _digest(new / data)
        )
        if same_files:
            print(f"{name}: identical files")
            continue
        diff = _graph_differences(a, b)
        print(f"{name}: files differ; graph and tensors {'identical' if not diff else 'DIFFER'}")
        problems += [f"{name}: {d}" for d in diff]
    if json.loads((old / "pair.json").read_text()) != json.loads((new / "pair.json").read_text()):
        problems.append("pair.json differs")
    if (old / "weight_sources.json").exists():
        wa, wb = (_sources(json.loads((d / "weight_sources.json").read_text())) for d in (old, new))
        if wa != wb:
            problems.append("weight_sources.json differs (checkpoint paths aside)")
    ea, eb = (_without_timings(json.loads((d / "export.json").read_text())) for d in (old, new))
    if ea != eb:
        problems.append("export.json differs (timings aside)")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    args = ap.parse_args()
    problems = compare(args.old, args.new)
    for p in problems:
        print("DIFFERENT:", p)
    print("same graphs and weights" if not problems else f"{len(problems)} differences")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
