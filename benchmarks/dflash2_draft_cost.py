"""Cost of one draft call: DFlash against DFlash2 (selector walk in the graph, or on the host from the graph's
top-k), on ONNX Runtime's CPU provider, random weights at the published shapes.

    python benchmarks/dflash2_draft_cost.py qwen3-0.6b [--calls 30] [--out F.json]

The drafts have the z-lab layout (5 Qwen3 layers, block 16, five target taps, the target's tied
embedding as lm_head) and, for DFlash2, the published DFlash2 parts (2-tap convolution in groups of 16,
selector rank 256, top 16); the fused context (the target computes fc) is its input. Graphs are the
static-cache draft graphs in fp32 at ctx_len 256, one call with 4 new context rows at position 100 (a
decode step's accepted tokens); every round times each variant once, in turn, and the medians and
ratios to DFlash are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # hidden, heads, kv heads, intermediate (the targets' model cards; drafts take the target's widths)
    "qwen3-0.6b": (1024, 16, 8, 3072),
    "qwen3-4b": (2560, 32, 8, 9728),
}
VOCAB, BLOCK, CTX, TAPS, LAYERS, START, ROWS = 151936, 16, 256, 5, 5, 100, 4


def draft_config(shape: str, v2: bool):
    from transformers import Qwen3Config

    from dflash_cli.modeling.dflash2_config import Dflash2Spec

    hidden, heads, kv, inter = SHAPES[shape]
    cfg = Qwen3Config(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=128,
        intermediate_size=inter,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
        rope_theta=1e6,
    )
    cfg.dflash2 = Dflash2Spec(taps=2, group_size=16, rank=256, top_k=16) if v2 else None
    return cfg


def build(shape: str, kind: str, out: Path, seed: int = 0) -> tuple[Path, dict]:
    from dflash_cli.exporting.torch_to_onnx import export_module
    from dflash_cli.modeling.draft import DFlashDraft, StaticCacheDraft
    from dflash_cli.modeling.layers import Rotary

    cfg = draft_config(shape, kind != "dflash")
    torch.manual_seed(seed)
    with torch.no_grad():
        draft = DFlashDraft(cfg, TAPS, VOCAB)
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("base_kernel"):  # identity on the current row, as a fresh DFlash2 layer
                p.zero_()
                p[:, 0] = 1.0
            else:
                p.normal_(0.0, 0.02)
        draft.lm_head.weight = draft.embed_tokens.weight  # tied, as Qwen3-0.6B/4B
        draft.rotary = Rotary(cfg)
    module = StaticCacheDraft(draft).eval()
    host = {}
    if kind == "dflash2-host":
        sel = draft.candidate_selector
        host = {
            "pred": sel.predecessor_codebook.detach().numpy().copy(),
            "succ": sel.successor_codebook.detach().numpy().copy(),
        }

        def propose(ids, h):
            scores, cand = torch.topk(sel.unary(draft.lm_head(h[:, 1:])), sel.top_k, dim=-1)
            return (scores, cand, sel.hidden_projection(h[:, 1:])), None

        draft.propose = propose
        module.forward = _host_forward(module)
    ins, outs = module.io_names()
    if kind == "dflash2-host":
        outs = ["scores", "candidates", "context", *outs[1:]]
    past = module.empty_cache(CTX)
    example = (
        torch.zeros(1, BLOCK, dtype=torch.long),
        torch.arange(START, START + BLOCK)[None],
        torch.zeros(1, ROWS, cfg.hidden_size),
        torch.arange(START - ROWS, START)[None],
        *past,
    )
    path = out / f"{shape}-{kind}.onnx"
    export_module(module, example, ins, outs, {"context_features": 1, "context_position_ids": 1}, path)
    return path, host


def _host_forward(module):
    plain = module.forward

    def forward(input_ids, position_ids, context_features, context_position_ids, *past):
        res = plain(input_ids, position_ids, context_features, context_position_ids, *past)
        (scores, cand, ctx), rest = res[0], res[1:]
        return (scores, cand, ctx, *rest)

    return forward


def walk(host: dict, scores, cand, ctx, anchor: int) -> list[int]:
    prev, picks = anchor, []
    for s in range(cand.shape[1]):
        state = host["pred"][prev] * ctx[0, s]
        total = scores[0, s] + host["succ"][cand[0, s]] @ state
        prev = int(cand[0, s, int(np.argmax(total))])
        picks.append(prev)
    return picks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import onnxruntime as ort

    kinds = ["dflash", "dflash2", "dflash2-host"]
    with tempfile.TemporaryDirectory() as tmp:
        sessions, hosts = {}, {}
        for kind in kinds:
            t0 = time.perf_counter()
            path, hosts[kind] = build(args.shape, kind, Path(tmp))
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            sessions[kind] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
            print(f"{kind}: built and opened in {time.perf_counter() - t0:.0f} s", flush=True)
        hidden = SHAPES[args.shape][0]
        rng = np.random.default_rng(0)
        feeds = {
            "input_ids": np.array([[7] + [151669] * (BLOCK - 1)], dtype=np.int64),
            "position_ids": np.arange(START, START + BLOCK, dtype=np.int64)[None],
            "context_features": rng.standard_normal((1, ROWS, hidden)).astype(np.float32),
            "context_position_ids": np.arange(START - ROWS, START, dtype=np.int64)[None],
        }
        kv = SHAPES[args.shape][2]
        for i in range(LAYERS):
            for n in ("key", "value"):
                feeds[f"past_{n}.{i}"] = rng.standard_normal((1, kv, CTX, 128)).astype(np.float32)
        times = {k: [] for k in kinds}
        proposals = {}
        for _ in range(args.calls + 2):
            for kind in kinds:
                t0 = time.perf_counter()
                res = sessions[kind].run(None, feeds)
                if kind == "dflash2-host":
                    proposals[kind] = walk(hosts[kind], res[0], res[1], res[2], 7)
                else:
                    proposals[kind] = res[0][0].tolist()
                times[kind].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[2:]) for k, v in times.items()}
    doc = {
        "shape": args.shape,
        "calls": args.calls,
        "median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "ratio_to_dflash": {k: round(v / med["dflash"], 3) for k, v in med.items()},
        "host_walk_equals_graph_walk": proposals["dflash2"] == proposals["dflash2-host"],
    }
    print(json.dumps(doc, indent=2))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
