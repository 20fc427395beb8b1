"""Training a DFlash2 draft's extra parts (modeling/dflash2.py) alongside the DFlash objective.

A fresh DFlash2 draft computes exactly what a DFlash draft does: each convolution starts as the identity
(base kernel 1 on the current row, zero deltas) and the selector's successor codebook at zero, so every
transition scores 0 and the walk takes each position's argmax; training moves them away from there. The
selector learns by cross-entropy over each position's candidates (the top-k of its logits, the true token
put in place of the last one when it is not among them), scored from the true previous token, as
SpecForge's DFlash2 objective describes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def init_dflash2(draft) -> None:
    """The DFlash2 parts of a new draft set to a plain DFlash draft's behaviour."""
    with torch.no_grad():
        for layer in draft.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0
                conv.kernel_projection.weight.zero_()
        sel = draft.candidate_selector
        sel.predecessor_codebook.normal_(0.0, 0.02)
        sel.successor_codebook.zero_()


def selector_loss(sel, hidden, logits, labels, block: int, weights: torch.Tensor) -> torch.Tensor:
    """hidden [b, n, H] and logits [b, n, V] of n / block blocks laid along each row, labels [b, n] the true
    tokens (each block's first the given anchor); weights [block] the per-position weights of the DFlash loss."""
    b, n, h = hidden.shape
    blocks = n // block
    z = sel.unary(logits.view(b, blocks, block, -1)[:, :, 1:])
    gold = labels.view(b, blocks, block)[:, :, 1:]
    prev = labels.view(b, blocks, block)[:, :, :-1]
    cand = torch.topk(z.detach(), sel.top_k, dim=-1).indices
    present = (cand == gold[..., None]).any(-1, keepdim=True)
    cand = torch.where(present, cand, torch.cat([cand[..., :-1], gold[..., None]], dim=-1))
    target = (cand == gold[..., None]).float().argmax(-1)
    context = sel.predecessor_codebook[prev] * sel.hidden_projection(hidden.view(b, blocks, block, h)[:, :, 1:])
    scores = z.gather(-1, cand) + (sel.successor_codebook[cand] @ context[..., None])[..., 0]
    ce = F.cross_entropy(scores.reshape(-1, sel.top_k), target.reshape(-1), reduction="none").view_as(gold)
    w = weights[1:].to(ce.dtype)
    return (ce * w).sum() / (w.sum() * b * blocks)


def walked(sel, hidden, logits, labels, block: int) -> torch.Tensor:
    """The selector's greedy proposals [b, n / block, block - 1] for blocks laid along each row."""
    b, n, h = hidden.shape
    blocks = n // block
    hs = hidden.view(b * blocks, block, h)[:, 1:]
    lg = logits.reshape(b * blocks, block, -1)[:, 1:]
    anchors = labels.view(b * blocks, block)[:, 0]
    return sel.propose(hs, lg, anchors).view(b, blocks, block - 1)
