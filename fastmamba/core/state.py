"""MambaState: the recurrent state of every layer for a fixed number of slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastmamba.core.layers import layer_kind


@dataclass
class MambaState:
    """The recurrent state of every layer for a fixed number of slots (batch rows)."""

    conv: torch.Tensor  # (L, B, E, K) f32: the last K conv inputs, newest last
    ssm: torch.Tensor  # (L, B, E, N) f32

    @classmethod
    def zeros(cls, config, batch: int, device="cpu", dtype=torch.float32) -> "MambaState":
        conv, ssm = layer_kind(config).state(config)  # one slot's, per layer
        return cls(
            conv=torch.zeros(config.n_layer, batch, *conv, device=device, dtype=dtype),
            ssm=torch.zeros(config.n_layer, batch, *ssm, device=device, dtype=dtype),
        )

    @property
    def batch(self) -> int:
        return self.conv.shape[1]

    def reset(self, mask=None) -> None:
        """Zeroes the slots of a sequence boundary: `mask` a (B,) bool tensor (True: reset
        that slot; on the state's device, a masked multiply: no host sync, safe inside a
        CUDA graph), a slot index, or None for all."""
        if isinstance(mask, torch.Tensor):
            if mask.shape != (self.batch,) or mask.dtype != torch.bool:
                raise ValueError(f"mask must be a bool tensor of shape ({self.batch},), got {mask.dtype} {tuple(mask.shape)}")
            keep = (~mask.to(self.conv.device)).to(self.conv.dtype).view(1, -1, 1, 1)
            self.conv.mul_(keep)
            self.ssm.mul_(keep.to(self.ssm.dtype))
            return
        rows = slice(None) if mask is None else mask
        self.conv[:, rows].zero_()
        self.ssm[:, rows].zero_()

    def rows(self, index) -> "MambaState":
        """A copy holding only the given slots."""
        return MambaState(self.conv[:, index].clone(), self.ssm[:, index].clone())


