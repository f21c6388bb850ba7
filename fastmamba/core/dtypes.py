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
    # FP8 weights (core/fp8.py): the projections in float8 e4m3 with a float32 scale a row
    "fp8": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def parse_dtype(dtype, fp8: bool = True) -> torch.dtype:
    """A storage dtype from its name ("bfloat16", "bf16", "fp8", ...) or a torch dtype.
    fp8=False: for weights that are plain tensors (fastmamba.Backbone's), which FP8 is not."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values() and (fp8 or dtype != torch.float8_e4m3fn):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES and (fp8 or DTYPES[dtype] != torch.float8_e4m3fn):
        return DTYPES[dtype]
    names = "float32, bfloat16, float16" + (", fp8" if fp8 else "")
    raise ValueError(f"dtype must be one of {names} (or a torch dtype), got {dtype!r}")


def embedding_dtype(storage: torch.dtype, device=None) -> torch.dtype:
    """The dtype the embedding (and a head tied to it) is stored in: the storage dtype, but
    under fp8 bfloat16 on a GPU and float32 elsewhere. An embedding lookup reads a few rows
    a step, so FP8 would save little there, while a tied head is the largest product. On a
    GPU the head is read as the bfloat16 model reads it (in float32 it would add 0.26 GB to
    the 2.8b step's 2.92 GB), and the products' operands and a hybrid's keys and values
    follow it, as the bfloat16 model's do. The CPU reference computes in float32 anyway, so
    there the fp8 figures measure the projections' rounding alone."""
    if storage != torch.float8_e4m3fn:
        return storage
    return torch.bfloat16 if device is not None and torch.device(device).type == "cuda" else torch.float32


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
