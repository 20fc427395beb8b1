"""The demo DFlash draft's training objective (REFERENCE section 9), on the target's greedy continuations.

Each training block is [token at anchor, MASK x (B-1)] at positions anchor..anchor+B-1; it sees
the target's fused features of positions < anchor and itself bidirectionally; position k predicts
the token at anchor+k, weighted by exp(-(k-1)/gamma).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dflash_cli.demo.selector_loss import selector_loss, walked
from dflash_cli.modeling.draft import DFlashDraft


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


@dataclass
class BlockObjective:
    """The draft's loss on blocks anchored in the target's continuations (the module docstring), and the
    tokens a verify step would commit from its proposals."""

    target: Any
    draft: DFlashDraft
    layer_ids: list[int]
    mask_id: int
    anchors: int  # blocks per sequence
    weights: torch.Tensor  # per block position (position_weights)
    selector_alpha: float | None  # weight of a DFlash2 draft's selector loss; None for a DFlash draft

    def features(self, x: torch.Tensor) -> torch.Tensor:
        hs = self.target(input_ids=x, output_hidden_states=True).hidden_states
        return torch.cat([hs[i + 1] for i in self.layer_ids], dim=-1)

    def loss_and_acc(self, seqs: np.ndarray, pl: int, rng) -> tuple[torch.Tensor, float]:
        draft, B = self.draft, len(self.weights)  # one weight per block position
        x = torch.from_numpy(seqs.astype(np.int64))
        with torch.no_grad():
            feats = self.features(x)
        ids, pos, labels, visible = block_batch(list(seqs), [pl] * len(seqs), self.anchors, B, self.mask_id, rng)
        ctx_pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        fused = draft.fuse(feats)
        hidden = draft.hidden_states(ids, pos, draft.context_kv(fused, ctx_pos), visible)
        logits = draft.lm_head(hidden)
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none"
        )
        w = self.weights.repeat(ids.shape[1] // B)[None].expand_as(ids).reshape(-1)
        loss = (ce * w).sum() / w.sum()
        if self.selector_alpha is not None:  # the selector's own loss, and its walk is what a verify step sees
            sel = draft.candidate_selector
            loss = loss + self.selector_alpha * selector_loss(sel, hidden, logits, labels, B, self.weights)
            with torch.no_grad():
                proposed = walked(sel, hidden, logits, labels, B).reshape(-1, B - 1)
            hit = proposed == labels.reshape(-1, B)[:, 1:]
        else:
            hit = (logits.argmax(-1) == labels).reshape(-1, B)[:, 1:]
        accept = torch.cumprod(hit.int(), dim=1).sum(1).float() + 1  # tokens a verify step would commit
        return loss, accept.mean().item()

    def evaluate(self, heldout: list[np.ndarray]) -> dict:
        self.draft.eval()
        rng = np.random.default_rng(123)  # the same blocks every evaluation
        losses, taus = [], []
        with torch.no_grad():
            for b in heldout:
                loss, tau = self.loss_and_acc(b[:, 1:], int(b[0, 0]), rng)
                losses.append(loss.item())
                taus.append(tau)
        self.draft.train()
        return {"heldout_loss": round(float(np.mean(losses)), 4), "heldout_block_tau": round(float(np.mean(taus)), 3)}
