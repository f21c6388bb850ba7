"""fastmamba.Backbone's sizes: BackboneConfig, checked when made (a bad field is refused by name)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BackboneConfig:
    input_dim: int  # width of the vectors fed in
    d_model: int
    n_layer: int
    d_state: int | None = None  # None: the layer's usual size (Mamba-1 16, Mamba-2 128)
    d_conv: int = 4
    expand: int = 2
    dt_rank: int | str = "auto"  # Mamba-1's; "auto": ceil(d_model / 16)
    norm_eps: float = 1e-5
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj / out_proj bias
    input_proj: bool | None = None  # a Linear input_dim -> d_model; None: when the widths differ
    layer: str = "mamba1"  # "mamba1" (selective scan) or "mamba2" (SSD: backbone_mamba2.py)
    # Mamba-2's (mamba_ssm's defaults): heads of head_dim channels (d_inner = expand x d_model
    # of them), sharing n_groups groups of B and C; the sequence pass's chunks of chunk_size steps
    head_dim: int = 64
    n_groups: int = 1
    chunk_size: int = 256

    def __post_init__(self):
        if self.layer not in ("mamba1", "mamba2"):
            raise ValueError(f"BackboneConfig.layer must be 'mamba1' or 'mamba2', got {self.layer!r}")
        if self.d_state is None:
            object.__setattr__(self, "d_state", 128 if self.layer == "mamba2" else 16)
        for name in ("input_dim", "d_model", "n_layer", "d_state", "d_conv", "expand", "head_dim", "n_groups",
                     "chunk_size", "dt_rank"):
            v = getattr(self, name)
            if name == "dt_rank" and v == "auto":
                continue
            if not isinstance(v, numbers.Integral) or isinstance(v, (bool, np.bool_)) or v < 1:
                either = " or 'auto'" if name == "dt_rank" else ""
                raise ValueError(f"BackboneConfig.{name} must be a positive integer{either}, got {v!r}")
            object.__setattr__(self, name, int(v))  # (numpy's integers as Python's)
        if not isinstance(self.norm_eps, (int, float)) or not 0 < self.norm_eps < math.inf:
            raise ValueError(f"BackboneConfig.norm_eps must be a positive number, got {self.norm_eps!r}")
        for name in ("conv_bias", "proj_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BackboneConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.input_proj is None:
            object.__setattr__(self, "input_proj", self.input_dim != self.d_model)
        if not self.input_proj and self.input_dim != self.d_model:
            raise ValueError(f"BackboneConfig: input_dim {self.input_dim} differs from d_model {self.d_model}, "
                             "so input_proj cannot be false")
        if self.dt_rank == "auto":  # resolved here, so every reader sees a number
            object.__setattr__(self, "dt_rank", math.ceil(self.d_model / 16))
        if self.layer == "mamba2":
            if self.d_inner % self.head_dim:
                raise ValueError(f"BackboneConfig.head_dim {self.head_dim} must divide d_inner = expand x d_model = "
                                 f"{self.d_inner}")
            if self.n_heads % self.n_groups:
                raise ValueError(f"BackboneConfig.n_groups {self.n_groups} must divide the {self.n_heads} heads "
                                 f"(d_inner {self.d_inner} / head_dim {self.head_dim})")

    # the sizes mamba1.mixer and mamba2.mixer2 read
    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def n_heads(self) -> int:
        return self.d_inner // self.head_dim

    dbc_norm_eps = None  # plain Mamba layers (no Falcon-Mamba norm)
    # Mamba-2 as mamba_ssm's Mamba2 module makes it: step sizes unclamped, the gated norm
    # (of y * silu(z)) present
    dt_limit = (0.0, math.inf)
    norm_before_gate = False
    ssm_norm = True
