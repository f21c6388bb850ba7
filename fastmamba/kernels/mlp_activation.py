"""The hybrids' MLP activation between their two products, `act(gate) * up` (gated: SiLU) or
`act(up)` (Nemotron-H's squared ReLU), in one launch that rounds the result once to the dtype
the down product reads; with its `_ref` twin. The torch ops took three launches (the
activation, the product or the square, the rounding), which at a decode step's few rows cost
more than their bytes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton
from .activations import activate

ACTIVATIONS = {"silu": F.silu, "relu2": lambda x: F.relu(x).square()}


def mlp_activation_ref(a: torch.Tensor, act: str, gated: bool, out_dtype=None) -> torch.Tensor:
    """a (..., 2F) gated (gate's columns first), (..., F) not -> (..., F) float32 (out_dtype:
    the Triton kernel's; the reference keeps float32)."""
    fn = ACTIVATIONS[act]
    if gated:
        gate, up = a.float().chunk(2, dim=-1)
        return fn(gate) * up
    return fn(a.float())


@jit
def _mlp_activation_kernel(a_ptr, out_ptr, F_, ACT: tl.constexpr, GATED: tl.constexpr, BF: tl.constexpr):
    # One program: BF columns of one row, in float32, rounded once on the way out.
    row = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    m = f < F_
    width = 2 * F_ if GATED else F_
    x = tl.load(a_ptr + row * width + f, mask=m, other=0.0).to(tl.float32)
    y = activate(x, ACT)
    if GATED:
        y = y * tl.load(a_ptr + row * width + F_ + f, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * F_ + f, y.to(out_ptr.dtype.element_ty), mask=m)


def mlp_activation(a: torch.Tensor, act: str, gated: bool, out_dtype=torch.float32) -> torch.Tensor:
    """mlp_activation_ref's result through the kernel, in out_dtype."""
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown MLP activation {act!r}; known: {', '.join(ACTIVATIONS)}")
    a = a.contiguous()
    F_ = a.shape[-1] // 2 if gated else a.shape[-1]
    rows = a.numel() // a.shape[-1]
    out = torch.empty(*a.shape[:-1], F_, device=a.device, dtype=out_dtype)
    BF = min(1024, triton.next_power_of_2(F_))
    _mlp_activation_kernel[(rows, triton.cdiv(F_, BF))](a, out, F_, ACT=act, GATED=gated, BF=BF, num_warps=4)
    return out
