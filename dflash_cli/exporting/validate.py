"""Export validation: every ONNX output against the PyTorch module, and the target against Hugging Face.

One row per (graph, call, output) with the max difference and its tolerance; any row over
tolerance fails the stage (the caller raises), never just a warning.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

RTOL = 1e-3  # relative to the reference's largest magnitude; fp32 kernels differ in summation order


@dataclass(frozen=True)
class Check:
    graph: str
    call: str
    output: str
    max_diff: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_diff <= self.tolerance

    def line(self) -> str:
        mark = "ok" if self.ok else "FAIL"
        head = f"{self.graph:6s} {self.call:18s} {self.output:32s}"
        return f"{head} max|diff| {self.max_diff:.3g} (tol {self.tolerance:.3g}) {mark}"

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def _diff(name: str, got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    if np.issubdtype(ref.dtype, np.integer):
        # Token ids: the fraction of positions that disagree must be zero.
        return float(np.mean(got != ref)), 0.0
    return float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64)))), RTOL * max(
        1.0, float(np.abs(ref).max())
    )


def compare_graph(
    graph: str, onnx_path: Path, module: torch.nn.Module, calls: list[tuple[str, dict]], ctx_len: int
) -> list[Check]:
    """Run the same sequence of calls through ONNX Runtime and the module, threading each one's cache."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(onnx_path), sess_options=opts, providers=["CPUExecutionProvider"])
    in_names, out_names = module.io_names()
    cache_names = [n for n in in_names if n.startswith("past_")]
    past = [t.numpy() for t in module.empty_cache(ctx_len)]
    checks = []
    for label, feeds in calls:
        args = [torch.from_numpy(feeds[n]) for n in in_names if n not in cache_names]
        with torch.no_grad():
            ref = [t.numpy() for t in module(*args, *[torch.from_numpy(p) for p in past])]
        got = sess.run(None, {**feeds, **dict(zip(cache_names, past))})
        for name, g, r in zip(out_names, got, ref):
            d, tol = _diff(name, g, r)
            checks.append(Check(graph, label, name, d, tol))
        past = ref[len(out_names) - len(cache_names) :]
    return checks


def target_vs_hf(target_dir: Path, module, prompt: np.ndarray, ctx_len: int) -> list[Check]:
    """Our static-cache target against the plain Hugging Face forward on one prompt (logits' argmax and the
    fused features recomputed from HF hidden_states[i + 1])."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    ids = torch.from_numpy(prompt)
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in module.layer_ids], dim=-1)
        fused = module.dflash.hidden_norm(module.dflash.fc(feats))
        ours = module(ids, pos, *module.empty_cache(ctx_len))
    tokens, context = ours[0], ours[2 if module.emit_logits else 1]
    checks = [Check("target", "vs-huggingface", "tokens", float((tokens != out.logits.argmax(-1)).float().mean()), 0.0)]
    d, tol = _diff("context_features", context.numpy(), fused.numpy())
    checks.append(Check("target", "vs-huggingface", "context_features", d, tol))
    if module.emit_logits:
        d, tol = _diff("logits", ours[1].numpy(), out.logits.numpy())
        checks.append(Check("target", "vs-huggingface", "logits", d, tol))
    return checks
