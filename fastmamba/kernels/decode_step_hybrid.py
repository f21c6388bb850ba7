"""A hybrid's decode step as one-row kernels (the plan's "one-row" step for Nemotron-H, Bamba,
Granite-4.0-H and Falcon-H1, with experts or without): Mamba-2's three kernels a layer
(decode_step_mamba2.py), and the attention, MLP and mixture-of-experts sublayers in the same
design, two to five launches each where their sublayers over the GPU ops take four to ten.

Per sublayer, for B slots (rows), with h + dh_in the residual stream as the sublayer's norm
reads it and dh_out its own output's share (fixed point, added by split-K programs):

    mamba2       rmsnorm_linear (in_proj), ssd_conv_step (folds dh_in into h),
                 gated_out_proj (-> dh_out)                                           3 launches
    attention    rmsnorm_linear (q, k and v in one product), paged_attention's three
                 kernels (rotate and store, attend in splits, combine), out_product
                 (o_proj -> dh_out; folds dh_in into h)                              5
    mlp          rmsnorm_linear (gate and up in one product), out_product (the
                 activation taken as the down product reads its input -> dh_out;
                 folds dh_in into h)                                                  2
    moe          rmsnorm_linear (the router), the routing, moe_in (the picks' and the
                 shared MLP's gate and up products), moe_out (their down products,
                 weighted -> dh_out; folds dh_in into h)                              4
    mamba2+attention (Falcon-H1: both mixers on one norm, their outputs summed)
                 rmsnorm_linear (in_proj and qkv, two matrices in one launch),
                 ssd_conv_step (folds), gated_out_proj, the attention's three,
                 out_product (o_proj; both add into dh_out)                           7

and around the sublayers the Mamba steps' embed (times the family's embedding multiplier)
and lm_head (its logits multiplier folded into the final norm's weights: the logits are
linear in them).

Why two pending shares that take turns: the Mamba steps fold dh into h in the kernel between
in_proj and out_proj, after the norm has read h + dh and before out_proj adds the next
share. An MLP has no kernel between its two products, so its down product folds the share
its norm read while it adds its own, and the two cannot be one buffer: each sublayer adds
into the share the sublayer before it read (folded and zeroed by then), and the next reads.

A row's result does not depend on the batch (every sum in a fixed order; the decode
attention's splits by the row's own length). The KV cache's books are the engine's: the
step stores each new key and value at its slot's length and advances the lengths on the
device, as the serving engine's CUDA graphs run it (kv_host=False).
"""

from __future__ import annotations

import torch

from ._triton import jit, tl, triton
from .activations import activate
from .decode_step_mamba2 import Mamba2DecodeStep
from .fp8_gemm import linear_ref, weight_parts
from .gemv import add_fixed, add_row_tile, fold_share, residual_tile, row_sums, row_total
from .mlp_activation import mlp_activation_ref
from .moe import route_triton
from .paged_attention import decode_attention
from .pdl import let_next_kernel_launch, wait_for_prior_kernel
from .rmsnorm import residual_rmsnorm_ref

# the sublayer kinds this step runs (core/layers.LAYER_KINDS' names); a model with others
# (Mamba-1 mixers) decodes through its layers over the GPU ops
ONE_ROW_KINDS = ("mamba2", "attention", "mlp", "mamba2+attention", "moe")

# -- a mixture of experts' sublayer, one row a program ---------------------------------------
# Four launches: the router's product (rmsnorm_linear, float32 weights), the routing
# (moe.route_triton), `moe_in` (the picked experts' gate and up products and the shared MLP's,
# each from h + dh through the norm, the activation in their epilogue: a[row, pick, :], the
# shared MLP's after the k picks) and `moe_out` (each pick's down product times its router
# weight, and the shared MLP's, added into dh in fixed point: exact in any order). Where the
# layers over the GPU ops took ten (the grouping of pairs by expert among them), which at one
# token a step was most of the sublayer's time.


def moe_in_ref(h, norm_w, eps, experts, in_w, shared_in, act: str, gated: bool) -> torch.Tensor:
    """h (B, d) f32 (the residual stream, its pending share added), experts (B, k) -> a (B, k +
    S, I') f32: act(gate) * up (or act(up)) of u = rmsnorm(h) * norm_w through each pick's
    in_w[e] (E, 2 I or I, d), then the shared MLP's (S = 1 where shared_in is given), zeros past
    a pick's own width in I' = max(I, the shared MLP's)."""
    u = residual_rmsnorm_ref(h, None, None, norm_w, eps)[1]
    outs = []
    for j in range(experts.shape[1]):
        picked = torch.cat([linear_ref(u[b : b + 1], in_w[e]) for b, e in enumerate(experts[:, j].tolist())])
        outs.append(mlp_activation_ref(picked, act, gated))
    if shared_in is not None:
        outs.append(mlp_activation_ref(linear_ref(u, shared_in), act, gated))
    width = max(o.shape[1] for o in outs)
    return torch.stack([torch.nn.functional.pad(o, (0, width - o.shape[1])) for o in outs], 1)


def moe_out_ref(a, experts, weights, out_w, shared_out) -> torch.Tensor:
    """a from moe_in -> (B, d) f32: each pick's down product out_w[e] (E, d, I) times its router
    weight, summed in pick order, then the shared MLP's down product."""
    k, I = experts.shape[1], weight_parts(out_w)[0].shape[2]
    out = 0.0
    for j in range(k):
        picked = torch.cat([linear_ref(a[b : b + 1, j, :I], out_w[e]) for b, e in enumerate(experts[:, j].tolist())])
        out = out + picked * weights[:, j : j + 1]
    if shared_out is not None:
        out = out + linear_ref(a[:, k, : weight_parts(shared_out)[0].shape[1]], shared_out)
    return out


@jit
def _pick_matrix(w_ptr, ws_ptr, sw_ptr, sws_ptr, ex_ptr, row64, j, SIZE, SROWS, I, IS, K: tl.constexpr):
    """Pick j of the row's K: its expert's matrix (stacked experts of SIZE elements and SROWS
    rows each: its values, its rows' scales) and width I; past the picks the shared MLP's
    (IS wide)."""
    if j < K:
        e = tl.load(ex_ptr + row64 * K + j)
        w = w_ptr + e * SIZE
        ws = ws_ptr + e * SROWS
        width = I
    else:
        w = sw_ptr
        ws = sws_ptr
        width = IS
    return w, ws, width


@jit
def _moe_in_kernel(
    h_ptr, dh_ptr, nw_ptr, ex_ptr, w_ptr, ws_ptr, sw_ptr, sws_ptr, a_ptr, D, I, IS, IP, eps,
    K: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, W_SCALED: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, MMA: tl.constexpr, PDL: tl.constexpr,
):
    # Program (row, pick j, BN of the pick's channels): a[row, j, c] = act(gate_c . u) * (up_c . u)
    # (or act(up_c . u)) for u = rmsnorm(h + dh) * nw, which, as rmsnorm_linear, it never holds:
    # the row's squares add up along the product's loop and scale the sums at the end.
    let_next_kernel_launch(PDL)
    rows = tl.program_id(0) + tl.arange(0, 1)  # the row, as a 1-vector: tiles are (1, n)
    row64 = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    R: tl.constexpr = 2 if GATED else 1  # a matrix's rows, in its width
    wait_for_prior_kernel(PDL)  # (the routing: which matrix comes only from it)
    w, ws, width = _pick_matrix(w_ptr, ws_ptr, sw_ptr, sws_ptr, ex_ptr, row64, j, R * I * D, R * I, I, IS, K)
    n = tl.program_id(2) * BN + tl.arange(0, BN)
    if tl.program_id(2) * BN >= width:  # (the grid covers the widest pick)
        return
    nmask = n < width
    acc = row_sums(BN, MMA)
    up = row_sums(BN, MMA)
    sq = tl.zeros([1, BK], dtype=tl.float32)
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        km = k < D
        hk = residual_tile(h_ptr, dh_ptr, rows[:, None] * D + k[None, :], km[None, :])
        sq += hk * hk
        x = hk * tl.load(nw_ptr + k, mask=km, other=0.0)[None, :]
        wm = nmask[:, None] & km[None, :]
        acc = add_row_tile(acc, x, tl.load(w + n[:, None] * D + k[None, :], mask=wm, other=0.0), MMA)
        if GATED:
            up = add_row_tile(up, x, tl.load(w + (width + n)[:, None] * D + k[None, :], mask=wm, other=0.0), MMA)
    rstd = 1.0 / tl.sqrt(tl.sum(sq, 1) / D + eps)  # (1,)
    acc = row_total(acc, MMA) * rstd[:, None]
    if W_SCALED:  # FP8 weights: each sum times its row's scale
        acc *= tl.load(ws + n, mask=nmask, other=0.0)[None, :]
    y = activate(acc, ACT)
    if GATED:
        up = row_total(up, MMA) * rstd[:, None]
        if W_SCALED:
            up *= tl.load(ws + width + n, mask=nmask, other=0.0)[None, :]
        y = y * up
    tl.store(a_ptr + (row64 * tl.num_programs(1) + j) * IP + n[None, :], y, mask=nmask[None, :])


@jit
def _moe_out_kernel(
    a_ptr, ex_ptr, rw_ptr, w_ptr, ws_ptr, sw_ptr, sws_ptr, dh_ptr, h_ptr, dhp_ptr, D, I, IS, IP, KCHUNK,
    K: tl.constexpr, SPLITS: tl.constexpr, W_SCALED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    BD: tl.constexpr, MMA: tl.constexpr, PDL: tl.constexpr,
):
    # Program (row, BN of the d outputs, pick j and split s of its width): dh[row, n] += weight_j
    # * a[row, j, split] @ W_j[n, split].T (the shared MLP's weight 1), in fixed point; first
    # it folds BD columns of the other pending share dhp into h (decode_step_hybrid's doc).
    let_next_kernel_launch(PDL)
    rows = tl.program_id(0) + tl.arange(0, 1)
    row64 = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < D
    j = tl.program_id(2) // SPLITS
    wait_for_prior_kernel(PDL)
    cols = (tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)) * BD + tl.arange(0, BD)
    fold_share(h_ptr, dhp_ptr, row64 * D + cols[None, :], (cols < D)[None, :])
    w, ws, width = _pick_matrix(w_ptr, ws_ptr, sw_ptr, sws_ptr, ex_ptr, row64, j, D * I, D, I, IS, K)
    k_start = (tl.program_id(2) % SPLITS) * KCHUNK
    if k_start >= width:  # (the splits cover the widest pick)
        return
    k_end = tl.minimum(k_start + KCHUNK, width)
    acc = row_sums(BN, MMA)
    for k0 in range(k_start, k_end, BK):
        k = k0 + tl.arange(0, BK)
        km = k < k_end
        x = tl.load(a_ptr + (row64 * (tl.num_programs(2) // SPLITS) + j) * IP + k[None, :], mask=km[None, :], other=0.0)
        wt = tl.load(w + n[:, None] * width + k[None, :], mask=nmask[:, None] & km[None, :], other=0.0)
        acc = add_row_tile(acc, x, wt, MMA)
    acc = row_total(acc, MMA)
    if W_SCALED:
        acc *= tl.load(ws + n, mask=nmask, other=0.0)[None, :]
    if j < K:  # (a pick: its router weight)
        acc *= tl.load(rw_ptr + row64 * K + j)
    add_fixed(dh_ptr + rows[:, None] * D + n[None, :], acc, nmask[None, :])


class HybridDecodeStep(Mamba2DecodeStep):
    """The one-row step of a hybrid of ONE_ROW_KINDS' sublayers (see the module's doc): Mamba-2's
    step's buffers, kernels and launch settings; the attention's and MLP's products take
    in_proj's settings (rmsnorm_linear) and out_proj's (out_product)."""

    def __init__(self, model, batch: int, plan, paged_tiles):
        c = model.config
        other = sorted(set(c.kinds) - set(ONE_ROW_KINDS))
        if other:
            raise ValueError(f"the one-row hybrid step runs {', '.join(ONE_ROW_KINDS)} sublayers, "
                             f"not {', '.join(other)}")
        super().__init__(model, batch, plan)
        dev, f32 = model.weights.embedding.device, torch.float32
        self.paged_tiles = paged_tiles
        self.dh2 = torch.zeros_like(self.dh)  # the second pending share (see the module's doc)
        if c.n_attention:
            self.qkv = torch.zeros(batch, (c.attn_heads + 2 * c.kv_heads) * c.attn_head_dim, device=dev, dtype=f32)
            self.rows = torch.arange(batch, device=dev)  # (the slots: the pool's first rows)
        if "mlp" in c.kinds:
            self.mlp_in = torch.zeros(batch, (2 if c.mlp_gated else 1) * c.mlp_size, device=dev, dtype=f32)
        if "moe" in c.kinds:
            lw = next(lw for kind, lw in zip(c.kinds, model.weights.layers) if kind == "moe")
            shared = lw.shared_in is not None
            if shared and (weight_parts(lw.shared_in)[1] is None) != (weight_parts(lw.in_w)[1] is None):
                raise ValueError("the one-row step's experts and shared MLP take one kind of weights (FP8 or not)")
            self.moe_width = max(c.expert_size, (c.shared_size or c.mlp_size) if shared else 0)
            self.router_logits = torch.zeros(batch, c.n_experts, device=dev, dtype=f32)
            self.moe_a = torch.zeros(batch, c.experts_per_token + shared, self.moe_width, device=dev, dtype=f32)
            # (the experts' products in the plan's settings, else in_proj's and out_proj's)
            self.moe_in_blocks = plan.blocks.moe_in or self.in_proj_blocks[:3]
            self.moe_out_blocks = plan.blocks.moe_out or self.out_proj_blocks
        w = model.weights
        self.norm_f = w.norm_f * c.logits_multiplier if c.logits_multiplier != 1.0 else w.norm_f

    def attend(self, lw, kv, layer: int) -> torch.Tensor:
        """The new tokens' queries and keys (in qkv) rotated, their keys and values stored at
        their slots' lengths, each query against its slot's context -> (B, H hd) f32."""
        c = self.model.config
        scale = c.attn_scale or c.attn_head_dim**-0.5
        return decode_attention(self.qkv, kv.k[layer], kv.v[layer], kv.table, kv.lengths, self.rows, c.attn_heads,
                                scale, c.rope_theta, c.rotary_dim, tiles=self.paged_tiles)

    def moe(self, lw, dh_in, dh_out) -> None:
        """A mixture of experts' sublayer in four launches (see moe_in_ref, moe_out_ref):
        dh_out += its output; folds dh_in into h."""
        c = self.model.config
        k, D, shared = c.experts_per_token, c.d_model, lw.shared_in is not None
        # (the router's float32 weights: the multiply-and-sum, as the routing's logits need)
        self._rmsnorm_linear(lw.norm_w, lw.router_w, None, self.router_logits, self.plan.blocks.router, dh=dh_in)
        experts, weights = route_triton(self.router_logits, c.router, k, lw.router_b, c.expert_groups,
                                        c.topk_groups, c.norm_topk, c.routed_scaling)
        (w1, s1), (w2, s2) = weight_parts(lw.in_w), weight_parts(lw.out_w)
        (v1, t1), (v2, t2) = ((weight_parts(lw.shared_in), weight_parts(lw.shared_out)) if shared
                              else ((w1, s1), (w2, s2)))
        I, IS, picks = w2.shape[2], v2.shape[1] if shared else 0, k + shared
        BN, BK, warps = self.moe_in_blocks
        _moe_in_kernel[(self.B, picks, triton.cdiv(self.moe_width, BN))](
            self.h, dh_in, lw.norm_w, experts, w1, w1 if s1 is None else s1, v1, v1 if t1 is None else t1, self.moe_a,
            D, I, IS, self.moe_width, c.norm_eps, K=k, ACT=c.mlp_act, GATED=c.mlp_gated, W_SCALED=s1 is not None,
            BN=BN, BK=BK, MMA=self.in_proj_mma, num_warps=warps, **self.pdl_for("rmsnorm_linear"),
        )
        BN, BK, warps, _ = self.moe_out_blocks
        splits, chunk = self.split_k(self.moe_width, picks, self.moe_out_blocks)
        tiles = triton.cdiv(D, BN)
        BD = triton.next_power_of_2(triton.cdiv(D, tiles * picks * splits))
        _moe_out_kernel[(self.B, tiles, picks * splits)](
            self.moe_a, experts, weights, w2, w2 if s2 is None else s2, v2, v2 if t2 is None else t2, dh_out, self.h,
            dh_in, D, I, IS, self.moe_width, chunk, K=k, SPLITS=splits, W_SCALED=s2 is not None, BN=BN,
            BK=BK, BD=BD, MMA=self.out_proj_mma, num_warps=warps, **self.pdl_for("out_proj_residual"),
        )

    def __call__(self, tokens: torch.Tensor, state, argmax: bool = False, h: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B,) -> logits (B, V) f32; updates `state` (its Mamba states, and its KV
        cache's first B slots, their lengths advanced by one). With argmax, take_argmax must
        follow (see DecodeStep)."""
        assert h is None, "a hybrid's step takes tokens"
        kv = state.kv
        if kv is not None and state.kv_host:
            raise ValueError("the one-row hybrid step stores keys and values in slots 0 .. B-1 with their blocks "
                             "reserved by the engine (a state with kv_host=False), as the engine's CUDA graphs run it")
        c, w = self.model.config, self.model.weights
        self.embed(tokens.contiguous(), dh2=self.dh2, mult=c.embedding_multiplier)
        dh_in, dh_out = self.dh, self.dh2
        # (each sublayer's recurrent state's index among the Mamba sublayers, its KV cache's
        # among the attention ones: the model's own, core/model.Mamba.memory_at)
        for kind, lw, (r, a) in zip(c.kinds, w.layers, self.model.memory_at):
            linear = dict(blocks=self.in_proj_blocks, sum_last=self.sum_last, unroll=self.in_proj_unroll,
                          mma=self.in_proj_mma, dh=dh_in)
            if kind == "mamba2":
                self._rmsnorm_linear(lw.norm_w, lw.in_proj_w, lw.in_proj_b, self.zxbcdt, **linear)
                self.ssd_conv_step(lw, state.conv[r], state.ssm[r], fold=dh_in)
                self.gated_out_proj(lw, state.conv[r], dh=dh_out)
            elif kind == "attention":
                self._rmsnorm_linear(lw.norm_w, lw.qkv_w, lw.qkv_b, self.qkv, **linear)
                self.out_product(self.attend(lw, kv, a), lw.o_w, lw.o_b, dh_out, fold=dh_in)
            elif kind == "moe":
                self.moe(lw, dh_in, dh_out)
            elif kind == "mlp":
                self._rmsnorm_linear(lw.norm_w, lw.in_w, lw.in_b, self.mlp_in, **linear)
                self.out_product(self.mlp_in, lw.out_w, lw.out_b, dh_out, act=c.mlp_act, gated=c.mlp_gated, fold=dh_in)
            else:  # mamba2+attention: both read h + dh_in before ssd_conv_step folds it
                m, at = lw.mamba, lw.attention
                self._rmsnorm_linear(lw.norm_w, m.in_proj_w, m.in_proj_b, self.zxbcdt,
                                     also=(at.qkv_w, at.qkv_b, self.qkv), **linear)
                self.ssd_conv_step(m, state.conv[r], state.ssm[r], fold=dh_in)
                self.gated_out_proj(m, state.conv[r], dh=dh_out)
                self.out_product(self.attend(at, kv, a), at.o_w, at.o_b, dh_out)
            dh_in, dh_out = dh_out, dh_in
        if kv is not None:
            kv.lengths[: self.B] += 1
        self.lm_head(argmax, norm_f=self.norm_f, dh=dh_in)
        return self.logits[: self.B]
