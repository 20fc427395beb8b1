"""The reduced model that validates a large pair's export: its first layers and vocabulary rows.

Running the real graphs of a multi-gigabyte pair against PyTorch and Hugging Face would hold the
model several times over. The reduced model keeps the first layers of target and draft and the first
vocabulary rows of the same checkpoint, every other shape as built, so its memory does not grow with
depth or vocabulary. Its static graphs are grown from the very layer the real export traced
(replicate.py), copied to the reduced depth with the reduced weights and the embedding / lm_head cut
to the reduced rows: validation checks the graph the real export is made of, copying included, at no
second trace. They sit beside the real graphs and reference the real graphs' data files for every
tensor they share (all but the cut vocabulary tensors), so they cost no second copy of the layers. A
graph that cannot be grown that way is exported by tracing the reduced model itself into a directory
of its own (graphs.export_reduced). Validation removes every file of the reduced model.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from dflash_cli.exporting.external_data import WrittenTensors
from dflash_cli.exporting.names import WRAPPER_PREFIX
from dflash_cli.exporting.replicate import grow_layers
from dflash_cli.exporting.torch_to_onnx import lazy_weight, save_streamed

# Three layers: the export grows graphs from one traced layer, and three check a copy reading a copy.
LAYERS = 3
VOCAB = 4096  # vocabulary rows kept; hidden size, heads, ctx_len and block stay as built
EXPERTS = 8  # a mixture-of-experts layer's experts kept (the first ones; at least as many as a token chooses)
VOCAB_OUTPUTS = ("logits", "draft_logits")  # graph outputs whose last axis is the vocabulary
GRAPHS = ("target", "draft")  # the static graphs validation runs, in this order
PREFIX = "_reduced_"  # file names of the grown graphs beside the real ones
TRACED_DIR = "_reduced_model"  # where the reduced model traced itself goes


@dataclass(frozen=True)
class ReducedPlan:
    layers: int
    draft_layers: int
    rows: int
    ids: list[int]

    @classmethod
    def of(cls, src: Path, pair: dict) -> ReducedPlan:
        from dflash_cli.families import family_for
        from dflash_cli.modeling.loading import draft_config, target_config

        cfg = target_config(src)
        depth = cfg.num_hidden_layers
        # A hybrid target's first layers may all be linear attention: keep its first full-attention layer too.
        # (Gemma 4's first global layer is its sixth, each as wide as a 1B model: its reduced model keeps the
        # first three, window layers; the tiny pairs' tests check the global layers against Hugging Face.)
        kinds = list(getattr(cfg, "layer_types", None) or [])
        hybrid = family_for(cfg.model_type).hybrid
        first_full = kinds.index("full_attention") if hybrid and "full_attention" in kinds else 0
        layers = min(depth, max(LAYERS, first_full + 1))
        # A tap of the last layer reads the final norm's output, any other a layer's own output: the
        # reduced model keeps that distinction (its last layer for the former, the ones before for the rest).
        return cls(
            layers=layers,
            draft_layers=min(draft_config(src).num_hidden_layers, LAYERS),
            rows=min(pair["vocab_size"], VOCAB),
            ids=[layers - 1 if i == depth - 1 else min(i, max(layers - 2, 0)) for i in pair["target_layer_ids"]],
        )

    def configs(self, src: Path):
        from dflash_cli.modeling.loading import draft_config, target_config
        from dflash_cli.modeling.moe import num_experts

        target = target_config(src, num_hidden_layers=self.layers, vocab_size=self.rows)
        if getattr(target, "layer_types", None):  # the kinds of the layers kept (Hugging Face checks them)
            target.layer_types = list(target.layer_types)[: self.layers]
        if (getattr(target, "pad_token_id", None) or 0) >= self.rows:  # gpt-oss pads with a token past the cut
            target.pad_token_id = None
        if num_experts(target):  # experts are most of a MoE layer's bytes
            target.num_experts = min(num_experts(target), max(EXPERTS, target.num_experts_per_tok))
        return target, draft_config(src, num_hidden_layers=self.draft_layers)

    def fp32_bytes(self, src: Path) -> int:
        """float32 bytes of the larger of the reduced target's and draft's tensors (layers, cut vocabulary, fc):
        validation checks one graph at a time."""
        import re

        from dflash_cli.checkpoints.weights import WeightStore

        largest = 0
        for role, prefix, depth in (("target", "model.layers.", self.layers), ("draft", "layers.", self.draft_layers)):
            store, total = WeightStore.open(src / role), 0
            for name in store.names():
                shape = list(store.shape(name))
                m = re.match(re.escape(prefix) + r"(\d+)\.", name)
                if m and int(m.group(1)) >= depth:
                    continue
                if shape and ("embed_tokens" in name or name.startswith("lm_head")):
                    shape[0] = min(shape[0], self.rows)
                n = 4
                for d in shape:
                    n *= d
                total += n
            largest = max(largest, total)
        return largest

    def describe(self) -> str:
        return (
            f"reduced model: {self.layers} target / {self.draft_layers} draft layers, {self.rows} vocabulary rows, "
            f"at most {EXPERTS} experts a layer, all other shapes as built"
        )


@dataclass
class ReducedGraphs:
    """Grows the reduced model's static graphs into `out` (PREFIX + target.onnx, ...) as the real export
    writes its own there."""

    src: Path
    out: Path
    plan: ReducedPlan
    options: object  # options.ExportOptions
    made: set[str] = field(default_factory=set)
    skipped: dict[str, str] = field(default_factory=dict)  # graph -> why it could not be grown

    def path(self, gname: str) -> Path:
        return self.out / f"{PREFIX}{gname}.onnx"

    def grow(self, gname: str, template, store, rename, written: WrittenTensors) -> None:
        """Write the reduced `gname` graph from the real export's one-layer `template` (taken over);
        tensors in `written` (the real graphs' data files) are referenced, not written again. On any
        failure, note why (validation then traces the reduced model itself)."""
        try:
            self._grow(gname, template, store, rename, written)
        except Exception as exc:  # noqa: BLE001 - the reduced model is then exported by a trace of its own
            self.skipped[gname] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    def remove(self) -> None:
        """Every file of the reduced model: none may be published with the export."""
        shutil.rmtree(self.out / TRACED_DIR, ignore_errors=True)
        for path in self.out.glob(f"{PREFIX}*"):
            path.unlink()

    def _grow(self, gname: str, template, store, rename, written: WrittenTensors) -> None:
        import onnx_ir as ir

        from dflash_cli.exporting.graphs import layer_plan, weight_initializers
        from dflash_cli.modeling.loading import build_draft, build_target

        plan, logits, dtype = self.plan, self.options.logits, self.options.torch_dtype
        tcfg, dcfg = plan.configs(self.src)
        if gname == "target":
            module = build_target(self.src, logits, cfg=tcfg, layer_ids=plan.ids, device="meta", dtype=dtype)
        else:
            module = build_draft(self.src, logits, cfg=dcfg, vocab=plan.rows, device="meta", dtype=dtype)
        sources = weight_initializers(module, store, rename, dtype, plan.rows)  # vocabulary tensors cut to the rows
        shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
        reduced = template
        by_graph_name = {}
        for value in reduced.graph.initializers.values():
            name = value.name.removeprefix(WRAPPER_PREFIX)
            if name not in sources:
                continue  # a constant of the graph (RoPE tables, masks): kept as traced
            shape = shapes[name]
            value.const_value = lazy_weight(sources[name], value.const_value.dtype, shape, name)
            value.shape = ir.Shape(shape)
            by_graph_name[value.name] = sources[name]
        # Shapes recorded while tracing carry the real vocabulary: drop them inside the graph (ONNX
        # Runtime infers them again) and cut the vocabulary axis of the outputs that have it.
        outputs = set(reduced.graph.outputs)
        for node in reduced.graph:
            for v in node.outputs:
                if v not in outputs:
                    v.shape = None
        for v in reduced.graph.outputs:
            if v.name in VOCAB_OUTPUTS and v.shape is not None:
                v.shape = ir.Shape([*list(v.shape)[:-1], plan.rows])
        grow_layers(reduced, layer_plan(gname, module), sources, by_graph_name)
        save_streamed(reduced, self.path(gname), by_graph_name, written, digest=False)
        self.made.add(gname)
