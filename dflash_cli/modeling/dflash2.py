"""DFlash2 drafts: the DFlash draft plus a grouped dynamic convolution around each sublayer and a candidate
selector that picks the proposed block as one path through each position's top-k tokens.

Facts (SGLang's DFlash2DraftModel, whose checkpoint names SpecForge trains to; REFERENCE has the DFlash
backbone):
* `layers.N.{attention,mlp}_conv`: one projection of a sublayer's input gives dynamic kernel deltas for
  both sides, [2, taps, groups] per row; each side convolves its tensor along the block with
  `base_kernel[side] + delta` (per channel base, per group delta), tap t reading the row t before it,
  zeros before the block's first row. The input side runs before the sublayer, the output side after.
* `candidate_selector`: the top-k of each proposed position's transformed logits (times
  `output_multiplier`, then `cap * tanh(x / cap)` with `final_logit_softcapping`) are scored as
  unary + <predecessor_codebook[previous token] * hidden_projection(hidden), successor_codebook[candidate]>;
  the greedy walk starts at the block's anchor (its verified first token) and takes each position's best.
The convolution reads the block's rows only, so it keeps no state across draft calls.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_cli.modeling.dflash2_config import Dflash2Spec


class GroupedConv(nn.Module):
    """The dynamic depthwise convolution along the block around one sublayer."""

    def __init__(self, hidden: int, spec: Dflash2Spec, block: int | None = None) -> None:
        super().__init__()
        self.taps, self.group_size, self.groups = spec.taps, spec.group_size, hidden // spec.group_size
        self.block = block  # training lays several blocks along one row: each convolves on its own
        self.base_kernel = nn.Parameter(torch.zeros(2, spec.taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * spec.taps * self.groups, bias=False)

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        b, n, h = x.shape
        if self.block and n != self.block:  # a row of n / block blocks (training); a draft call is one block
            per = self._convolve(x.reshape(-1, self.block, h), delta.reshape(-1, self.block, *delta.shape[2:]), side)
            return per.reshape(b, n, h)
        xg = x.view(b, n, self.groups, self.group_size)
        coeff = self.base_kernel[side].view(1, 1, self.taps, self.groups, self.group_size) + delta[..., None]
        out = coeff[:, :, 0] * xg
        for t in range(1, self.taps):
            # the row t before; the block's first t rows have none (a slice and a zero block, no Pad op)
            earlier = torch.cat([torch.zeros_like(xg[:, :t]), xg[:, : n - t]], dim=1)
            out = out + coeff[:, :, t] * earlier
        return out.reshape(b, n, h)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's convolved input, and the output side's deltas (from the same projection of x)."""
        b, n, _ = x.shape
        delta = self.kernel_projection(x).view(b, n, 2, self.taps, self.groups)
        return self._convolve(x, delta[:, :, 0], 0), delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self._convolve(y, delta, 1)


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, vocab: int, spec: Dflash2Spec) -> None:
        super().__init__()
        self.spec = spec
        self.top_k = min(spec.top_k, vocab)  # a reduced validation model keeps fewer vocabulary rows
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, spec.rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, spec.rank))
        self.hidden_projection = nn.Linear(hidden, spec.rank, bias=False)

    def unary(self, logits: torch.Tensor) -> torch.Tensor:
        z = _f32(logits)
        if self.spec.output_multiplier != 1.0:
            z = z * self.spec.output_multiplier
        if self.spec.softcap is not None:
            # cap * tanh(z / cap), written with Sigmoid (tanh(x) = 2 sigmoid(2x) - 1): Tanh is not on the QAIC op list
            z = (2.0 * torch.sigmoid(z * (2.0 / self.spec.softcap)) - 1.0) * self.spec.softcap
        return z

    def propose(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """hidden [b, n, H] (final-normed), logits [b, n, V] of the proposed positions, anchor [b] -> tokens [b, n].
        The walk is unrolled over the block: static shapes, one small gather per position."""
        scores, candidates = torch.topk(self.unary(logits), self.top_k, dim=-1)  # [b, n, k]
        context = _f32(self.hidden_projection(hidden))  # [b, n, r]
        successors = _f32(self.successor_codebook[candidates])  # [b, n, k, r]
        previous, picks = anchor, []
        for s in range(candidates.shape[1]):
            state = _f32(self.predecessor_codebook[previous]) * context[:, s]  # [b, r]
            total = scores[:, s] + (successors[:, s] @ state[:, :, None])[..., 0]  # [b, k]
            best = torch.argmax(total, dim=-1, keepdim=True)
            previous = torch.gather(candidates[:, s], 1, best)[:, 0]
            picks.append(previous)
        return torch.stack(picks, dim=1)


def _f32(x: torch.Tensor) -> torch.Tensor:
    # scores in float32 whatever the export dtype; no cast node where x already is (the exporter trips on a
    # no-op cast of a tensor that is also a graph output)
    return x if x.dtype == torch.float32 else x.float()
