"""The mixture-of-experts sublayer over `Ops` (Granite-4.0-H with experts): a router picks
`experts_per_token` of `n_experts` gated SiLU MLPs for each token, their outputs are summed
weighted by the softmax of the picked logits, and a shared MLP (mlp.py) runs on every token
and is added.

Routing: the router's logits in float32, `torch.topk` (transformers' tie order: equal
logits pick as torch.topk does), the softmax over the k picked logits (Granite renormalizes:
the weights of a token sum to 1). The experts are stored stacked, gate's rows before up's:
(E, 2 I, d) and (E, d, I). A pass gathers each expert's tokens and runs one product an
active expert; each (token, pick) pair's output lands in its own row, and a token's picks
are summed in pick order, so a token's output does not depend on which other tokens share
its experts (no atomics, no order that a batch changes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastmamba.core import mlp as mlp_
from fastmamba.core.fp8 import Fp8Weight


@dataclass
class MoEWeights:
    norm_w: torch.Tensor  # (d,) f32
    # (E, d) f32: the routing is a discrete choice, so its logits keep float32 weights (a
    # rounded router would move tokens to other experts; it is E rows, small beside the experts)
    router_w: torch.Tensor
    in_w: torch.Tensor | Fp8Weight  # (E, 2 I, d) gate's rows then up's; storage dtype
    out_w: torch.Tensor | Fp8Weight  # (E, d, I)
    shared_in: torch.Tensor | Fp8Weight | None = None  # the shared MLP's (mlp.MLPWeights' in_w, out_w)
    shared_out: torch.Tensor | Fp8Weight | None = None


def shapes(c, norm: str, p: str, shared: str | None, names: tuple[str, ...], mlp_names: tuple[str, ...]) -> dict:
    """The sublayer's tensors and shapes; names: the family's (router, gate_up, down) of the
    experts (families.Family.moe), mlp_names: its shared MLP's (families.Family.mlp)."""
    d, E, I = c.d_model, c.n_experts, c.expert_size
    router, gate_up, down = names
    out = {norm: (d,), p + router + ".weight": (E, d), p + gate_up + ".weight": (E, 2 * I, d),
           p + down + ".weight": (E, d, I)}
    if shared is not None:
        out.update(mlp_.shapes(c, norm, shared, mlp_names))
    return out


def layer_weights(norm: str, p: str, shared: str | None, names: tuple[str, ...], mlp_names: tuple[str, ...],
                  big, small) -> MoEWeights:
    """The sublayer's weights: `big(name)` in the storage dtype, `small(name)` in float32."""
    router, gate_up, down = names
    lw = MoEWeights(norm_w=small(norm), router_w=small(p + router + ".weight"), in_w=big(p + gate_up + ".weight"),
                    out_w=big(p + down + ".weight"))
    if shared is not None:
        s = mlp_.layer_weights(norm, shared, mlp_names, big, small)
        lw.shared_in, lw.shared_out = s.in_w, s.out_w
    return lw


def route(c, lw: MoEWeights, x: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, d) -> each token's experts (N, k) int64 and their weights (N, k) f32."""
    logits = ops.linear(x, lw.router_w).float()  # (N, E)
    top, experts = logits.topk(c.experts_per_token, dim=-1)  # (N, k)
    return experts, torch.softmax(top, dim=-1)


def moe(c, lw: MoEWeights, u: torch.Tensor, ops) -> torch.Tensor:
    """u (B, T, d) -> (B, T, d) f32: the routed experts' weighted sum plus the shared MLP."""
    B, T, d = u.shape
    x = u.reshape(B * T, d)  # (N, d)
    experts, weights = route(c, lw, x, ops)  # (N, k), (N, k)
    k, I = c.experts_per_token, c.expert_size
    act = mlp_.ACTIVATIONS[c.mlp_act]
    pairs = experts.flatten()  # (N k,) pair n * k + j: token n's j-th pick
    order = torch.argsort(pairs, stable=True)  # the pairs grouped by expert, each group in token order
    counts = torch.bincount(pairs, minlength=c.n_experts).tolist()  # (the host learns each expert's rows)
    y = torch.zeros(pairs.shape[0], d, dtype=torch.float32, device=u.device)  # (N k, d) a row a pair
    at = 0
    for e, n in enumerate(counts):
        if n == 0:  # (an expert no token picked: no product)
            continue
        rows = order[at : at + n]  # (n,)
        at += n
        gate, up = ops.linear(x[rows // k], lw.in_w[e]).split(I, dim=-1)  # (n, I) each
        y[rows] = ops.linear(act(gate) * up, lw.out_w[e]).float()
    y = y.view(-1, k, d)
    routed = y[:, 0] * weights[:, :1]
    for j in range(1, k):  # (in pick order: the same sum whatever the batch)
        routed = routed + y[:, j] * weights[:, j : j + 1]
    out = routed.view(B, T, d)
    if lw.shared_in is not None:
        out = out + mlp_.mlp(c, mlp_.MLPWeights(lw.norm_w, lw.shared_in, lw.shared_out), u, ops)
    return out
