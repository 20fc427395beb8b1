"""Trace the export's graphs in a forked process while convert and inject run.

Tracing needs no weights, only the configs and pair.json the export builds its meta-device modules
from, and convert can say what those will be from the checkpoints' config files and headers alone.
So when a build will export, the pipeline starts this tracer before convert: the child imports
torch and the exporter and traces all four graphs on the second core while this process hashes,
links and imports on the first. A build of the 0.6B-shaped pair otherwise spent its first ~6 s on
one core and started writing weights only then.

The export uses the templates only when the configs, pair and settings it sees are exactly those
traced (`worker_for`); otherwise, and whatever happens to the child, it traces the graphs itself
(trace_worker.py), so the graphs never depend on this. Nothing here imports torch: the fork happens
before this process has.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dflash_cli.checkpoints import CONFIG_FILE
from dflash_cli.pair import PAIR_FILE
from dflash_cli.stages.convert import DRAFT_DIR, TARGET_DIR, describe, write_configs

CONFIGS = (f"{TARGET_DIR}/{CONFIG_FILE}", f"{DRAFT_DIR}/{CONFIG_FILE}")
UNTRACED_PAIR_FIELDS = ("fc_scale",)  # set by inject; scales weights, not the graph


class EarlyTrace:
    """A forked tracer working from a config-only copy of the pair; `close()` ends it."""

    def __init__(self, skeleton: Path, signature: dict[str, Any], worker) -> None:
        self.skeleton, self.signature, self._worker = skeleton, signature, worker

    @classmethod
    def start(cls, recipe: Any) -> EarlyTrace | None:
        """The tracer for `recipe`'s export, or None where there is nothing to trace ahead."""
        from dflash_cli.exporting import trace_worker

        e = recipe.export
        if e.exporter != "dynamo" or not trace_worker.usable():
            return None
        described = describe(recipe)  # an unusable pair raises here; convert reports it properly
        pair = described.pair
        B, P, C = pair.block_size, e.prefill_seq_len, e.ctx_len
        if P % B or C < P + 2 * B:
            return None  # the export stage refuses these shapes with its own message
        skeleton = Path(tempfile.mkdtemp(prefix="dflash-early-trace-"))
        try:
            write_configs(skeleton, described)
            shape = (B, P, C, pair.hidden_size)
            settings = {"dtype": e.dtype, "logits": e.logits, "opset": e.opset, "prefix_graphs": True}
            signature = _signature(skeleton, shape, settings)
            worker = trace_worker.TraceWorker(setup=lambda: _setup(skeleton, shape, settings), quiet=True)
        except BaseException:
            shutil.rmtree(skeleton, ignore_errors=True)
            raise
        return cls(skeleton, signature, worker)

    def worker_for(self, src: Path, shape, dtype, logits: bool, opset: int, prefix_graphs: bool):
        """The tracer's TraceWorker (job i = export_pair's job i) if it traced exactly what the export
        of `src` with these settings needs; else None, and the tracer is ended."""
        from dflash_cli.exporting.graphs import DTYPES

        dtype_name = next((k for k, v in DTYPES.items() if v == dtype), str(dtype))
        settings = {"dtype": dtype_name, "logits": logits, "opset": opset, "prefix_graphs": prefix_graphs}
        shape = (shape.block, shape.prefill, shape.ctx_len, shape.hidden)
        try:
            same = _signature(src, shape, settings) == self.signature
        except (OSError, ValueError):
            same = False
        worker, self._worker = self._worker, None
        if not same and worker is not None:
            worker.close()
            worker = None
        return worker

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        shutil.rmtree(self.skeleton, ignore_errors=True)


def _signature(root: Path, shape: tuple, settings: dict[str, Any]) -> dict[str, Any]:
    """Everything the traced graphs depend on: config files, pair.json (less inject's weight scale),
    the export's shapes and settings."""
    pair = json.loads((root / PAIR_FILE).read_text(encoding="utf-8"))
    for field in UNTRACED_PAIR_FIELDS:
        pair.pop(field, None)
    configs = {name: (root / name).read_text(encoding="utf-8") for name in CONFIGS}
    return {"configs": configs, "pair": pair, "shape": list(shape), **settings}


def _setup(skeleton: Path, shape: tuple, settings: dict[str, Any]):
    """In the child: the export's jobs, planned from the config-only copy, and how to trace one."""
    from dflash_cli.exporting import graphs
    from dflash_cli.exporting.torch_to_onnx import warm_up

    dtype, opset = graphs.DTYPES[settings["dtype"]], settings["opset"]
    warm_up(opset)
    pshape = graphs.PairShape(*shape)
    jobs = graphs.plan_jobs(
        skeleton,
        pshape,
        dtype=dtype,
        logits=settings["logits"],
        prefix_graphs=settings["prefix_graphs"],
        weights=False,
    )
    return jobs, lambda job: graphs._trace(job, pshape, dtype, opset)
