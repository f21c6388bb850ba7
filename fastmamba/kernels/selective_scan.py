"""Selective scan over time (prefill): the SSM recurrence with the D skip and SiLU(z) gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def selective_scan_ref(
    x: torch.Tensor,  # (B, E, T) conv output
    dt: torch.Tensor,  # (B, E, T) dt_proj output, before bias and softplus
    A: torch.Tensor,  # (E, N), already -exp(A_log)
    Bm: torch.Tensor,  # (B, N, T)
    Cm: torch.Tensor,  # (B, N, T)
    D: torch.Tensor,  # (E,)
    z: torch.Tensor,  # (B, E, T) gate
    dt_bias: torch.Tensor,  # (E,)
    state: torch.Tensor,  # (B, E, N) float32, updated in place to the state after the last step
) -> torch.Tensor:  # (B, E, T) float32
    """The recurrence one time step after another, in float32: the oracle for the Triton scan."""
    x, z = x.float(), z.float()
    delta = F.softplus(dt.float() + dt_bias[None, :, None])  # (B, E, T); softplus(v) = v above 20
    s = state.clone()  # autograd may save s; the in-place write below must not change it
    ys = []
    for t in range(x.shape[-1]):
        decay = torch.exp(delta[:, :, t, None] * A)  # (B, E, N)
        s = s * decay + (delta[:, :, t] * x[:, :, t])[:, :, None] * Bm[:, None, :, t]
        ys.append(torch.einsum("ben,bn->be", s, Cm[:, :, t]))  # (B, E)
    state.copy_(s)
    y = torch.stack(ys, dim=-1) + D[None, :, None] * x  # (B, E, T)
    return y * F.silu(z)
