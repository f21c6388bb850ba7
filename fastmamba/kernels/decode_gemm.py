"""The decode step for larger batches, and the deterministic one: products and four Triton
kernels a layer (where it runs: the engine's plan table, engine/plan.py).

One step is, per layer (each product through cuBLAS or through products.py's Triton GEMM,
as the plan says):

    residual_rmsnorm   h += o (+ out bias); u = rmsnorm(h) * norm_w, in the storage dtype (rmsnorm.py)
    cuBLAS             xz = u @ in_proj.T                    (float32 out)
    conv_step          conv step + SiLU on x                 -> xc (f32), xc16 (storage)
    cuBLAS             dbc = xc16 @ x_proj.T                 (float32 out)
    dbc_rows           dbc's first R columns in the storage dtype
    cuBLAS             dt = dbc[:, :R] @ dt_proj.T           (float32 out)
    ssm_update         softplus, state update, D skip, gate  -> y16 (storage)
    cuBLAS             o = y16 @ out_proj.T                  (float32 out)

Why: at 32-256 rows a product reads each weight once for many rows, which is what cuBLAS's
tensor-core GEMMs do at close to the copy rate; the step's other traffic is the recurrent
state, streamed once by the two element-wise kernels. With 16-bit weights each product's
operand is rounded once to the storage dtype (the numerical contract, docs/architecture.md),
or enters as two 16-bit halves that keep about 16 bits where the plan says
(DecodePlan.halves, split16.py). Every product accumulates in float32.
cuBLAS may pick its algorithm by the number of rows, so a slot's bits can depend on the
batch size. products.py's products never do, and the element-wise kernels treat each row alone
either way, so with them a slot's logits are bitwise the same in any batch:
`deterministic=True` runs them at every batch size, and the default plan wherever they
beat cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton
from .activations import silu, softplus
from .causal_conv1d import causal_conv1d_ref
from .fp8_gemm import fp8_linear, operand_dtype, weight_parts
from .pdl import NO_PDL, pdl_launch, wait_for_prior_kernel
from .products import cublas_gemm, invariant_gemm, split_count
from .rmsnorm import residual_rmsnorm
from .selective_scan import selective_scan_ref
from .split16 import load_sum, store_split

# -- reference twins -------------------------------------------------------------------------


def conv_step_ref(x, conv_state, conv_w, conv_b):
    """x (B, E) -> SiLU(conv) (B, E) f32; shifts x into conv_state (B, E, K)."""
    return causal_conv1d_ref(x[:, :, None], conv_w, conv_b, conv_state)[:, :, 0]


def ssm_update_ref(dt, Bm, Cm, x, z, ssm_state, dt_bias, A, D):
    """One recurrence step from dt (B, E) before bias and softplus -> y (B, E) f32."""
    delta = F.softplus(dt.float() + dt_bias)
    y = selective_scan_ref(x[..., None], delta[..., None], A, Bm[..., None], Cm[..., None], D, z[..., None], ssm_state)
    return y[..., 0]


# -- kernels -----------------------------------------------------------------------------------


@jit
def _conv_step_kernel(
    xz_ptr, cs_ptr, cw_ptr, cb_ptr, xc_ptr, xc16_ptr, B, E,
    K: tl.constexpr, KP: tl.constexpr, HAS_CB: tl.constexpr, XZ_PARTS: tl.constexpr, SPLIT: tl.constexpr, BE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)
    row = tl.program_id(1).to(tl.int64)
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    em = e < E
    kk = tl.arange(0, KP)
    win = cs_ptr + row * E * K + e[:, None] * K + kk[None, :]  # (BE, KP) this row's window
    old = tl.load(win + 1, mask=em[:, None] & (kk < K - 1)[None, :], other=0.0).to(tl.float32)  # the K-1 newest
    x = load_sum(xz_ptr, row * 2 * E + e, B * 2 * E, em, XZ_PARTS)
    new = tl.where((kk == K - 1)[None, :], x[:, None], old)  # the window after this step
    w = tl.load(cw_ptr + e[:, None] * K + kk[None, :], mask=em[:, None] & (kk < K)[None, :], other=0.0)
    conv = tl.sum(new * w, 1)
    if HAS_CB:
        conv += tl.load(cb_ptr + e, mask=em, other=0.0)
    tl.debug_barrier()  # the whole window is read before it is rewritten
    tl.store(win, new.to(cs_ptr.dtype.element_ty), mask=em[:, None] & (kk < K)[None, :])  # x rounded once to a 16-bit state
    xc = silu(conv)
    tl.store(xc_ptr + row * E + e, xc, mask=em)
    store_split(xc16_ptr, row * E + e, xc, B * E, em, SPLIT)


@jit
def _dbc_kernel(
    raw_ptr, dbc_ptr, dtr_ptr, B, J, R, N, eps,
    RAW_PARTS: tl.constexpr, SPLIT: tl.constexpr, BJ: tl.constexpr, DBC_NORM: tl.constexpr, PDL: tl.constexpr,
):
    # x_proj's float32 result (its parts added) -> dbc; its first R columns -> dt_proj's operand
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BJ)
    v = load_sum(raw_ptr, row * J + j, B * J, j < J, RAW_PARTS)
    if DBC_NORM:  # Falcon-Mamba: dt_r, B and C each over its rms (lanes past J hold 0)
        is_dt, is_b = j < R, (j >= R) & (j < R + N)
        sq = v * v
        inv_dt = tl.rsqrt(tl.sum(tl.where(is_dt, sq, 0.0), 0) / R + eps)
        inv_b = tl.rsqrt(tl.sum(tl.where(is_b, sq, 0.0), 0) / N + eps)
        inv_c = tl.rsqrt(tl.sum(tl.where(j >= R + N, sq, 0.0), 0) / N + eps)
        v = v * tl.where(is_dt, inv_dt, tl.where(is_b, inv_b, inv_c))
    tl.store(dbc_ptr + row * J + j, v, mask=j < J)
    store_split(dtr_ptr, row * R + j, v, B * R, j < R, SPLIT)


@jit
def _ssm_update_kernel(
    dt_ptr, dbc_ptr, xc_ptr, xz_ptr, ss_ptr, dtb_ptr, A_ptr, D_ptr, y_ptr, B, E, R, J,
    N: tl.constexpr, NP: tl.constexpr, DT_PARTS: tl.constexpr, XZ_PARTS: tl.constexpr, Y_HALVES: tl.constexpr, BE: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(1).to(tl.int64)
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    em = e < E
    n = tl.arange(0, NP)
    nm = n < N
    # Before the wait: the layer's state (this kernel's own, from the last step) and constants.
    A = tl.load(A_ptr + e[:, None] * N + n[None, :], mask=em[:, None] & nm[None, :], other=0.0)
    sp = ss_ptr + row * E * N + e[:, None] * N + n[None, :]
    sm = em[:, None] & nm[None, :]
    s = tl.load(sp, mask=sm, other=0.0).to(tl.float32)  # (the state may be 16-bit)
    wait_for_prior_kernel(PDL)
    dt = load_sum(dt_ptr, row * E + e, B * E, em, DT_PARTS) + tl.load(dtb_ptr + e, mask=em, other=0.0)
    dt = softplus(dt)
    Bv = tl.load(dbc_ptr + row * J + R + n, mask=nm, other=0.0)
    Cv = tl.load(dbc_ptr + row * J + R + N + n, mask=nm, other=0.0)
    x = tl.load(xc_ptr + row * E + e, mask=em, other=0.0)
    z = load_sum(xz_ptr, row * 2 * E + E + e, B * 2 * E, em, XZ_PARTS)
    s = s * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * Bv[None, :]
    tl.debug_barrier()  # every thread holding an element has read it before it is rewritten
    tl.store(sp, s.to(ss_ptr.dtype.element_ty), mask=sm)
    y = tl.sum(s * Cv[None, :], 1) + tl.load(D_ptr + e, mask=em, other=0.0) * x
    y = y * silu(z)
    store_split(y_ptr, row * E + e, y, B * E, em, Y_HALVES)


# -- launchers -----------------------------------------------------------------------------------
# *_halves: a 16-bit operand written as two halves in rows [0, B) and [B, 2B) (split16.py).
# *_parts: how many B-row blocks a product's float32 result comes in, for the consumer to add
# up (2 for an operand in halves, times the K chunks products.py's products write apart).
# pdl: launch options from pdl.pdl_launch (default: a plain launch).
# block: (channels a program, warps) of the two element-wise kernels that stream the state
# (the plan's ProductsBlocks).


def conv_step(xz, conv_state, conv_w, conv_b, xc, xc16, xc16_halves=False, xz_parts=1, pdl=NO_PDL, *,
              block: tuple[int, int]) -> None:
    """x = xz[:, :E]; xc = SiLU(conv step), also written to xc16; updates conv_state."""
    B, E, K = conv_state.shape
    BE, warps = block
    _conv_step_kernel[(triton.cdiv(E, BE), B)](
        xz, conv_state, conv_w, conv_b if conv_b is not None else conv_w, xc, xc16, B, E,
        K=K, KP=triton.next_power_of_2(K), HAS_CB=conv_b is not None, XZ_PARTS=xz_parts, SPLIT=xc16_halves,
        BE=BE, num_warps=warps, **pdl,
    )


def dbc_rows(raw, dbc, dtr, dtr_halves=False, raw_parts=1, pdl=NO_PDL, norm_eps=None) -> None:
    """dbc = x_proj's result (B, R+2N) f32; dtr = its first R columns in dtr's dtype.
    norm_eps (Falcon-Mamba): dt_r, B and C each RMS-normalised with this eps first."""
    B, J = dbc.shape
    R = dtr.shape[1]
    _dbc_kernel[(B,)](
        raw, dbc, dtr, B, J, R, (J - R) // 2, norm_eps or 0.0, RAW_PARTS=raw_parts, SPLIT=dtr_halves,
        BJ=triton.next_power_of_2(J), DBC_NORM=norm_eps is not None, num_warps=1, **pdl,
    )


def ssm_update(dt, dbc, xc, xz, ssm_state, dt_bias, A, D, R, y, y_halves=False, dt_parts=1, xz_parts=1, pdl=NO_PDL, *,
               block: tuple[int, int]) -> None:
    """y = gated output of one recurrence step (B and C from dbc[:, R:]); updates ssm_state."""
    B, E, N = ssm_state.shape
    BE, warps = block
    _ssm_update_kernel[(triton.cdiv(E, BE), B)](
        dt, dbc, xc, xz, ssm_state, dt_bias, A, D, y, B, E, R, dbc.shape[1],
        N=N, NP=triton.next_power_of_2(N), DT_PARTS=dt_parts, XZ_PARTS=xz_parts,
        Y_HALVES=y_halves, BE=BE, num_warps=warps, **pdl,
    )


# The step's products, by the names the plan's `cublas`, `splits` and `halves` use.
PRODUCTS = ("in_proj", "x_proj", "dt_proj", "out_proj", "lm_head")


class GemmDecodeStep:
    """One decode step for a fixed batch size, each projection one matrix product: through
    cuBLAS where `plan.cublas` names it, else through products.invariant_gemm, whose rows'
    bits do not depend on the batch size (every other kernel here treats each row alone).
    plan: the engine's decode plan (engine/plan.py's DecodePlan: cublas, splits, halves, pdl,
    products_blocks). Same interface as decode_step.DecodeStep (`__call__(tokens, state) ->
    logits`, `.logits`)."""

    def __init__(self, model, batch: int, plan):
        c, w = model.config, model.weights
        dev, sdt = w.embedding.device, w.embedding.dtype
        self.model, self.B, self.plan = model, batch, plan
        self.cublas_products = set(plan.cublas)  # the rest through invariant_gemm
        self.splits = dict(plan.splits)
        # FP8 projections (fp8_gemm.py): their operands in bfloat16, the e4m3 values widened
        # exactly in invariant_gemm's programs (or, for a product the plan puts on cuBLAS,
        # quantized a row to e4m3 for cuBLASLt's FP8 GEMM: fp8_linear); a head left in
        # float32 (tied to the embedding) keeps a float32 operand
        fp8 = weight_parts(w.layers[0].in_proj_w)[1] is not None if w.layers else False
        if fp8:
            names = [n for n in ("in_proj_w", "x_proj_w", "dt_proj_w", "out_proj_w")
                     if any(weight_parts(getattr(lw, n))[1] is None for lw in w.layers)]
            if names:
                raise ValueError(f"the products step takes FP8 weights with every projection in FP8; not: {names}")
            sdt = torch.bfloat16
        head_dtype = operand_dtype(w.lm_head) if fp8 else sdt
        # the products whose 16-bit operand comes in two halves, B rows each (split16.py)
        self.halves = plan.halves if sdt != torch.float32 and not fp8 else frozenset()
        d, E, N, R = c.d_model, c.d_inner, c.d_state, c.dt_rank
        self.rows = rows = {p: 2 * batch if p in self.halves else batch for p in PRODUCTS}  # each product's operand rows
        # the K chunks each product's result comes in (plan.splits)
        K = dict(in_proj=d, x_proj=E, dt_proj=R, out_proj=E, lm_head=d)
        self.chunks = {p: 1 if p in self.cublas_products else split_count(K[p], self.splits[p]) for p in K}
        assert self.chunks["lm_head"] == 1
        # each result's B-row blocks, for its consumer to add up
        self.parts = {p: n * rows[p] // batch for p, n in self.chunks.items()}
        f32 = dict(device=dev, dtype=torch.float32)
        self.h = torch.zeros(batch, d, **f32)
        self.o = torch.zeros(self.parts["out_proj"] * batch, d, **f32)
        self.u = torch.zeros(max(rows["in_proj"], rows["lm_head"]), d, device=dev, dtype=sdt)
        # lm_head's operand: u itself, or its own buffer where the head reads another dtype
        self.u_head = self.u if head_dtype == sdt else torch.zeros(rows["lm_head"], d, device=dev, dtype=head_dtype)
        self.xz = torch.zeros(self.parts["in_proj"] * batch, 2 * E, **f32)
        self.xc = torch.zeros(batch, E, **f32)
        self.xc16 = torch.zeros(rows["x_proj"], E, device=dev, dtype=sdt)
        self.dbc_raw = torch.zeros(self.parts["x_proj"] * batch, R + 2 * N, **f32)
        self.dbc = torch.zeros(batch, R + 2 * N, **f32)
        self.dtr16 = torch.zeros(rows["dt_proj"], R, device=dev, dtype=sdt)
        self.dt = torch.zeros(self.parts["dt_proj"] * batch, E, **f32)
        self.y16 = torch.zeros(rows["out_proj"], E, device=dev, dtype=sdt)
        self.logits_raw = torch.zeros(2 * batch, c.vocab_size, **f32) if "lm_head" in self.halves else None
        self.logits = torch.zeros(batch, c.vocab_size, **f32)
        self.pdl = pdl_launch(dev) if plan.pdl else NO_PDL

    def product(self, name: str, a: torch.Tensor, weight, out: torch.Tensor) -> None:
        values, scale = weight_parts(weight)
        if name not in self.cublas_products:
            invariant_gemm(a, values, out, self.splits[name], self.pdl, scale=scale)
        elif scale is not None:  # (cuBLASLt's row-wise FP8 GEMM writes no float32: its bfloat16, widened in the copy)
            fp8_linear(a, values, scale, out=out)
        else:
            cublas_gemm(a, weight, out)

    def __call__(self, tokens: torch.Tensor, state, h: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B,) -> logits (B, V) f32; h (B, d) f32: vectors in place of the embedding
        lookup (fastmamba.Backbone's step; tokens unused)."""
        c, w = self.model.config, self.model.weights
        R, eps, B, halves, parts, pdl = c.dt_rank, c.norm_eps, self.B, self.halves, self.parts, self.pdl
        blocks = self.plan.products_blocks
        u_in, u_head = self.u[: self.rows["in_proj"]], self.u_head[: self.rows["lm_head"]]
        if h is None and w.embedding.dtype == self.h.dtype:  # (a float32 embedding: FP8 weights')
            torch.index_select(w.embedding, 0, tokens, out=self.h)
        else:
            if h is None:
                torch.index_select(w.embedding, 0, tokens, out=self.u[:B])  # u as scratch for the lookup
                h = self.u[:B]
            self.h.copy_(h)
        prev = None  # the previous layer's out_proj bias, added with its output
        for i, lw in enumerate(w.layers):
            residual_rmsnorm(self.h, self.o if i else None, prev, lw.norm_w, eps, u_in, o_parts=parts["out_proj"],
                             u_halves="in_proj" in halves, pdl=pdl)
            self.product("in_proj", u_in, lw.in_proj_w, self.xz)
            if lw.in_proj_b is not None:
                self.xz[:B] += lw.in_proj_b
            conv_step(self.xz, state.conv[i], lw.conv_w, lw.conv_b, self.xc, self.xc16, "x_proj" in halves, parts["in_proj"], pdl,
                      block=blocks.conv_step)
            self.product("x_proj", self.xc16, lw.x_proj_w, self.dbc_raw)
            dbc_rows(self.dbc_raw, self.dbc, self.dtr16, "dt_proj" in halves, parts["x_proj"], pdl, c.dbc_norm_eps)
            self.product("dt_proj", self.dtr16, lw.dt_proj_w, self.dt)
            ssm_update(
                self.dt, self.dbc, self.xc, self.xz, state.ssm[i], lw.dt_bias, lw.A, lw.D, R, self.y16,
                y_halves="out_proj" in halves, dt_parts=parts["dt_proj"], xz_parts=parts["in_proj"], pdl=pdl,
                block=blocks.ssm_update,
            )
            self.product("out_proj", self.y16, lw.out_proj_w, self.o)
            prev = lw.out_proj_b
        residual_rmsnorm(self.h, self.o, prev, w.norm_f, eps, u_head, o_parts=parts["out_proj"],
                         u_halves="lm_head" in halves, pdl=pdl)
        if self.logits_raw is not None:
            self.product("lm_head", u_head, w.lm_head, self.logits_raw)
            torch.add(self.logits_raw[:B], self.logits_raw[B:], out=self.logits)
        else:
            self.product("lm_head", u_head, w.lm_head, self.logits)
        return self.logits
