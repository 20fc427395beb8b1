"""Train the demo DFlash draft on the target's greedy continuations (REFERENCE section 9).

Each training block is [token at anchor, MASK x (B-1)] at positions anchor..anchor+B-1; it sees
the target's fused features of positions < anchor and itself bidirectionally; position k predicts
the token at anchor+k, weighted by exp(-(k-1)/gamma). Resumable from checkpoints.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from dflash_cli.demo import checkpoint, distill
from dflash_cli.demo.data import token_stream
from dflash_cli.demo.distill import generate_continuations
from dflash_cli.modeling.draft import DFlashDraft


def draft_config(
    target_cfg: dict, *, layers: int, block_size: int, layer_ids: list[int], mask_id: int, dflash2: dict | None = None
) -> dict:
    keep = [
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "rms_norm_eps",
        "rope_parameters",
        "max_position_embeddings",
        "vocab_size",
        "hidden_act",
    ]
    cfg = {k: target_cfg[k] for k in keep if k in target_cfg}
    cfg.update(
        model_type="qwen3",
        architectures=["DFlashDraftModel"],
        num_hidden_layers=layers,
        block_size=block_size,
        num_target_layers=target_cfg["num_hidden_layers"],
        dflash_config={"mask_token_id": mask_id, "target_layer_ids": layer_ids},
        tie_word_embeddings=False,
        attention_bias=False,
        torch_dtype="float32",
        rope_theta=target_cfg.get("rope_parameters", {}).get("rope_theta", 10000.0),
    )
    if dflash2:  # a DFlash2 draft: the published convolution, the selector at the given rank and top-k
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["dflash_config"] |= {"conv_kernel_size": 2, "conv_group_size": 16, **dflash2}
    return cfg


def block_batch(seqs: list[np.ndarray], prompt_lens: list[int], n_anchors: int, block: int, mask_id: int, rng):
    """Anchors in the generated region; returns ids, positions, labels and the visibility mask."""
    L = len(seqs[0])
    ids, pos, labels, anchors_all = [], [], [], []
    for seq, pl in zip(seqs, prompt_lens):
        anchors = np.sort(rng.choice(np.arange(pl - 1, L - block + 1), size=n_anchors, replace=False))
        anchors_all.append(anchors)
        b_ids = np.full((n_anchors, block), mask_id, dtype=np.int64)
        b_ids[:, 0] = seq[anchors]
        ids.append(b_ids.reshape(-1))
        pos.append((anchors[:, None] + np.arange(block)[None]).reshape(-1))
        labels.append(seq[anchors[:, None] + np.arange(block)[None]].reshape(-1))
    ids, pos, labels = (torch.from_numpy(np.stack(x).astype(np.int64)) for x in (ids, pos, labels))
    anchors = torch.from_numpy(np.stack(anchors_all))  # [b, K]
    nq = n_anchors * block
    q_anchor = anchors.repeat_interleave(block, dim=1)  # [b, nq]
    ctx_visible = torch.arange(L)[None, None, :] < q_anchor[:, :, None]  # [b, nq, L]
    blk = torch.arange(nq) // block
    block_visible = (blk[:, None] == blk[None, :])[None].expand(len(seqs), -1, -1)
    visible = torch.cat([ctx_visible, block_visible], dim=-1)[:, None]
    return ids, pos, labels, visible


def position_weights(block: int, gamma: float) -> torch.Tensor:
    k = torch.arange(block, dtype=torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / gamma)
    w[0] = 0.0  # position 0 is the given anchor token, not a prediction
    return w


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work-dir", type=Path, default=Path(".demo-work"))
    ap.add_argument("--target", type=Path, default=Path("models/demo-target"))
    ap.add_argument("--out", type=Path, default=Path("models/demo-draft"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--layer-ids", default="1,3,5")
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--n-seqs", type=int, default=10240)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--max-files", type=int, default=0, help="only the first N corpus files (smoke tests)")
    ap.add_argument("--heldout-seqs", type=int, default=128)
    ap.add_argument("--distill-batch", type=int, default=128, help="sequences generated per batch")
    ap.add_argument(
        "--prompt-lens", default="16,32,48,64,96", help="corpus prompt lengths (tokens) the continuations start from"
    )
    ap.add_argument(
        "--prompt-style",
        choices=["newline", "docstring"],
        default="newline",
        help="where corpus prompts end: any line end, or a line that closes a docstring (HumanEval-like)",
    )
    ap.add_argument(
        "--init-from", type=Path, help="start from this z-lab-format draft (e.g. one trained for an earlier target)"
    )
    ap.add_argument("--dflash2", action="store_true", help="a DFlash2 draft (block convolution, candidate selector)")
    ap.add_argument("--selector-rank", type=int, default=64)
    ap.add_argument("--selector-top-k", type=int, default=16)
    ap.add_argument("--selector-alpha", type=float, default=1.0, help="weight of the selector's loss")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args.work_dir.mkdir(parents=True, exist_ok=True)
    log = open(args.work_dir / "draft-train.log", "a")
    tok = AutoTokenizer.from_pretrained(str(args.target))
    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32)
    target.eval().requires_grad_(False)
    tcfg = json.loads((args.target / "config.json").read_text())
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    layer_ids = [int(x) for x in args.layer_ids.split(",")]
    prompt_lens = tuple(int(x) for x in args.prompt_lens.split(","))

    train_tokens = token_stream(args.target, "train", args.work_dir, args.max_files)
    newline_ids = {i for t, i in tok.get_vocab().items() if t.endswith("Ċ")}
    held_tokens = token_stream(args.target, "heldout", args.work_dir, args.max_files)
    train_ends = held_ends = None
    if args.prompt_style == "docstring":
        texts = [tok.decode([i]) for i in range(len(tok))]
        train_ends, held_ends = (distill.docstring_ends(t, texts) for t in (train_tokens, held_tokens))
    t0 = time.time()
    train_batches = generate_continuations(
        target,
        train_tokens,
        newline_ids,
        n_seqs=args.n_seqs,
        new_tokens=args.new_tokens,
        seed=args.seed,
        out_path=args.work_dir / "distill-train",
        batch_size=args.distill_batch,
        prompt_lens=prompt_lens,
        ends=train_ends,
        log=log,
    )
    held_batches = generate_continuations(
        target,
        held_tokens,
        newline_ids,
        n_seqs=args.heldout_seqs,
        new_tokens=args.new_tokens,
        seed=args.seed + 1,
        out_path=args.work_dir / "distill-heldout",
        batch_size=args.distill_batch,
        prompt_lens=prompt_lens,
        ends=held_ends,
        log=log,
    )
    distill_seconds = round(time.time() - t0, 1)
    print(json.dumps({"distill_seconds": distill_seconds}), file=log, flush=True)
    distill_meta = args.work_dir / "distill.json"
    if not distill_meta.exists():  # the first run generated the data; a resumed one only reloads it
        distill_meta.write_text(
            json.dumps(
                {"distill_seconds": distill_seconds, "prompt_lens": prompt_lens, "prompt_style": args.prompt_style}
            )
            + "\n"
        )

    v2 = {"selector_rank": args.selector_rank, "selector_top_k": args.selector_top_k} if args.dflash2 else None
    cfg = draft_config(
        tcfg, layers=args.layers, block_size=args.block_size, layer_ids=layer_ids, mask_id=mask_id, dflash2=v2
    )
    from transformers import Qwen3Config

    from dflash_cli.demo.selector_loss import init_dflash2, selector_loss, walked
    from dflash_cli.modeling.dflash2_config import spec_of

    hf_cfg = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "dflash_config")})
    hf_cfg.dflash2 = spec_of(cfg)
    torch.manual_seed(args.seed)
    draft = DFlashDraft(hf_cfg, len(layer_ids), tcfg["vocab_size"])
    if args.dflash2:
        init_dflash2(draft)
    if args.init_from:
        load_draft_weights(draft, args.init_from)
    draft.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    draft.lm_head.weight.data.copy_(target.get_output_embeddings().weight)
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    ckpt_path = args.work_dir / "draft-ckpt.pt"
    step, elapsed = checkpoint.resume(ckpt_path, draft, opt)

    groups = [(int(b[0, 0]), b[:, 1:]) for b in train_batches]  # (prompt_len, sequences)
    weights = position_weights(args.block_size, args.gamma)

    def features(x: torch.Tensor) -> torch.Tensor:
        hs = target(input_ids=x, output_hidden_states=True).hidden_states
        return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)

    def loss_and_acc(seqs: np.ndarray, pl: int, rng, train: bool):
        x = torch.from_numpy(seqs.astype(np.int64))
        with torch.no_grad():
            feats = features(x)
        ids, pos, labels, visible = block_batch(
            list(seqs), [pl] * len(seqs), args.anchors, args.block_size, mask_id, rng
        )
        ctx_pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        fused = draft.fuse(feats)
        hidden = draft.hidden_states(ids, pos, draft.context_kv(fused, ctx_pos), visible)
        logits = draft.lm_head(hidden)
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none"
        )
        w = weights.repeat(ids.shape[1] // args.block_size)[None].expand_as(ids).reshape(-1)
        loss = (ce * w).sum() / w.sum()
        B = args.block_size
        if args.dflash2:  # the selector's own loss, and its walk is what a verify step sees
            sel = draft.candidate_selector
            loss = loss + args.selector_alpha * selector_loss(sel, hidden, logits, labels, B, weights)
            with torch.no_grad():
                proposed = walked(sel, hidden, logits, labels, B).reshape(-1, B - 1)
            hit = proposed == labels.reshape(-1, B)[:, 1:]
        else:
            hit = (logits.argmax(-1) == labels).reshape(-1, B)[:, 1:]
        accept = torch.cumprod(hit.int(), dim=1).sum(1).float() + 1  # tokens a verify step would commit
        return loss, accept.mean().item()

    def evaluate() -> dict:
        draft.eval()
        rng = np.random.default_rng(123)
        losses, taus = [], []
        with torch.no_grad():
            for b in held_batches:
                loss, tau = loss_and_acc(b[:, 1:], int(b[0, 0]), rng, False)
                losses.append(loss.item())
                taus.append(tau)
        draft.train()
        return {"heldout_loss": round(float(np.mean(losses)), 4), "heldout_block_tau": round(float(np.mean(taus)), 3)}

    draft.train()
    t_last = time.time()
    while step < args.steps:
        rng = np.random.default_rng([args.seed, step])
        pl, seqs = groups[int(rng.integers(len(groups)))]
        rows = rng.choice(len(seqs), size=args.batch_size, replace=False)
        warm = min(1.0, (step + 1) / 100)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, tau = loss_and_acc(seqs[rows], pl, rng, True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        if step % 10 == 0:
            print(
                json.dumps(
                    {
                        "step": step,
                        "loss": round(loss.item(), 4),
                        "block_tau": round(tau, 3),
                        "elapsed_s": round(elapsed, 1),
                    }
                ),
                file=log,
                flush=True,
            )
        if step % 50 == 0 or step == args.steps:
            checkpoint.save_training(ckpt_path, draft, opt, step, elapsed)
        if step % 250 == 0:
            print(json.dumps({"step": step, **evaluate()}), file=log, flush=True)
            t_last = time.time()
    save_draft(draft, cfg, args.out)
    meta = {
        "steps": step,
        "train_seconds": round(elapsed, 1),
        **evaluate(),
        "n_seqs": args.n_seqs,
        **json.loads(distill_meta.read_text()),
        "params_without_embeddings": sum(
            p.numel() for n, p in draft.named_parameters() if not n.startswith(("embed_tokens", "lm_head"))
        ),
    }
    if args.init_from:
        meta["continued_from"] = json.loads((args.init_from / "training.json").read_text())
    (args.out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({"done": meta}), file=log, flush=True)


def load_draft_weights(draft: DFlashDraft, path: Path) -> None:
    """Warm start from a saved draft; embed_tokens / lm_head always come from the current target."""
    from safetensors.torch import load_file

    missing, unexpected = draft.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens", "lm_head", "rotary"))]
    if missing or unexpected:
        raise SystemExit(f"--init-from {path}: not a draft of this shape (missing {missing}, unexpected {unexpected})")


def save_draft(draft: DFlashDraft, cfg: dict, out: Path) -> None:
    """z-lab layout: no `model.` prefix, no embed_tokens / lm_head (they come from the target)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {
        k: v.detach().contiguous()
        for k, v in draft.state_dict().items()
        if not k.startswith(("embed_tokens", "lm_head", "rotary"))
    }
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


if __name__ == "__main__":
    main()
