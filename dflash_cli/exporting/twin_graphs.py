"""The validation twin grown from the real export's own traced layer, not traced a second time.

Large pairs are validated on a twin (validate.TwinPlan: the first layers and vocabulary rows of the
same checkpoint). The export traces each static graph as a one-layer stand-in and copies that layer
to the real depth (replicate.py); the twin is the same traced layer copied to the twin's depth, with
the twin's weights and the embedding / lm_head cut to the twin's rows. So the twin checks the very
graph the real export is made of, copying included, and costs no trace (a second trace of both
models was ~14 s of CPU on the 0.6B shape, competing with the real export on 2 cores).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_cli.exporting.external_data import WrittenTensors
from dflash_cli.exporting.torch_to_onnx import WRAPPER_PREFIX, grow_layers, lazy_weight, save_streamed

VOCAB_OUTPUTS = ("logits", "draft_logits")  # graph outputs whose last axis is the vocabulary


@dataclass
class TwinGraphs:
    """Grows `target.onnx` / `draft.onnx` of the twin into `where` as the real export traces them."""

    src: Path
    where: Path
    plan: object  # validate.TwinPlan
    logits: bool
    dtype: torch.dtype
    written: WrittenTensors = field(default_factory=WrittenTensors)  # the twin's own data files
    made: set[str] = field(default_factory=set)
    skipped: dict[str, str] = field(default_factory=dict)  # graph -> why it could not be grown
    on_made: Callable[[str], None] | None = None  # called with a graph's name once its files are written

    def hook(self, gname: str, store, rename):
        """`on_template` for finish_template of the static graph `gname`."""

        def on_template(template, by_graph_name) -> None:
            try:
                self._grow(gname, template, store, rename)
            except Exception as exc:  # noqa: BLE001 - the twin is then exported by a trace of its own
                self.skipped[gname] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

        return on_template

    def _grow(self, gname: str, template, store, rename) -> None:
        import onnx_ir as ir

        from dflash_cli.exporting.graphs import _layer_plan, _sources
        from dflash_cli.modeling.loading import build_draft, build_target

        plan = self.plan
        tcfg, dcfg = plan.configs(self.src)
        if gname == "target":
            module = build_target(self.src, self.logits, cfg=tcfg, layer_ids=plan.ids, device="meta", dtype=self.dtype)
        else:
            module = build_draft(self.src, self.logits, cfg=dcfg, vocab=plan.rows, device="meta", dtype=self.dtype)
        ins, outs = module.io_names()
        sources = _sources(module, store, rename, self.dtype, plan.rows)  # vocabulary tensors cut to the rows
        shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
        twin = template.clone()
        by_graph_name = {}
        for value in twin.graph.initializers.values():
            name = value.name.removeprefix(WRAPPER_PREFIX)
            if name not in sources:
                continue  # a constant of the graph (RoPE tables, masks): kept as traced
            shape = shapes[name]
            value.const_value = lazy_weight(sources[name], value.const_value.dtype, shape, name)
            value.shape = ir.Shape(shape)
            by_graph_name[value.name] = sources[name]
        # Shapes recorded while tracing carry the real vocabulary: drop them inside the graph (ONNX
        # Runtime infers them again) and cut the vocabulary axis of the outputs that have it.
        outputs = set(twin.graph.outputs)
        for node in twin.graph:
            for v in node.outputs:
                if v not in outputs:
                    v.shape = None
        for v in twin.graph.outputs:
            if v.name in VOCAB_OUTPUTS and v.shape is not None:
                v.shape = ir.Shape([*list(v.shape)[:-1], plan.rows])
        grow_layers(twin, _layer_plan(gname, module, ins, outs), sources, by_graph_name)
        # validation reads the twin right back: through the page cache
        save_streamed(twin, self.where / f"{gname}.onnx", by_graph_name, self.written, direct=False, digest=False)
        self.made.add(gname)
        if self.on_made is not None:
            self.on_made(gname)
