"""Export-ready Gated DeltaNet: the linear-attention layer of Qwen3.5 targets.

Per head (value head h reads key head h // (value_heads / key_heads)) with l2-normalised q, k, q scaled by
1/sqrt(dk), beta_t = sigmoid(b_t) and log-gate g_t = -exp(A_log) * softplus(a_t + dt_bias) <= 0, the state
S (dk x dv) evolves as

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,    u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),    o_t = S_t^T q_t.

Unrolled over a block from S_0, with G_t = g_1 + ... + g_t (a cumsum) and D[t, j] = exp(G_t - G_j) for j <= t
(0 above the diagonal):

    S_t = exp(G_t) S_0 + sum_{j<=t} D[t, j] k_j u_j^T
    (I + A) U = beta*V - (beta*exp(G)*K) S_0,    A[t, j] = beta_t D[t, j] k_t.k_j for j < t.

A is strictly lower triangular, hence nilpotent: (I + A)^-1 = prod_i (I + (-A)^(2^i)) for 2^i < T, i.e.
ceil(log2 T) matrix squarings instead of a triangular solve (which ONNX lacks) or a loop over tokens.

`forward` returns the state after every position of the call, for exact rollback in speculative decoding
(keep index n-1 after n accepted tokens). It costs B*T*Hv*dk*dv*4 bytes of fp32 recurrent state per layer
and call: for the Qwen3.5-9B shapes (Hv=32, dk=dv=128, 24 linear layers) 2 MiB per position and layer,
48 MiB per position over the model, 384 MiB for an 8-token verify block (plus [B, Hv, T, T, dk] scratch);
the conv states add B*T*conv_dim*(K-1) values (8192*3 per position and layer). `forward_chunked` is the
prefill form: chunks of `chunk_size` tokens in matrix form, a short loop over chunks, final states only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_cli.modeling.layers import MASKED_SCORE, rms_normalize

# Squarings when the block length is symbolic at export (dynamic seq_len): exact for blocks of up to 64 tokens.
_MAX_SQUARINGS = 6


def squarings_for(longest_call: int) -> int:
    """Squarings that make `_unit_lower_inverse_minus_identity` exact for calls of up to `longest_call` tokens."""
    return max(1, (longest_call - 1).bit_length())


def _unit_lower_inverse_minus_identity(a: torch.Tensor, squarings: int | None = None) -> torch.Tensor:
    """(I + a)^-1 - I for strictly lower-triangular a [..., T, T], by the factored Neumann series: exact while
    T <= 2^squarings (default: enough for T when it is known at trace time, else _MAX_SQUARINGS). Without the
    identity term no eye(T) is built, whose size would depend on the call (Range: not shape-inferable)."""
    t = a.shape[-1]
    steps = squarings or ((t - 1).bit_length() if isinstance(t, int) else _MAX_SQUARINGS)
    power = -a
    rest = power  # (I - a) - I: covers powers below 2
    for _ in range(1, steps):
        power = power @ power
        rest = rest + power + rest @ power  # (I + rest)(I + power) - I: covers powers below 2^(i+1)
    return rest


def _intra_block(k, v, g, beta, squarings: int | None = None):
    """The S_0-independent parts of a block, over any leading dims ([..., T, d]; g, beta [..., T]).

    Returns (G, D, W, Y) with U = Y - W @ S_0 (the delta-rule corrections of the block). The triangular masks
    compare row numbers computed from g itself (a CumSum), so every shape follows from the inputs' shapes."""
    row = (g * 0.0 + 1.0).cumsum(-1)
    lower = row.unsqueeze(-1) >= row.unsqueeze(-2)
    cum = g.cumsum(-1)
    log_decay = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # [t, j]: log of the decay from j to t, <= 0 where j <= t
    decay = torch.where(lower, log_decay, MASKED_SCORE).exp()  # finite in fp16; exp of it is 0
    k_beta = k * beta.unsqueeze(-1)
    strictly_lower = row.unsqueeze(-1) > row.unsqueeze(-2)
    rest = _unit_lower_inverse_minus_identity(
        torch.where(strictly_lower, (k_beta @ k.transpose(-1, -2)) * decay, 0.0), squarings
    )
    w_in, y_in = k_beta * cum.exp().unsqueeze(-1), v * beta.unsqueeze(-1)
    return cum, decay, w_in + rest @ w_in, y_in + rest @ y_in


class _GatedRMSNorm(nn.Module):
    """RMS-normalise per value head, scale by weight, gate by silu(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.weight.float() * rms_normalize(x.float(), self.eps) * F.silu(z.float())


class GatedDeltaLayer(nn.Module):
    """Qwen3.5 Gated DeltaNet with explicit conv/recurrent states; same state_dict keys as the HF layer.

    conv_state: [B, conv_dim, K-1], the last K-1 inputs of the causal conv (zeros at the start);
    rec_state: [B, value_heads, key_head_dim, value_head_dim], fp32."""

    def __init__(self, config, chunk_size: int = 64) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.k_heads, self.v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        if self.v_heads % self.k_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        self.key_dim, self.value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        self.chunk_size = chunk_size
        self.in_proj_qkv = nn.Linear(self.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, self.v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = _GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

    def zero_states(self, batch: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv_state, rec_state) before the first token."""
        device = self.A_log.device
        conv = torch.zeros(batch, self.conv_dim, self.kernel - 1, dtype=dtype, device=device)
        return conv, torch.zeros(batch, self.v_heads, self.dk, self.dv, dtype=torch.float32, device=device)

    def _inputs(self, x: torch.Tensor, conv_state: torch.Tensor):
        """Projections and causal conv: (q, k, v [B, Hv, T, d] fp32, a, b [B, Hv, T], z, window), with a and b
        the gates before their activations (`_gates`)."""
        bsz, t, _ = x.shape
        qkv = self.in_proj_qkv(x).transpose(1, 2)
        # (No cast when the dtypes agree: the exporter loses a graph output that reaches it through a no-op cast.)
        conv_state = conv_state if conv_state.dtype == qkv.dtype else conv_state.to(qkv.dtype)
        window = torch.cat([conv_state, qkv], dim=-1)  # [B, conv_dim, K-1+T]
        mixed = F.silu(self._depthwise(window)).transpose(1, 2).float()
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.v_heads // self.k_heads
        # l2norm(x) = x * rsqrt(sum x^2 + eps) = rms_normalize(x, eps / d) / sqrt(d); q also gets 1/sqrt(dk).
        q = rms_normalize(q.reshape(bsz, t, self.k_heads, self.dk), 1e-6 / self.dk) / self.dk
        k = rms_normalize(k.reshape(bsz, t, self.k_heads, self.dk), 1e-6 / self.dk) * self.dk**-0.5
        q, k = (
            y.unsqueeze(3).expand(bsz, t, self.k_heads, rep, self.dk).reshape(bsz, t, self.v_heads, self.dk)
            for y in (q, k)
        )
        v = v.reshape(bsz, t, self.v_heads, self.dv)
        a = self.in_proj_a(x).float() + self.dt_bias.float()
        b = self.in_proj_b(x).float()
        q, k, v, a, b = (y.transpose(1, 2) for y in (q, k, v, a, b))
        return q, k, v, a, b, self.in_proj_z(x), window

    def decay_rate(self) -> torch.Tensor:
        """-exp(A_log) [Hv]: g = decay_rate * softplus(a)."""
        return -self.A_log.float().exp()

    def _gates(self, a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor | None = None):
        """(g, beta) [B, Hv, T] from `_inputs`' a, b. `valid` [B, T] (bool): rows that are padding get g = 0 and
        beta = 0, so they leave the state as it was."""
        g, beta = self.decay_rate()[:, None] * F.softplus(a), torch.sigmoid(b)
        if valid is not None:
            g, beta = (torch.where(valid[:, None, :], y, 0.0) for y in (g, beta))
        return g, beta

    def _depthwise(self, window: torch.Tensor) -> torch.Tensor:
        """The causal depthwise conv over window [B, conv_dim, K-1+T] as K shifted products: no Conv op
        (not on the QAIC allow-list), and each output is the same sum of K terms as the Conv kernel's."""
        w = self.conv1d.weight[:, 0].to(window.dtype)  # [conv_dim, K]
        k = self.kernel
        # Slices end relative to the window's end (constants), so every shape is inferable from the window's.
        out = window[:, :, k - 1 :] * w[:, k - 1 : k]
        for i in range(k - 1):
            out = out + window[:, :, i : i - (k - 1)] * w[:, i : i + 1]
        return out

    def _output(self, core: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """core [B, Hv, T, dv] -> gated norm with z -> out_proj."""
        bsz, _, t, _ = core.shape
        normed = self.norm(core.transpose(1, 2), z.reshape(bsz, t, self.v_heads, self.dv))
        return self.out_proj(normed.reshape(bsz, t, self.value_dim).to(dtype))

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor):
        """x [B, T, hidden] -> (y [B, T, hidden], conv_states [B, T, conv_dim, K-1], rec_states [B, T, Hv, dk, dv]).

        The states are those after each position of the call; index n-1 resumes after the first n tokens.
        Exported with a symbolic T, one graph serves every T <= 64 (see _MAX_SQUARINGS)."""
        t = x.shape[1]
        q, k, v, a, b, z, window = self._inputs(x, conv_state)
        g, beta = self._gates(a, b)
        cum, decay, w, y = _intra_block(k, v, g, beta)
        s0 = rec_state.float()
        u = y - w @ s0
        # S_t = exp(G_t) S_0 + sum_j D[t, j] k_j u_j^T, for all t at once: [B, Hv, T, dk, dv]
        spread = (decay.unsqueeze(-1) * k.unsqueeze(-3)).transpose(-1, -2)  # [B, Hv, T, dk, T]
        states = cum.exp()[..., None, None] * s0.unsqueeze(2) + spread @ u.unsqueeze(-3)
        core = (q.unsqueeze(-2) @ states).squeeze(-2)
        conv_states = torch.stack([window[:, :, 1 + i : 1 + i + t] for i in range(self.kernel - 1)], dim=-1)
        return self._output(core, z, x.dtype), conv_states.transpose(1, 2), states.transpose(1, 2)

    def forward_chunked(self, x: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor):
        """x [B, T, hidden] -> (y, conv_state after the call, rec_state after the call), in chunks of chunk_size.

        Intra-chunk terms are computed for all chunks at once; the state is carried over the ceil(T / chunk_size)
        chunks by a loop fixed at trace time. Padding tokens have g = 0 and beta = 0, so they leave S unchanged."""
        bsz, t, _ = x.shape
        c = self.chunk_size
        q, k, v, a, b, z, window = self._inputs(x, conv_state)
        g, beta = self._gates(a, b)
        pad = (-t) % c
        q, k, v = (F.pad(y, (0, 0, 0, pad)) for y in (q, k, v))
        g, beta = (F.pad(y, (0, pad)) for y in (g, beta))
        n = (t + pad) // c
        q, k, v = (y.reshape(bsz, self.v_heads, n, c, y.shape[-1]) for y in (q, k, v))
        g, beta = (y.reshape(bsz, self.v_heads, n, c) for y in (g, beta))
        cum, decay, w, y = _intra_block(k, v, g, beta)
        attn = (q @ k.transpose(-1, -2)) * decay
        q_read = q * cum.exp().unsqueeze(-1)
        k_write = k * decay[..., -1, :].unsqueeze(-1)  # decay from each position to the chunk's end
        end_decay = cum[..., -1].exp()[..., None, None]
        s = rec_state.float()
        outs = []
        for i in range(n):
            u = y[:, :, i] - w[:, :, i] @ s
            outs.append(q_read[:, :, i] @ s + attn[:, :, i] @ u)
            s = end_decay[:, :, i] * s + k_write[:, :, i].transpose(-1, -2) @ u
        core = torch.cat(outs, dim=2)[:, :, :t]
        return self._output(core, z, x.dtype), window[:, :, -(self.kernel - 1) :], s
