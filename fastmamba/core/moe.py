"""The mixture-of-experts sublayer over `Ops` (Granite-4.0-H with experts, Nemotron-H's "E"
layers, Jamba's): a router picks `experts_per_token` of `n_experts` MLPs for each token (gated
SiLU ones for Granite and Jamba, squared-ReLU ones for Nemotron-H, as the family's MLP), their
outputs are summed weighted by the router, and a shared MLP (mlp.py), where the family has
one, runs on every token and is added.

Routing in float32, as transformers does it (config.router): Granite's softmax over the top-k
logits ("softmax": `torch.topk`, so equal logits pick in transformers' order; renormalized: a
token's weights sum to 1); Jamba's top k of the softmax over all experts ("softmax_all": not
renormalized, a token's weights sum to less than 1); Nemotron-H's sigmoid scores, a correction
bias added for the choice alone, the choice limited to the best groups of experts, the picked
scores renormalized and scaled (kernels/moe.route_ref; on the GPU one launch, route_triton).
The experts are kept stacked, (E, 2 I, d) (gate's rows before up's) or (E, I, d), and
(E, d, I); a checkpoint that stores them one by one (Jamba's gate and up apart) is stacked
at load. The routed MLPs are the ops' (`Ops.moe`, kernels/moe.py): the
reference gathers each expert's tokens and runs one product an active expert (the host reads
the counts), the GPU ops' grouped Triton kernel runs every active expert in one launch a
matrix (no host sync); either way each (token, pick) pair's output lands in its own row, and
a token's picks are summed in pick order, so a token's output does not depend on which other
tokens share its experts (no atomics, no order that a batch changes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastmamba.core import fp8
from fastmamba.core import mlp as mlp_
from fastmamba.core.fp8 import Fp8Weight


@dataclass
class MoEWeights:
    norm_w: torch.Tensor  # (d,) f32
    # (E, d) f32: the routing is a discrete choice, so its logits keep float32 weights (a
    # rounded router would move tokens to other experts; it is E rows, small beside the experts)
    router_w: torch.Tensor
    in_w: torch.Tensor | Fp8Weight  # (E, 2 I, d) gated (gate's rows, then up's), (E, I, d) not; storage dtype
    out_w: torch.Tensor | Fp8Weight  # (E, d, I)
    shared_in: torch.Tensor | Fp8Weight | None = None  # the shared MLP's (mlp.MLPWeights' in_w, out_w)
    shared_out: torch.Tensor | Fp8Weight | None = None
    router_b: torch.Tensor | None = None  # (E,) f32: Nemotron-H's correction bias, for the choice alone


def shapes(c, norm: str, p: str, shared: str | None, names: tuple[str, ...], mlp_names: tuple[str, ...]) -> dict:
    """The sublayer's tensors and shapes; names: the family's (router, up (or gate_up), down)
    of the experts (families.Family.moe), stacked, or one tensor an expert where a name holds
    "{e}" (then also (router, gate, up, down)); mlp_names: its shared MLP's (families.Family.mlp)."""
    d, E, I = c.d_model, c.n_experts, c.expert_size
    router, *ins, down = names
    rows = 2 * I if c.mlp_gated and len(ins) == 1 else I
    out = {norm: (d,), p + router + ".weight": (E, d)}
    if c.router == "sigmoid":
        out[p + router + ".e_score_correction_bias"] = (E,)
    for name, shape in [*((n, (rows, d)) for n in ins), (down, (d, I))]:
        if "{e}" in name:
            out.update({p + name.format(e=e) + ".weight": shape for e in range(E)})
        else:
            out[p + name + ".weight"] = (E, *shape)
    if shared is not None:
        out.update(mlp_.shapes(c, norm, shared, mlp_names, c.shared_size))
    return out


def layer_weights(c, norm: str, p: str, shared: str | None, names: tuple[str, ...], mlp_names: tuple[str, ...],
                  big, small) -> MoEWeights:
    """The sublayer's weights: `big(name)` in the storage dtype, `small(name)` in float32;
    gate's and up's matrices (where the family names them apart) as one, gate's rows first."""
    router, *ins, down = names

    def experts(*names):
        if "{e}" not in names[0]:  # (stacked in the checkpoint: one matrix, gate's and up's rows in it)
            return big(p + names[0] + ".weight")
        return _stack([fp8.cat_rows([big(p + n.format(e=e) + ".weight") for n in names]) for e in range(c.n_experts)])

    lw = MoEWeights(norm_w=small(norm), router_w=small(p + router + ".weight"), in_w=experts(*ins),
                    out_w=experts(down), router_b=small(p + router + ".e_score_correction_bias"))
    if shared is not None:
        s = mlp_.layer_weights(norm, shared, mlp_names, big, small)
        lw.shared_in, lw.shared_out = s.in_w, s.out_w
    return lw


def _stack(matrices: list):
    """Experts' matrices as one stacked tensor (FP8 ones with their scales; FP8 ones beside
    16/32-bit ones, as float32 values, which the products read exactly)."""
    fp8 = [isinstance(m, Fp8Weight) for m in matrices]
    if any(isinstance(m, Fp8Weight) and m.block is not None for m in matrices):
        raise ValueError("experts' matrices with block scales cannot be stacked")
    if all(fp8):
        return Fp8Weight(torch.stack([m.data for m in matrices]), torch.stack([m.scale for m in matrices]))
    if any(fp8):
        return torch.stack([fp8.float32_values(m) for m in matrices])
    return torch.stack(matrices)


def route(c, lw: MoEWeights, x: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, d) -> each token's experts (N, k) int64 and their weights (N, k) f32: the router's
    product, then the ops' routing (kernels/moe.route_ref's)."""
    logits = ops.linear(x, lw.router_w).float()  # (N, E)
    return ops.route(logits, c.router, c.experts_per_token, lw.router_b, c.expert_groups, c.topk_groups, c.norm_topk,
                     c.routed_scaling)


def moe(c, lw: MoEWeights, u: torch.Tensor, ops) -> torch.Tensor:
    """u (B, T, d) -> (B, T, d) f32: the routed experts' weighted sum plus the shared MLP."""
    B, T, d = u.shape
    x = u.reshape(B * T, d)  # (N, d)
    experts, weights = route(c, lw, x, ops)  # (N, k), (N, k)
    shared = None
    if lw.shared_in is not None:  # (added in the routed sum's last launch)
        shared = mlp_.mlp(c, mlp_.MLPWeights(lw.norm_w, lw.shared_in, lw.shared_out), u, ops).reshape(B * T, d)
    out = ops.moe(x, experts, weights, lw.in_w, lw.out_w, c.mlp_act, c.mlp_gated, add=shared)  # (N, d) f32
    return out.view(B, T, d)
