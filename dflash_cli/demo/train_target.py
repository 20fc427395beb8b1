"""Train the demo target (a Hugging Face Qwen3ForCausalLM) from scratch on the stdlib corpus.

Resumable: run it again with the same arguments and it continues from the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from dflash_cli.demo import checkpoint
from dflash_cli.demo.data import corpus_texts, token_stream
from dflash_cli.demo.tokenizer import train_tokenizer

TARGET_CONFIG = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    use_cache=True,
)


# A few-second configuration for the smoke test of this training loop.
SMOKE_CONFIG = dict(
    TARGET_CONFIG,
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)


def build_model(vocab_size: int, eos_id: int, base: dict = TARGET_CONFIG) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = dict(base, vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    cfg.pop("model_type")
    return Qwen3ForCausalLM(Qwen3Config(**cfg))


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def next_token_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting x[:, 1:] from x[:, :-1]."""
    logits = model(input_ids=x[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


def optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, tokens: np.ndarray, seq_len: int, max_batches: int = 40) -> float:
    model.eval()
    n = (len(tokens) - 1) // seq_len
    idx = np.linspace(0, n - 1, num=min(n, max_batches * 8), dtype=np.int64)
    losses = []
    for chunk in np.array_split(idx, max(1, len(idx) // 8)):
        x = torch.from_numpy(
            np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in chunk]).astype(np.int64)
        )
        out = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())
        # labels shifted inside HF; equivalent to next-token loss on seq_len-1 positions
        losses.append(out.loss.item())
    model.train()
    return float(np.mean(losses))


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    args.work_dir.mkdir(parents=True, exist_ok=True)
    tok_dir = _tokenizer_dir(args)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    train = token_stream(tok_dir, "train", args.work_dir, args.max_files)
    held = token_stream(tok_dir, "heldout", args.work_dir, args.max_files)
    log = open(args.work_dir / f"{args.run_name}-train.log", "a")
    print(json.dumps({"train_tokens": len(train), "heldout_tokens": len(held)}), file=log, flush=True)

    torch.manual_seed(args.seed)
    if args.init_from:
        model = AutoModelForCausalLM.from_pretrained(str(args.init_from), dtype=torch.float32)
        before = json.loads((args.init_from / "training.json").read_text())
    else:
        model = build_model(len(tok), tok.eos_token_id, SMOKE_CONFIG if args.smoke else TARGET_CONFIG)
        before = None
    step, elapsed = _train(args, model, train, held, log)
    # Export in the plain Hugging Face format.
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(args.out), safe_serialization=True)
    tok.save_pretrained(str(args.out))
    # Held-out loss over (at most) 256-token windows stays comparable across runs of different --seq-len.
    hl = heldout_loss(model, held, min(256, args.seq_len), max_batches=200)
    meta = {
        "steps": step,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "train_seconds": round(elapsed, 1),
        "heldout_loss": round(hl, 4),
        "n_windows": (len(train) - 1) // args.seq_len,
        "train_tokens": int(len(train)),
        "params": sum(p.numel() for p in model.parameters()),
    }
    if before is not None:
        meta["continued_from"] = before
        meta["total_train_seconds"] = round(elapsed + before.get("total_train_seconds", before["train_seconds"]), 1)
    (args.out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({"done": meta}), file=log, flush=True)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work-dir", type=Path, default=Path(".demo-work"))
    ap.add_argument("--out", type=Path, default=Path("models/demo-target"))
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--max-files", type=int, default=0, help="only the first N corpus files (smoke tests)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, for testing this loop")
    ap.add_argument(
        "--init-from",
        type=Path,
        help="continue from this Hugging Face checkpoint (weights and tokenizer) with a fresh optimizer",
    )
    ap.add_argument("--run-name", default="target", help="names this run's checkpoint and log in --work-dir")
    return ap


def _tokenizer_dir(args: argparse.Namespace) -> Path:
    """The work dir's tokenizer: the continued checkpoint's, else one trained on the corpus (made once)."""
    from transformers import AutoTokenizer

    tok_dir = args.work_dir / "tokenizer"
    if args.init_from and not (tok_dir / "tokenizer.json").exists():
        # A continued run must keep the vocabulary its weights were trained with.
        AutoTokenizer.from_pretrained(str(args.init_from)).save_pretrained(str(tok_dir))
    if not (tok_dir / "tokenizer.json").exists():
        base = SMOKE_CONFIG if args.smoke else TARGET_CONFIG
        train_tokenizer(corpus_texts("train", args.max_files), tok_dir, vocab_size=base["vocab_size"])
    return tok_dir


def _train(
    args: argparse.Namespace, model: torch.nn.Module, train: np.ndarray, held: np.ndarray, log
) -> tuple[int, float]:
    """Steps from the last checkpoint to args.steps; returns (steps, training seconds)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    ckpt_path = args.work_dir / f"{args.run_name}-ckpt.pt"
    step, elapsed = checkpoint.resume(ckpt_path, model, opt)
    model.train()
    t_last = time.time()
    while step < args.steps:
        # The batch is a pure function of (seed, step): resuming replays the exact schedule.
        rng = np.random.default_rng([args.seed, step])
        starts = rng.integers(0, len(train) - args.seq_len - 1, size=args.batch_size)
        x = torch.from_numpy(np.stack([train[s : s + args.seq_len + 1] for s in starts]).astype(np.int64))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = next_token_loss(model, x)
        optimizer_step(model, opt, loss)
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        if step % 10 == 0:
            print(
                json.dumps({"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(elapsed, 1)}),
                file=log,
                flush=True,
            )
        if step % args.ckpt_every == 0 or step == args.steps:
            checkpoint.save_training(ckpt_path, model, opt, step, elapsed)
        if step % 400 == 0 or step == args.steps:
            hl = heldout_loss(model, held, args.seq_len)
            print(json.dumps({"step": step, "heldout_loss": round(hl, 4)}), file=log, flush=True)
            t_last = time.time()
    return step, elapsed


if __name__ == "__main__":
    main()
