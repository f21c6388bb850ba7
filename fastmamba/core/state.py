"""MambaState: the recurrent state of every Mamba sublayer for a fixed number of slots, and,
in a hybrid, the attention sublayers' keys and values (kv_cache.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastmamba.core.kv_cache import KVCache
from fastmamba.core.layers import layer_kind


@dataclass
class MambaState:
    """The recurrent state of every layer for a fixed number of slots (batch rows)."""

    conv: torch.Tensor  # (L, B, E, K) f32: the last K conv inputs, newest last (L: the Mamba sublayers)
    ssm: torch.Tensor  # (L, B, E, N) f32
    kv: KVCache | None = None  # a hybrid's keys and values (None: no attention)
    kv_rows: list[int] | None = None  # the rows' slots in kv (None: 0 .. B-1)
    # False: the KV cache's host bookkeeping (blocks reserved, lengths on the host) is the
    # caller's, and a pass only stores and reads on the device (slots 0 .. B-1), as a CUDA
    # graph must (engine/cuda_graphs.py)
    kv_host: bool = True

    @classmethod
    def zeros(cls, config, batch: int, device="cpu", dtype=torch.float32, kv_dtype=torch.float32,
              tokens: int = 0) -> "MambaState":
        """Zero state for `batch` slots; a hybrid's keys and values in kv_dtype (the weights'
        storage dtype), a pool with room for `tokens` tokens a slot that grows when asked."""
        conv, ssm = layer_kind(config).state(config)  # one slot's, per layer
        layers = getattr(config, "n_recurrent", config.n_layer)
        kv = None
        if getattr(config, "n_attention", 0):
            kv = KVCache.for_tokens(config, batch, tokens, kv_dtype, device)
        return cls(
            conv=torch.zeros(layers, batch, *conv, device=device, dtype=dtype),
            ssm=torch.zeros(layers, batch, *ssm, device=device, dtype=dtype),
            kv=kv,
        )

    def cache_rows(self) -> list[int]:
        """The rows' slots in the KV cache."""
        return list(range(self.batch)) if self.kv_rows is None else list(self.kv_rows)

    @property
    def batch(self) -> int:
        return self.conv.shape[1]

    def reset(self, mask=None) -> None:
        """Zeroes the slots of a sequence boundary: `mask` a (B,) bool tensor (True: reset
        that slot; on the state's device, a masked fill: no host sync, safe inside a
        CUDA graph) or a list or numpy array of B bools, a slot index (an integer from 0 to
        B - 1), or None for all. Anything else is a ValueError naming it (a bool alone is
        refused: it would index slot 0 or 1)."""
        if isinstance(mask, (list, tuple, np.ndarray)):
            try:
                mask = torch.as_tensor(mask)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(f"mask must be {self.batch} bools, got {mask!r}") from None
        if isinstance(mask, torch.Tensor):
            if mask.shape != (self.batch,) or mask.dtype != torch.bool:
                raise ValueError(f"mask must be a bool tensor of shape ({self.batch},), got {mask.dtype} {tuple(mask.shape)}")
            mask = mask.to(self.conv.device)  # (slots are dim 1 of each; Mamba-2's ssm has 5 dims)
            # (a fill, not a multiply by zero: a NaN or an infinity in a slot goes too)
            self.conv.masked_fill_(mask.view(1, -1, *[1] * (self.conv.dim() - 2)), 0)
            self.ssm.masked_fill_(mask.view(1, -1, *[1] * (self.ssm.dim() - 2)), 0)
            return
        if mask is not None and (not isinstance(mask, (int, np.integer)) or isinstance(mask, (bool, np.bool_))
                                 or not 0 <= mask < self.batch):
            raise ValueError(f"mask must be a bool tensor of shape ({self.batch},), a slot index from 0 to "
                             f"{self.batch - 1}, or None, got {mask!r}")
        rows = slice(None) if mask is None else int(mask)
        self.conv[:, rows].zero_()
        self.ssm[:, rows].zero_()
        if self.kv is not None:  # (a hybrid's slots hold no keys and values after a reset)
            slots = self.cache_rows()
            for slot in slots if mask is None else [slots[mask]]:
                self.kv.release(slot)

    def rows(self, index) -> "MambaState":
        """A copy holding only the given slots."""
        return MambaState(self.conv[:, index].clone(), self.ssm[:, index].clone())


