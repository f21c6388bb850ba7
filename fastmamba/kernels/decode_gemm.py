"""The decode step for larger batches: cuBLAS products and three Triton kernels a layer.

From batch SMALL_BATCH + 1 up (unless deterministic), one step is, per layer:

    residual_rmsnorm   h += o (+ out bias); u = rmsnorm(h) * norm_w, in the storage dtype (rmsnorm.py)
    cuBLAS             xz = u @ in_proj.T                    (float32 out)
    conv_step          conv step + SiLU on x                 -> xc (f32), xc16 (storage)
    cuBLAS             dbc = xc16 @ x_proj.T; dt = dbc[:, :R] @ dt_proj.T   (float32 out)
    ssm_update         softplus, state update, D skip, gate  -> y16 (storage)
    cuBLAS             o = y16 @ out_proj.T                  (float32 out)

Why: at 32-256 rows a product reads each weight once for many rows, which is what cuBLAS's
tensor-core GEMMs do at close to the copy rate; the step's other traffic is the recurrent
state, streamed once by the two element-wise kernels. The activations meet the weights
rounded to the storage dtype (as in prefill) and every product accumulates in float32.
cuBLAS may pick its algorithm by the number of rows, so a slot's bits can depend on the
batch size here: `deterministic=True` keeps the Triton tile mode (decode_step.py) instead.
"""

from __future__ import annotations

import torch

from ._triton import jit, tl, triton
from .rmsnorm import residual_rmsnorm


# -- reference twins -------------------------------------------------------------------------


def conv_step_ref(x, conv_state, conv_w, conv_b):
    """x (B, E) -> SiLU(conv) (B, E) f32; shifts x into conv_state (B, E, K)."""
    from .causal_conv1d import causal_conv1d_ref

    return causal_conv1d_ref(x[:, :, None], conv_w, conv_b, conv_state)[:, :, 0]


def ssm_update_ref(dt, Bm, Cm, x, z, ssm_state, dt_bias, A, D):
    """One recurrence step from dt (B, E) before bias and softplus -> y (B, E) f32."""
    from .selective_scan import selective_scan_ref

    y = selective_scan_ref(x[..., None], dt[..., None], A, Bm[..., None], Cm[..., None], D, z[..., None], dt_bias, ssm_state)
    return y[..., 0]


# -- kernels -----------------------------------------------------------------------------------


@jit
def _conv_step_kernel(
    xz_ptr, cs_ptr, cw_ptr, cb_ptr, xc_ptr, xc16_ptr, B, E,
    K: tl.constexpr, KP: tl.constexpr, HAS_CB: tl.constexpr, BE: tl.constexpr,
):
    row = tl.program_id(1).to(tl.int64)
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    em = e < E
    kk = tl.arange(0, KP)
    win = cs_ptr + row * E * K + e[:, None] * K + kk[None, :]  # (BE, KP) this row's window
    old = tl.load(win + 1, mask=em[:, None] & (kk < K - 1)[None, :], other=0.0)  # the K-1 newest
    x = tl.load(xz_ptr + row * 2 * E + e, mask=em, other=0.0)
    new = tl.where((kk == K - 1)[None, :], x[:, None], old)  # the window after this step
    w = tl.load(cw_ptr + e[:, None] * K + kk[None, :], mask=em[:, None] & (kk < K)[None, :], other=0.0)
    conv = tl.sum(new * w, 1)
    if HAS_CB:
        conv += tl.load(cb_ptr + e, mask=em, other=0.0)
    tl.debug_barrier()  # the whole window is read before it is rewritten
    tl.store(win, new, mask=em[:, None] & (kk < K)[None, :])
    xc = conv * tl.sigmoid(conv)
    tl.store(xc_ptr + row * E + e, xc, mask=em)
    tl.store(xc16_ptr + row * E + e, xc.to(xc16_ptr.dtype.element_ty), mask=em)


@jit
def _ssm_update_kernel(
    dt_ptr, dbc_ptr, xc_ptr, xz_ptr, ss_ptr, dtb_ptr, A_ptr, D_ptr, y_ptr, B, E, R, J,
    N: tl.constexpr, NP: tl.constexpr, BE: tl.constexpr,
):
    row = tl.program_id(1).to(tl.int64)
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    em = e < E
    n = tl.arange(0, NP)
    nm = n < N
    dt = tl.load(dt_ptr + row * E + e, mask=em, other=0.0) + tl.load(dtb_ptr + e, mask=em, other=0.0)
    dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))  # softplus
    Bv = tl.load(dbc_ptr + row * J + R + n, mask=nm, other=0.0)
    Cv = tl.load(dbc_ptr + row * J + R + N + n, mask=nm, other=0.0)
    x = tl.load(xc_ptr + row * E + e, mask=em, other=0.0)
    z = tl.load(xz_ptr + row * 2 * E + E + e, mask=em, other=0.0)
    A = tl.load(A_ptr + e[:, None] * N + n[None, :], mask=em[:, None] & nm[None, :], other=0.0)
    sp = ss_ptr + row * E * N + e[:, None] * N + n[None, :]
    sm = em[:, None] & nm[None, :]
    s = tl.load(sp, mask=sm, other=0.0)
    s = s * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * Bv[None, :]
    tl.debug_barrier()  # every thread holding an element has read it before it is rewritten
    tl.store(sp, s, mask=sm)
    y = tl.sum(s * Cv[None, :], 1) + tl.load(D_ptr + e, mask=em, other=0.0) * x
    y = y * (z * tl.sigmoid(z))
    tl.store(y_ptr + row * E + e, y.to(y_ptr.dtype.element_ty), mask=em)


# -- launchers -----------------------------------------------------------------------------------


def gemm(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ weight.T in float32; a in the weight's dtype."""
    if weight.dtype == torch.float32:
        torch.mm(a, weight.t(), out=out)
    else:
        torch.mm(a, weight.t(), out_dtype=torch.float32, out=out)


def conv_step(xz, conv_state, conv_w, conv_b, xc, xc16) -> None:
    """x = xz[:, :E]; xc = SiLU(conv step), also written to xc16; updates conv_state."""
    B, E, K = conv_state.shape
    BE = 128
    _conv_step_kernel[(triton.cdiv(E, BE), B)](
        xz, conv_state, conv_w, conv_b if conv_b is not None else conv_w, xc, xc16, B, E,
        K=K, KP=triton.next_power_of_2(K), HAS_CB=conv_b is not None, BE=BE, num_warps=4,
    )


def ssm_update(dt, dbc, xc, xz, ssm_state, dt_bias, A, D, R, y) -> None:
    """y = gated output of one recurrence step (B and C from dbc[:, R:]); updates ssm_state."""
    B, E, N = ssm_state.shape
    BE = 64
    _ssm_update_kernel[(triton.cdiv(E, BE), B)](
        dt, dbc, xc, xz, ssm_state, dt_bias, A, D, y, B, E, R, dbc.shape[1],
        N=N, NP=triton.next_power_of_2(N), BE=BE, num_warps=4,
    )


class GemmDecodeStep:
    """One decode step for a fixed batch size through cuBLAS products; same interface as
    decode_step.DecodeStep (`__call__(tokens, state) -> logits`, `.logits`)."""

    def __init__(self, model, batch: int):
        c, w = model.config, model.weights
        dev, sdt = w.embedding.device, w.embedding.dtype
        self.model, self.B = model, batch
        d, E, N, R = c.d_model, c.d_inner, c.d_state, c.dt_rank
        f32 = dict(device=dev, dtype=torch.float32)
        self.h = torch.zeros(batch, d, **f32)
        self.o = torch.zeros(batch, d, **f32)
        self.u = torch.zeros(batch, d, device=dev, dtype=sdt)
        self.xz = torch.zeros(batch, 2 * E, **f32)
        self.xc = torch.zeros(batch, E, **f32)
        self.xc16 = torch.zeros(batch, E, device=dev, dtype=sdt)
        self.dbc = torch.zeros(batch, R + 2 * N, **f32)
        self.dtr16 = torch.zeros(batch, R, device=dev, dtype=sdt)
        self.dt = torch.zeros(batch, E, **f32)
        self.y16 = torch.zeros(batch, E, device=dev, dtype=sdt)
        self.logits = torch.zeros(batch, c.vocab_size, **f32)

    def __call__(self, tokens: torch.Tensor, state) -> torch.Tensor:
        c, w = self.model.config, self.model.weights
        R, eps = c.dt_rank, c.norm_eps
        torch.index_select(w.embedding, 0, tokens, out=self.u)  # u as scratch for the lookup
        self.h.copy_(self.u)
        prev = None  # the previous layer's out_proj bias, added with its output
        for i, lw in enumerate(w.layers):
            residual_rmsnorm(self.h, self.o if i else None, prev, lw.norm_w, eps, self.u)
            gemm(self.u, lw.in_proj_w, self.xz)
            if lw.in_proj_b is not None:
                self.xz += lw.in_proj_b
            conv_step(self.xz, state.conv[i], lw.conv_w, lw.conv_b, self.xc, self.xc16)
            gemm(self.xc16, lw.x_proj_w, self.dbc)
            self.dtr16.copy_(self.dbc[:, :R])
            gemm(self.dtr16, lw.dt_proj_w, self.dt)
            ssm_update(self.dt, self.dbc, self.xc, self.xz, state.ssm[i], lw.dt_bias, lw.A, lw.D, R, self.y16)
            gemm(self.y16, lw.out_proj_w, self.o)
            prev = lw.out_proj_b
        residual_rmsnorm(self.h, self.o, prev, w.norm_f, eps, self.u)
        gemm(self.u, w.lm_head, self.logits)
        return self.logits
