"""PyTorch's CPU threads while a model computes on the CPU, set for the work and restored
after it."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def cpu_threads(threads: int, device: torch.device):
    """torch's thread count set to `threads` inside (0: left as it is; nothing on a GPU).
    Per-token products are small, and a second thread that waits for a core another process
    holds stalls every one of them (bundled model beside one busy process: 105 tokens/s
    with one thread, 28 with two), so the engine computes on one thread by default."""
    before = torch.get_num_threads()
    if threads and device.type == "cpu" and before != threads:
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)
    else:
        yield
