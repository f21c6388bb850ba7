"""The dtypes a user may name: the weights' storage dtype and the recurrent state's, each
parsed by one function, so that every entry point (`load`, `Backbone`, the command line,
serve, Ray) accepts and refuses the same names."""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype) -> torch.dtype:
    """A storage dtype from its name ("bfloat16", "bf16", ...) or a torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of float32, bfloat16, float16 (or a torch dtype), got {dtype!r}")

# The dtypes a recurrent state may be stored in: updates compute in float32 and round once
# on store. float16 is not among them: its range (65504) is too narrow for the ssm state of
# a long sequence, and neither peer offers it.
STATE_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_state_dtype(dtype, what: str = "state_dtype") -> torch.dtype:
    """The recurrent state's storage dtype from its name or a torch dtype; a ValueError naming
    `what` (the argument or flag) otherwise."""
    if isinstance(dtype, torch.dtype) and dtype in STATE_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in STATE_DTYPES:
        return STATE_DTYPES[dtype]
    raise ValueError(f"{what} must be 'float32' or 'bfloat16', got {dtype!r}")
