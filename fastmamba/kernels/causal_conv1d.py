"""Causal depthwise conv1d over time with SiLU, continuing from (and updating) a conv state."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_ref(
    x: torch.Tensor,  # (B, E, T) new inputs
    weight: torch.Tensor,  # (E, K)
    bias: torch.Tensor | None,  # (E,)
    state: torch.Tensor,  # (B, E, K) the last K inputs, newest last; updated in place
) -> torch.Tensor:  # (B, E, T) float32, SiLU applied
    K = weight.shape[-1]
    # The K-1 older inputs in the state are the left context of the first new input.
    full = torch.cat([state[:, :, 1:], x.float()], dim=-1)  # (B, E, K-1+T)
    y = F.conv1d(full, weight[:, None, :], bias, groups=weight.shape[0])  # (B, E, T)
    state.copy_(torch.cat([state, x.float()], dim=-1)[:, :, -K:])
    return F.silu(y)
