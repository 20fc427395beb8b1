"""Fine-tune the demo target so its greedy output loops less (sequence-level unlikelihood).

A few-million-parameter target trained on 9M tokens falls into greedy loops on most prompts, and a
looping target makes any speculative demo misleading: prompt lookup copies the loop for free. This
is the sequence-level unlikelihood objective of Welleck et al. 2019 ("Neural text degeneration
with unlikelihood training"): the model decodes its own greedy continuation of corpus prompts, and
every token that belongs to an n-gram already produced earlier in that continuation gets the loss
-log(1 - p(token)). Each step also takes a plain next-token (MLE) step on corpus windows, so the
model keeps its language modelling; held-out loss is reported before and after.

Resumable like the other trainers: run it again with the same arguments and it continues.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_cli.demo import checkpoint, distill
from dflash_cli.demo.data import token_stream
from dflash_cli.demo.train_target import heldout_loss, next_token_loss, optimizer_step


def repeated_ngram_mask(seq: np.ndarray, start: int, n: int) -> np.ndarray:
    """True for tokens at positions >= `start` that are part of an n-gram seen earlier at or after `start`.

    Only n-grams inside the continuation (from `start` on) count: copying a name from the prompt is
    fine, the model repeating its own output is what loops look like.
    """
    mask = np.zeros(len(seq), dtype=bool)
    seen: set[tuple[int, ...]] = set()
    for end in range(start + n, len(seq) + 1):
        gram = tuple(int(t) for t in seq[end - n : end])
        if gram in seen:
            mask[end - n : end] = True
        else:
            seen.add(gram)
    return mask


def repetition_rate(seq: np.ndarray, start: int, n: int = 8) -> float:
    """Fraction of the continuation's n-grams that already occurred earlier in the whole text."""
    grams = [tuple(int(t) for t in seq[e - n : e]) for e in range(n, len(seq) + 1)]
    seen = set(grams[: max(0, start - n + 1)])
    hits = total = 0
    for g in grams[max(0, start - n + 1) :]:
        total += 1
        hits += g in seen
        seen.add(g)
    return hits / total if total else 0.0


def unlikelihood_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of -log(1 - p(target)) over masked positions (0 when nothing is masked)."""
    if not bool(mask.any()):
        return logits.sum() * 0.0
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    one_minus = torch.clamp(1.0 - logp.exp(), min=1e-5)
    return -(torch.log(one_minus) * mask).sum() / mask.sum()


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    args.work_dir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(args.init_from))
    prompts = _Prompts.of(args, tok)
    log = open(args.work_dir / "ul-train.log", "a")

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(str(args.init_from), dtype=torch.float32)
    before = json.loads((args.init_from / "training.json").read_text())
    eval_len = min(256, args.seq_len)  # the windows train_target reports held-out loss over
    step, elapsed = _train(args, model, prompts, eval_len, log)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(args.out), safe_serialization=True)
    tok.save_pretrained(str(args.out))
    hl = heldout_loss(model, prompts.held, eval_len, max_batches=200)
    meta = {
        "steps": step,
        "objective": f"sequence-level unlikelihood (n={args.ngram}, alpha={args.alpha}) + MLE",
        "ul_batch": args.ul_batch,
        "new_tokens": args.new_tokens,
        "mle_batch": args.mle_batch,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "train_seconds": round(elapsed, 1),
        "heldout_loss": round(hl, 4),
        "params": sum(p.numel() for p in model.parameters()),
        "continued_from": before,
        "total_train_seconds": round(elapsed + before.get("total_train_seconds", before["train_seconds"]), 1),
    }
    (args.out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({"done": meta}), file=log, flush=True)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--init-from", type=Path, required=True, help="the target checkpoint to fine-tune")
    ap.add_argument("--work-dir", type=Path, default=Path(".demo-work/target-ul"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ul-batch", type=int, default=16, help="greedy continuations per step")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-lens", default="64,96,128,192")
    ap.add_argument("--ngram", type=int, default=4)
    ap.add_argument("--mle-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--alpha", type=float, default=1.0, help="weight of the unlikelihood term")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--max-files", type=int, default=0, help="only the first N corpus files (smoke tests)")
    return ap


@dataclass(frozen=True)
class _Prompts:
    """The corpus token streams and where prompts may end in them (line ends, docstring closes)."""

    train: np.ndarray
    held: np.ndarray
    ends: np.ndarray  # train indices that end a line closing a docstring
    newline_ids: set[int]
    prompt_lens: tuple[int, ...]

    @classmethod
    def of(cls, args: argparse.Namespace, tok) -> _Prompts:
        tok_dir = args.work_dir / "tokenizer"
        if not (tok_dir / "tokenizer.json").exists():
            tok.save_pretrained(str(tok_dir))
        train = token_stream(tok_dir, "train", args.work_dir, args.max_files)
        held = token_stream(tok_dir, "heldout", args.work_dir, args.max_files)
        texts = [tok.decode([i]) for i in range(len(tok))]
        ends = distill.docstring_ends(train, texts)
        newline_ids = {i for t, i in tok.get_vocab().items() if t.endswith("Ċ")}
        return cls(train, held, ends, newline_ids, tuple(int(x) for x in args.prompt_lens.split(",")))


def _greedy_continuations(args: argparse.Namespace, model, prompts: _Prompts, step: int, rng) -> tuple[np.ndarray, int]:
    """(the model's greedy continuations of a batch of corpus prompts, the prompts' length)."""
    pl = int(rng.choice(prompts.prompt_lens))
    # Half the prompts end where a docstring closes (HumanEval's shape), half at a line end.
    use_ends = prompts.ends if (step % 2 == 0 and len(prompts.ends) >= args.ul_batch) else None
    train = prompts.train
    starts = distill.prompt_starts(train, prompts.newline_ids, args.ul_batch, pl, pl + args.new_tokens, rng, use_ends)
    batch = torch.from_numpy(np.stack([train[s : s + pl] for s in starts]).astype(np.int64))
    model.eval()
    with torch.no_grad():
        gen = model.generate(
            input_ids=batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    model.train()
    return gen.numpy(), pl


def _train(args: argparse.Namespace, model, prompts: _Prompts, eval_len: int, log) -> tuple[int, float]:
    """Steps from the last checkpoint to args.steps, each an unlikelihood step on the model's own greedy
    continuations plus an MLE step on corpus windows; returns (steps, training seconds)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt_path = args.work_dir / "ul-ckpt.pt"
    step, elapsed = checkpoint.resume(ckpt_path, model, opt)
    train = prompts.train
    t_last = time.time()
    while step < args.steps:
        # Every batch is a pure function of (seed, step): a resumed run replays the same schedule.
        rng = np.random.default_rng([args.seed, step])
        seqs, pl = _greedy_continuations(args, model, prompts, step, rng)
        mask = np.stack([repeated_ngram_mask(s, pl, args.ngram) for s in seqs])
        rep = float(np.mean([repetition_rate(s, pl) for s in seqs]))
        x = torch.from_numpy(seqs.astype(np.int64))
        logits = model(input_ids=x[:, :-1]).logits
        ul = unlikelihood_loss(logits, x[:, 1:], torch.from_numpy(mask[:, 1:]).float())
        mstarts = rng.integers(0, len(train) - args.seq_len - 1, size=args.mle_batch)
        w = torch.from_numpy(np.stack([train[s : s + args.seq_len + 1] for s in mstarts]).astype(np.int64))
        mle = next_token_loss(model, w)
        optimizer_step(model, opt, mle + args.alpha * ul)
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        rec = {"step": step, "mle": round(mle.item(), 4), "ul": round(ul.item(), 4)}
        rec.update(masked=round(float(mask[:, pl:].mean()), 3), rep8=round(rep, 3), elapsed_s=round(elapsed, 1))
        print(json.dumps(rec), file=log, flush=True)
        if step % args.ckpt_every == 0 or step == args.steps:
            checkpoint.save_training(ckpt_path, model, opt, step, elapsed)
        if step % 100 == 0:
            hl = heldout_loss(model, prompts.held, eval_len, 20)
            print(json.dumps({"step": step, "heldout_loss": round(hl, 4)}), file=log, flush=True)
            t_last = time.time()
    return step, elapsed


if __name__ == "__main__":
    main()
