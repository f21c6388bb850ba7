"""Programmatic dependent launch (Hopper and newer): a kernel may start while the one before
it in the stream is still finishing, so that its launch, its setup and the loads of what
the kernel before does not write overlap that kernel's tail.

A kernel launched this way (the launch option `launch_pdl=True`, with its PDL constexpr
> 0) must call wait_for_prior_kernel before it touches anything the kernel before it
writes or reads; the decode steps' kernels all do.
"""

from __future__ import annotations

import torch

from ._triton import INTERPRET, jit, tl


@jit
def let_next_kernel_launch(PDL: tl.constexpr):
    """PDL 2: the next kernel may launch as soon as all of this one's programs have
    started (it still waits for this one to finish before it reads its results)."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@jit
def wait_for_prior_kernel(PDL: tl.constexpr):
    """With PDL 1 or 2, waits for the kernel before this one to finish (its writes then
    visible). With PDL 1 it then lets the next kernel start early in turn."""
    if PDL > 0:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()


def use_pdl(device: torch.device) -> bool:
    """Hopper or newer, and a Triton that can launch with it. (Whether a decode step uses
    it is its plan's choice: the engine's DecodePlan.pdl.)"""
    if INTERPRET or device.type != "cuda":
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return torch.cuda.get_device_capability(device)[0] >= 9 and "launch_pdl" in CUDAOptions.__dataclass_fields__


NO_PDL = dict(PDL=0)  # the launch options of a plain launch (never modified: unpacked or copied)


def pdl_launch(device: torch.device) -> dict:
    """The launch options of a kernel that takes a PDL constexpr: PDL 1 where it is used."""
    return dict(PDL=1, launch_pdl=True) if use_pdl(device) else NO_PDL
