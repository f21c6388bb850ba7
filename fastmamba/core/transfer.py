"""Host values onto the device without making the host wait for the GPU."""

from __future__ import annotations

import torch


def to_device(values, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values (a list, or a host tensor) as a tensor on `device`, copied from pinned
    memory: a plain copy from pageable memory (torch.tensor(..., device=...), or indexing a
    device tensor with a list) waits for the stream's queued work, the engine's step ahead
    included. A list becomes int64 (token ids, slots, blocks) unless `dtype` says."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype or torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t
