"""Train the demo DFlash draft on the target's greedy continuations (REFERENCE section 9).

Each training block is [token at anchor, MASK x (B-1)] at positions anchor..anchor+B-1; it sees
the target's fused features of positions < anchor and itself bidirectionally; position k predicts
the token at anchor+k, weighted by exp(-(k-1)/gamma). Resumable from checkpoints.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_cli.demo import checkpoint, distill
from dflash_cli.demo.data import token_stream
from dflash_cli.demo.distill import generate_continuations
from dflash_cli.demo.draft_objective import BlockObjective, position_weights
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


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
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
    data = _distill(args, tok, target, log)

    v2 = {"selector_rank": args.selector_rank, "selector_top_k": args.selector_top_k} if args.dflash2 else None
    cfg = draft_config(
        tcfg, layers=args.layers, block_size=args.block_size, layer_ids=layer_ids, mask_id=mask_id, dflash2=v2
    )
    draft = _new_draft(args, cfg, tcfg["vocab_size"], len(layer_ids), target)
    optimiser = _Optimiser.of(draft, args.lr, args.work_dir / "draft-ckpt.pt")
    objective = BlockObjective(
        target,
        draft,
        layer_ids,
        mask_id,
        args.anchors,
        position_weights(args.block_size, args.gamma),
        args.selector_alpha if args.dflash2 else None,
    )
    step, elapsed = _train(args, objective, optimiser, data, log)
    save_draft(draft, cfg, args.out)
    meta = {
        "steps": step,
        "train_seconds": round(elapsed, 1),
        **objective.evaluate(data.heldout),
        "n_seqs": args.n_seqs,
        **json.loads(data.meta_path.read_text()),
        "params_without_embeddings": sum(
            p.numel() for n, p in draft.named_parameters() if not n.startswith(("embed_tokens", "lm_head"))
        ),
    }
    if args.init_from:
        meta["continued_from"] = json.loads((args.init_from / "training.json").read_text())
    (args.out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({"done": meta}), file=log, flush=True)


def _parser() -> argparse.ArgumentParser:
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
    return ap


@dataclass(frozen=True)
class _Distilled:
    train: list[np.ndarray]  # batches of [prompt_len, prompt + continuation...] rows, one prompt length each
    heldout: list[np.ndarray]
    meta_path: Path  # distill.json: how the data was made (reported in training.json)


def _distill(args: argparse.Namespace, tok, target, log) -> _Distilled:
    """The target's greedy continuations of train and held-out corpus prompts (reloaded when already made)."""
    prompt_lens = tuple(int(x) for x in args.prompt_lens.split(","))
    train_tokens = token_stream(args.target, "train", args.work_dir, args.max_files)
    newline_ids = {i for t, i in tok.get_vocab().items() if t.endswith("Ċ")}
    held_tokens = token_stream(args.target, "heldout", args.work_dir, args.max_files)
    train_ends = held_ends = None
    if args.prompt_style == "docstring":
        texts = [tok.decode([i]) for i in range(len(tok))]
        train_ends, held_ends = (distill.docstring_ends(t, texts) for t in (train_tokens, held_tokens))
    generate = functools.partial(
        generate_continuations,
        target,
        new_tokens=args.new_tokens,
        batch_size=args.distill_batch,
        prompt_lens=prompt_lens,
        log=log,
    )
    t0 = time.time()
    train = generate(
        train_tokens,
        newline_ids,
        n_seqs=args.n_seqs,
        seed=args.seed,
        out_path=args.work_dir / "distill-train",
        ends=train_ends,
    )
    heldout = generate(
        held_tokens,
        newline_ids,
        n_seqs=args.heldout_seqs,
        seed=args.seed + 1,
        out_path=args.work_dir / "distill-heldout",
        ends=held_ends,
    )
    distill_seconds = round(time.time() - t0, 1)
    print(json.dumps({"distill_seconds": distill_seconds}), file=log, flush=True)
    meta_path = args.work_dir / "distill.json"
    if not meta_path.exists():  # the first run generated the data; a resumed one only reloads it
        meta_path.write_text(
            json.dumps(
                {"distill_seconds": distill_seconds, "prompt_lens": prompt_lens, "prompt_style": args.prompt_style}
            )
            + "\n"
        )
    return _Distilled(train, heldout, meta_path)


def _new_draft(args: argparse.Namespace, cfg: dict, vocab_size: int, n_taps: int, target) -> DFlashDraft:
    """The draft to train: seeded, optionally warm-started, sharing the target's (frozen) embedding and head."""
    from transformers import Qwen3Config

    from dflash_cli.demo.selector_loss import init_dflash2
    from dflash_cli.modeling.dflash2_config import spec_of

    hf_cfg = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "dflash_config")})
    hf_cfg.dflash2 = spec_of(cfg)
    torch.manual_seed(args.seed)
    draft = DFlashDraft(hf_cfg, n_taps, vocab_size)
    if args.dflash2:
        init_dflash2(draft)
    if args.init_from:
        load_draft_weights(draft, args.init_from)
    draft.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    draft.lm_head.weight.data.copy_(target.get_output_embeddings().weight)
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    return draft


@dataclass
class _Optimiser:
    """AdamW over the draft's trainable parameters, its gradients clipped, with a resumable checkpoint."""

    draft: DFlashDraft
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    ckpt_path: Path

    @classmethod
    def of(cls, draft: DFlashDraft, lr: float, ckpt_path: Path) -> _Optimiser:
        params = [p for p in draft.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
        return cls(draft, params, opt, ckpt_path)

    def resume(self) -> tuple[int, float]:
        return checkpoint.resume(self.ckpt_path, self.draft, self.opt)

    def step(self, loss: torch.Tensor, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()

    def save(self, step: int, elapsed: float) -> None:
        checkpoint.save_training(self.ckpt_path, self.draft, self.opt, step, elapsed)


def _train(
    args: argparse.Namespace, objective: BlockObjective, optimiser: _Optimiser, data: _Distilled, log
) -> tuple[int, float]:
    """Steps from the last checkpoint to args.steps (warm-up, then cosine decay to a tenth of the rate);
    returns (steps, training seconds)."""
    step, elapsed = optimiser.resume()
    groups = [(int(b[0, 0]), b[:, 1:]) for b in data.train]  # (prompt_len, sequences)
    objective.draft.train()
    t_last = time.time()
    while step < args.steps:
        # The batch is a pure function of (seed, step): resuming replays the exact schedule.
        rng = np.random.default_rng([args.seed, step])
        pl, seqs = groups[int(rng.integers(len(groups)))]
        rows = rng.choice(len(seqs), size=args.batch_size, replace=False)
        warm = min(1.0, (step + 1) / 100)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        loss, tau = objective.loss_and_acc(seqs[rows], pl, rng)
        optimiser.step(loss, lr)
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        if step % 10 == 0:
            rec = {"step": step, "loss": round(loss.item(), 4), "block_tau": round(tau, 3)}
            print(json.dumps({**rec, "elapsed_s": round(elapsed, 1)}), file=log, flush=True)
        if step % 50 == 0 or step == args.steps:
            optimiser.save(step, elapsed)
        if step % 250 == 0:
            print(json.dumps({"step": step, **objective.evaluate(data.heldout)}), file=log, flush=True)
            t_last = time.time()
    return step, elapsed


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
