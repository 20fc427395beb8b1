"""export stage: the injected pair -> target.onnx + draft.onnx (only `seq_len` symbolic), validated."""

from __future__ import annotations

import json
import shutil
from typing import Any

from dflash_cli.errors import ExportValidationError, RecipeError
from dflash_cli.stages.base import StageContext


class ExportStage:
    name = "export"
    version = 1
    upstream = ("inject",)

    def key_fields(self, recipe: Any) -> dict[str, Any]:
        e = recipe.export
        return {
            "ctx_len": e.ctx_len,
            "prefill_seq_len": e.prefill_seq_len,
            "opset": e.opset,
            "exporter": e.exporter,
            "logits": e.logits,
            "validate": e.validate_outputs,
        }

    def run(self, ctx: StageContext) -> dict[str, Any]:
        import numpy as np

        from dflash_cli.exporting.torch_to_onnx import export_module
        from dflash_cli.exporting.validate import compare_graph, target_vs_hf
        from dflash_cli.modeling.draft import StaticCacheDraft
        from dflash_cli.modeling.loading import load_draft, load_pair_info, load_target

        e = ctx.recipe.export
        src = ctx.inputs["inject"]
        pair = load_pair_info(src)
        B, P, C = pair["block_size"], e.prefill_seq_len, e.ctx_len
        if P % B:
            raise RecipeError(
                f"export.prefill_seq_len ({P}) must be a multiple of the block size ({B})",
                hint=f"--set export.prefill_seq_len={max(B, P // B * B)}",
            )
        if C < P + 2 * B:
            raise RecipeError(
                f"export.ctx_len ({C}) is too small for prefill {P} and block {B}",
                hint=f"--set export.ctx_len={P + 2 * B + 64}",
            )
        out = ctx.out_dir
        ctx.progress("loading the injected target and draft")
        target = load_target(src, emit_logits=e.logits)
        draft = StaticCacheDraft(load_draft(src), emit_logits=e.logits).eval()
        graphs = {}
        for gname, module, sym in (
            ("target", target, {"input_ids": 1, "position_ids": 1}),
            ("draft", draft, {"context_features": 1, "context_position_ids": 1}),
        ):
            ctx.progress(f"exporting {gname}.onnx ({e.exporter}, opset {e.opset})")
            ins, outs = module.io_names()
            example = _example_inputs(gname, module, B, P, C, pair["hidden_size"])
            export_module(module, example, ins, outs, sym, out / f"{gname}.onnx", opset=e.opset, exporter=e.exporter)
            spec = module.spec if gname == "target" else None
            graphs[gname] = {
                "onnx": f"{gname}.onnx",
                "inputs": ins,
                "outputs": outs,
                "num_layers": spec.num_layers if spec else len(module.draft.layers),
                "num_kv_heads": spec.kv_heads if spec else module.draft.kv_heads,
                "head_dim": spec.head_dim if spec else module.draft.head_dim,
                "seq_lens": {"prefill": P, "verify": B, "decode": 1}
                if gname == "target"
                else {"prefill": P, "decode": B},
            }
        checks = []
        if e.validate_outputs:
            ctx.progress("validating ONNX outputs against PyTorch")
            rng = np.random.default_rng(0)
            checks += compare_graph("target", out / "target.onnx", target, _target_calls(rng, pair, B, P), C)
            checks += compare_graph("draft", out / "draft.onnx", draft, _draft_calls(rng, pair, B, P), C)
            prompt = rng.integers(0, pair["vocab_size"], size=(1, min(P, 32)), dtype=np.int64)
            checks += target_vs_hf(src / "target", target, prompt, C)
            for c in checks:
                ctx.progress(c.line())
            (out / "validation.json").write_text(json.dumps([c.to_dict() for c in checks], indent=2) + "\n")
            bad = [c for c in checks if not c.ok]
            if bad:
                raise ExportValidationError(
                    f"export validation failed: {bad[0].graph} {bad[0].output} ({bad[0].call}) differs by "
                    f"{bad[0].max_diff:.3g} > {bad[0].tolerance:.3g} ({len(bad)} outputs over tolerance)",
                    hint="see validation.json in the export artifact; try `--set export.exporter=torchscript`",
                )
        for f in ("pair.json",):
            shutil.copy2(src / f, out / f)
        info = {"block_size": B, "ctx_len": C, "prefill_seq_len": P, "logits": e.logits, "graphs": graphs}
        (out / "export.json").write_text(json.dumps(info, indent=2) + "\n")
        return {"validated_outputs": len(checks)}


def _example_inputs(gname: str, module, B: int, P: int, C: int, H: int) -> tuple:
    import torch

    past = module.empty_cache(C)
    if gname == "target":
        return (torch.zeros(1, B, dtype=torch.long), torch.arange(B)[None], *past)
    return (
        torch.zeros(1, B, dtype=torch.long),
        torch.arange(P, P + B)[None],
        torch.zeros(1, P, H),
        torch.arange(P)[None],
        *past,
    )


def _positions(start: int, n_real: int, length: int):
    import numpy as np

    pos = np.full((1, length), -1, dtype=np.int64)
    pos[0, :n_real] = np.arange(start, start + n_real)
    return pos


def _target_calls(rng, pair: dict, B: int, P: int) -> list[tuple[str, dict]]:
    """A padded prefill chunk, then a verify block after it (exercises padding and cache reuse)."""
    V = pair["vocab_size"]
    n = P - 2
    ids = rng.integers(0, V, size=(1, P), dtype="int64")
    block = rng.integers(0, V, size=(1, B), dtype="int64")
    return [
        ("prefill(padded)", {"input_ids": ids, "position_ids": _positions(0, n, P)}),
        ("verify", {"input_ids": block, "position_ids": _positions(n, B, B)}),
    ]


def _draft_calls(rng, pair: dict, B: int, P: int) -> list[tuple[str, dict]]:
    import numpy as np

    H, mask = pair["hidden_size"], pair["mask_token_id"]
    n = P - 2
    block = np.full((1, B), mask, dtype=np.int64)
    block[0, 0] = 1
    first = {
        "input_ids": block,
        "position_ids": _positions(n, B, B),
        "context_features": rng.standard_normal((1, P, H)).astype(np.float32),
        "context_position_ids": _positions(0, n, P),
    }
    second = {
        "input_ids": block,
        "position_ids": _positions(n + min(3, B), B, B),
        "context_features": rng.standard_normal((1, B, H)).astype(np.float32),
        "context_position_ids": _positions(n, min(3, B), B),
    }
    return [("context(prefill)", first), ("context(block)", second)]


STAGE = ExportStage()
