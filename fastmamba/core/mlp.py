"""The MLP sublayer of the hybrids over `Ops`: `down(act(gate(u)) * up(u))` (gated: Bamba,
Granite-4.0-H, Falcon-H1) or `down(act(up(u)))` (Nemotron-H, act the squared ReLU). Gate and
up are one matrix in the model (gate's rows first), one product."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastmamba.core import fp8


@dataclass
class MLPWeights:
    norm_w: torch.Tensor  # (d,) f32
    in_w: torch.Tensor  # (2 F, d) gated (gate, up), (F, d) not; storage dtype
    out_w: torch.Tensor  # (d, F)
    in_b: torch.Tensor | None = None  # f32
    out_b: torch.Tensor | None = None


def shapes(c, norm: str, p: str, names: tuple[str, ...], size: int = 0) -> dict[str, tuple[int, ...]]:
    """The sublayer's tensors and shapes; names: the family's (up, down), (gate, up, down) or
    (gate_up, down) (families.Family.mlp); size: its width (0: c.mlp_size)."""
    d, F_ = c.d_model, size or c.mlp_size
    rows = {2: (2 * F_ if c.mlp_gated else F_,), 3: (F_, F_)}[len(names)]
    out = {norm: (d,)}
    for name, n in zip(names[:-1], rows):
        out[p + name + ".weight"] = (n, d)
        if c.mlp_bias:
            out[p + name + ".bias"] = (n,)
    out[p + names[-1] + ".weight"] = (d, F_)
    if c.mlp_bias:
        out[p + names[-1] + ".bias"] = (d,)
    return out


def layer_weights(norm: str, p: str, names: tuple[str, ...], big, small) -> MLPWeights:
    """The sublayer's weights: `big(name)` in the storage dtype, `small(name)` in float32 (None where absent)."""
    ins = names[:-1]
    biases = [small(p + n + ".bias") for n in ins]
    return MLPWeights(
        norm_w=small(norm),
        in_w=fp8.cat_rows([big(p + n + ".weight") for n in ins]),
        in_b=None if biases[0] is None else torch.cat(biases),
        out_w=big(p + names[-1] + ".weight"),
        out_b=small(p + names[-1] + ".bias"),
    )


def mlp(c, lw: MLPWeights, u: torch.Tensor, ops) -> torch.Tensor:
    """u (B, T, d) -> (B, T, d) f32."""
    a = ops.linear(u, lw.in_w, lw.in_b)
    h = ops.mlp_act(a, c.mlp_act, c.mlp_gated, fp8.operand_dtype(lw.out_w))
    return ops.linear(h, lw.out_w, lw.out_b)
