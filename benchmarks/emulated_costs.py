"""Another model's call costs on this pair's calls: the demo pair's acceptance at, say, the 4B shape's int4 costs.

    python benchmarks/emulated_costs.py STEP_COST.json T1_MS [--own-rate] [--always-draft] -- serve -r demo ...

runs the `dflash` command with every ONNX Runtime call padded with a sleep to the cost that a
`graph_step_cost.py --lengths ... --draft-rows ...` JSON measured for that many rows, scaled so that a one-token
target call takes T1_MS. A batched call (decoding/batching.py) costs what one call over
all its rows costs: n sequences padded to the longest, n * width rows (an int4 call on a CPU is compute bound,
so rows cost alike whichever sequence they belong to). Past the longest measured length the curve goes on
along its last segment (prefill chunks too: a newcomer's prefill delays the calls of the others).
With `--head-rows` points in the JSON, a draft call that asks for fewer proposals (`proposal_rows`) costs that
much less: head(R) - head(K + 1) for K of a block of R rows, from whole-block drafts measured with K proposals.

`--own-rate`: every slot says it shares its calls with nobody, so the hybrid charges a verify's time at the
request's own rate, not at that of all the sequences sharing the call (what `dflash` did before it weighed
the load): the A/B of that rule. (DFlash then drafts at every step, as alone.)
`--always-draft`: DFlash steps draft whatever the load (what `dflash` did before it could stop drafting).
`install(doc, t1_ms)` does the same inside a benchmark's own process (verify_length_ab.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def curves(doc: dict, t1_ms: float) -> dict:
    """graph -> (rows, seconds) points, scaled so that T(1) is t1_ms."""
    med = next(iter(doc["variants"].values()))["median_ms"]
    scale = t1_ms / med["T(1)"] / 1000
    block = doc["block_size"]
    target = sorted((int(k[2:-1]), v * scale) for k, v in med.items() if k.startswith("T("))
    draft = [(block, med["draft"])] + [(int(k[6:-1]), v) for k, v in med.items() if k.startswith("draft(")]
    out = {"target": target, "draft": sorted((r, v * scale) for r, v in draft)}
    head = [(int(k[5:-1]), v) for k, v in med.items() if k.startswith("head(")]
    if head:  # n - 1 proposals of a whole block: what its head rows cost
        out["head"] = sorted((r, v * scale) for r, v in [(block, med["draft"]), *head])
    return out


def draft_cost(table: dict, rows: int, proposals: int | None, sequences: int = 1) -> float:
    """A draft call of `sequences` blocks of `rows` rows, each asking for `proposals` (None: all of them)."""
    seconds = cost(table["draft"], sequences * rows)
    if proposals is not None and "head" in table:
        seconds -= sequences * max(0.0, cost(table["head"], rows) - cost(table["head"], proposals + 1))
    return seconds


def cost(points: list[tuple[int, float]], rows: int) -> float:
    """Seconds for `rows` rows: linear between the measured points, on along the last segment past them."""
    xs, ys = zip(*points)
    if rows <= xs[-1]:
        return float(np.interp(rows, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] + slope * (rows - xs[-1])


def install(doc: dict, t1_ms: float) -> None:
    """Pad the ONNX Runtime sessions' calls (one sequence, and batched) to the curve's cost."""
    from dflash_cli.backends.ort_batched import BatchedDraft, BatchedTarget
    from dflash_cli.backends.ort_kv_inplace import OrtInPlaceKvSession
    from dflash_cli.backends.ort_prefix import OrtPrefixSession
    from dflash_cli.exporting.names import PROPOSAL_ROWS

    table = curves(doc, t1_ms)

    def padded_to(graph: str, rows: int, started: float, proposals: int | None = None, sequences: int = 1) -> None:
        if graph in table:
            want = draft_cost(table, rows, proposals, sequences) if graph == "draft" else cost(table[graph], rows)
            time.sleep(max(0.0, want - (time.perf_counter() - started)))

    def asked(feeds) -> int | None:
        rows = feeds.get(PROPOSAL_ROWS)
        return None if rows is None else int(np.asarray(rows).shape[1])

    for cls in (OrtPrefixSession, OrtInPlaceKvSession):

        def run(self, feeds, real=cls.run):
            t = time.perf_counter()
            out = real(self, feeds)
            if self.name == "draft":
                padded_to("draft", feeds["input_ids"].shape[1], t, asked(feeds))
            else:
                padded_to(self.name, feeds["input_ids"].shape[1], t)
            return out

        cls.run = run

    for cls, graph in ((BatchedTarget, "target"), (BatchedDraft, "draft")):

        def run_batched(self, slots, feeds, real=cls.run, graph=graph):
            t = time.perf_counter()
            out = real(self, slots, feeds)
            width = max(np.asarray(f["input_ids"]).shape[1] for f in feeds)
            if graph == "draft":
                wanted = [asked(f) for f in feeds]
                most = None if None in wanted else max(wanted)
                padded_to(graph, width, t, most, len(feeds))
            else:
                padded_to(graph, len(feeds) * width, t)
            return out

        cls.run = run_batched


def own_rate() -> None:
    """Charge verify time at the request's own rate (every slot says it shares its calls with nobody)."""
    from dflash_cli.decoding.batching import SlotSession

    SlotSession.sharing = property(lambda self: 1)


def always_draft() -> None:
    from dflash_cli.decoding.verify_length import VerifyBudget

    VerifyBudget.draft_pays = lambda self, sharing: True


def main() -> None:
    args = sys.argv[1:]
    split = args.index("--")
    ours, rest = args[:split], args[split + 1 :]
    install(json.loads(Path(ours[0]).read_text()), float(ours[1]))
    if "--own-rate" in ours:
        own_rate()
    if "--always-draft" in ours:
        always_draft()
    sys.argv = ["dflash", *rest]
    from dflash_cli.cli.app import main as dflash

    dflash()


if __name__ == "__main__":
    main()
