"""What the engine's memory holds on a device: slots (each a recurrent state, logits and
activations), and a hybrid's KV cache, sized from the free memory where not given."""

from __future__ import annotations

import torch

from fastmamba.core.kv_cache import bytes_per_token
from fastmamba.core.layers import state_bytes


def kv_cache_tokens(model, megabytes: int | None, slots: int = 0) -> int | None:
    """The tokens a hybrid's KV cache holds (None for a model without attention): `megabytes`
    of them, or on a GPU half the memory free once the model and its slots (`slots` bytes,
    not yet taken) are in, on the CPU 1024 MiB."""
    c = model.config
    if not getattr(c, "n_attention", 0):
        return None
    per_token = bytes_per_token(c, model.weights.embedding.element_size())
    if megabytes is None:
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            return max(1, (free - slots) // 2 // per_token)
        megabytes = 1024
    return max(1, (megabytes << 20) // per_token)


def default_max_batch(model) -> int:
    """The slots when --max-batch is not given: 16 on the CPU; on a GPU as many as half its
    free memory holds (each slot's state, logits and decode activations), at most 256."""
    if model.device.type != "cuda":
        return 16
    free, _ = torch.cuda.mem_get_info(model.device)
    return max(1, min(256, free // 2 // slot_bytes(model)))


def slot_bytes(model) -> int:
    """A slot's memory: its recurrent state, logits (and the sampler's copies), the sampler's
    rows (the seen marks; logit bias and token counts, 4 bytes each), activations."""
    c = model.config
    return state_bytes(c, model.state_dtype.itemsize) + 4 * c.vocab_size * 4 + 9 * c.vocab_size + 16 * c.d_inner * 4
