"""The decode step for larger batches: cuBLAS products and four Triton kernels a layer.

From batch SMALL_BATCH + 1 up (unless deterministic), one step is, per layer:

    residual_rmsnorm   h += o (+ out bias); u = rmsnorm(h) * norm_w, in the storage dtype (rmsnorm.py)
    cuBLAS             xz = u @ in_proj.T                    (float32 out)
    conv_x_proj        conv step + SiLU on x -> xc (f32); each block of channels' share of
                       xc @ x_proj.T                         -> partial sums (f32)
    dbc_rows           the partial sums added up -> dbc; its first R columns in the storage dtype
    cuBLAS             dt = dbc[:, :R] @ dt_proj.T           (float32 out)
    ssm_update         softplus, state update, D skip, gate  -> y16 (storage)
    cuBLAS             o = y16 @ out_proj.T                  (float32 out)

Why: at 32-256 rows a product reads each weight once for many rows, which is what cuBLAS's
tensor-core GEMMs do at close to the copy rate; the step's other traffic is the recurrent
state, streamed once by the element-wise kernels. x_proj is small (R + 2N outputs) and
needs only the conv step's output, so the conv step's programs multiply their own channels
by x_proj's columns on the tensor cores (16-row tiles, decode_step's _mm) and leave a
partial sum a block of channels, which dbc_rows adds up in a fixed order: no product
launch and no conv output written in 16 bits and read back. With 16-bit weights the
activations enter in_proj, dt_proj and lm_head as two 16-bit halves (split16.py) and
x_proj's as two products (_mm), so they keep about 16 bits; out_proj's operand is rounded
once (see SPLIT_OUT_PROJ). Every product accumulates in float32.
cuBLAS may pick its algorithm by the number of rows, so a slot's bits can depend on the
batch size here: `deterministic=True` keeps the Triton tile mode (decode_step.py) instead.
"""

from __future__ import annotations

import torch

from ._triton import jit, tl, triton
from .activations import softplus
from .decode_step import ROW_TILE, _conv_inputs, _conv_step, _mm, _x_proj_columns
from .rmsnorm import residual_rmsnorm
from .split16 import load_sum, store_split

# -- kernels -----------------------------------------------------------------------------------


@jit
def _conv_x_proj_kernel(
    xz_ptr, cs_ptr, cw_ptr, cb_ptr, wx_ptr, xc_ptr, part_ptr, B, E, J,
    K: tl.constexpr, KP: tl.constexpr, HAS_CB: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    BB: tl.constexpr, BE: tl.constexpr, BJ: tl.constexpr,
):
    # BB rows, BE channels: their conv step (x read as the sum of in_proj's halves), then
    # their share of xc @ x_proj.T into this channel block's slot of the partial sums.
    pid_e = tl.program_id(0)
    rows = tl.program_id(1) * BB + tl.arange(0, BB)
    rmask = rows < B
    n = pid_e * BE + tl.arange(0, BE)
    cw, cw_new, cb, window = _conv_inputs(rows, rmask, n, cs_ptr, cw_ptr, cb_ptr, E, K, KP, HAS_CB, BE)
    offs = rows[:, None].to(tl.int64) * (2 * E) + n[None, :]
    x = load_sum(xz_ptr, offs, B * 2 * E, rmask[:, None] & (n < E)[None, :], SPLIT)
    xc = _conv_step(x, cw, cw_new, cb, window, rows, rmask, n, cs_ptr, xc_ptr, E, K, KP)
    share = _mm(xc, _x_proj_columns(wx_ptr, n, E, J, BJ), BB, IEEE)  # (BB, BJ)
    j = tl.arange(0, BJ)
    tl.store(part_ptr + (pid_e * B + rows[:, None]) * BJ + j[None, :], share, mask=rmask[:, None] & (j < J)[None, :])


@jit
def _dbc_kernel(part_ptr, dbc_ptr, dtr_ptr, B, J, R, NPART, LD, SPLIT: tl.constexpr, BP: tl.constexpr, BJ: tl.constexpr):
    # x_proj's partial sums of BJ columns of one row, all loaded at once (a loop over them
    # would wait for each load in turn) and added up in a fixed order -> dbc; its first R
    # columns -> dt_proj's operand
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BJ + tl.arange(0, BJ)
    p = tl.arange(0, BP)
    v = tl.sum(tl.load(part_ptr + (p[:, None] * B + row) * LD + j[None, :], mask=(p < NPART)[:, None], other=0.0), 0)
    tl.store(dbc_ptr + row * J + j, v, mask=j < J)
    store_split(dtr_ptr, row * R + j, v, B * R, j < R, SPLIT)


@jit
def _ssm_update_kernel(
    dt_ptr, dbc_ptr, xc_ptr, xz_ptr, ss_ptr, dtb_ptr, A_ptr, D_ptr, y_ptr, B, E, R, J,
    N: tl.constexpr, NP: tl.constexpr, SPLIT: tl.constexpr, Y_HALVES: tl.constexpr, BE: tl.constexpr,
):
    row = tl.program_id(1).to(tl.int64)
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    em = e < E
    n = tl.arange(0, NP)
    nm = n < N
    dt = load_sum(dt_ptr, row * E + e, B * E, em, SPLIT) + tl.load(dtb_ptr + e, mask=em, other=0.0)
    dt = softplus(dt)
    Bv = tl.load(dbc_ptr + row * J + R + n, mask=nm, other=0.0)
    Cv = tl.load(dbc_ptr + row * J + R + N + n, mask=nm, other=0.0)
    x = tl.load(xc_ptr + row * E + e, mask=em, other=0.0)
    z = load_sum(xz_ptr, row * 2 * E + E + e, B * 2 * E, em, SPLIT)
    A = tl.load(A_ptr + e[:, None] * N + n[None, :], mask=em[:, None] & nm[None, :], other=0.0)
    sp = ss_ptr + row * E * N + e[:, None] * N + n[None, :]
    sm = em[:, None] & nm[None, :]
    s = tl.load(sp, mask=sm, other=0.0)
    s = s * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * Bv[None, :]
    tl.debug_barrier()  # every thread holding an element has read it before it is rewritten
    tl.store(sp, s, mask=sm)
    y = tl.sum(s * Cv[None, :], 1) + tl.load(D_ptr + e, mask=em, other=0.0) * x
    y = y * (z * tl.sigmoid(z))
    store_split(y_ptr, row * E + e, y, B * E, em, Y_HALVES)


# -- launchers -----------------------------------------------------------------------------------
# split: the products' operands and results have 2B rows, halves as in split16.py.


def gemm(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ weight.T in float32; a in the weight's dtype."""
    if weight.dtype == torch.float32:
        torch.mm(a, weight.t(), out=out)
    elif a.device.type == "cpu":  # (the interpreter's tests) no 16-bit mm into float32 there: upcast, exact
        torch.mm(a.float(), weight.float().t(), out=out)
    else:
        torch.mm(a, weight.t(), out_dtype=torch.float32, out=out)


# Channels a program and warps of ssm_update, which streams the state (2.8b, batch 128,
# whole steps: 128 channels 5.99 ms against 6.15 at 64, other shapes no better).
SSM_UPDATE_BLOCK = (128, 4)
# conv_x_proj's channels a program (16 rows: ROW_TILE) and warps, by x_proj's dtype: its
# (R + 2N, channels) block of x_proj's columns stays in registers (sm_90, Triton 3.6: 74
# registers at 64 channels and 8 warps for 16-bit weights; float32's 32 channels take 176,
# and spill from 64 on).
CONV_X_PROJ_BLOCKS = {torch.float32: (32, 8), torch.bfloat16: (64, 8), torch.float16: (64, 8)}


def x_proj_partials(batch: int, x_proj_w: torch.Tensor) -> torch.Tensor:
    """conv_x_proj's partial sums of x_proj: one (batch, BJ) f32 slot a block of channels."""
    J, E = x_proj_w.shape
    blocks = triton.cdiv(E, CONV_X_PROJ_BLOCKS[x_proj_w.dtype][0])
    return torch.zeros(blocks, batch, triton.next_power_of_2(J), device=x_proj_w.device)


def conv_x_proj(xz, conv_state, conv_w, conv_b, x_proj_w, xc, partials, split=False) -> None:
    """x = xz[:, :E] (the sum of its halves with split); xc = SiLU(conv step), updating
    conv_state; partials[block] = xc[:, block] @ x_proj[:, block].T for each block of
    channels (CONV_X_PROJ_BLOCKS; dbc_rows adds them up)."""
    B, E, K = conv_state.shape
    BE, warps = CONV_X_PROJ_BLOCKS[x_proj_w.dtype]
    assert partials.shape[0] == triton.cdiv(E, BE), "partials from x_proj_partials"
    _conv_x_proj_kernel[(triton.cdiv(E, BE), triton.cdiv(B, ROW_TILE))](
        xz, conv_state, conv_w, conv_b if conv_b is not None else conv_w, x_proj_w, xc, partials, B, E, x_proj_w.shape[0],
        K=K, KP=triton.next_power_of_2(K), HAS_CB=conv_b is not None, SPLIT=split, IEEE=x_proj_w.dtype == torch.float32,
        BB=ROW_TILE, BE=BE, BJ=partials.shape[2], num_warps=warps,
    )


def dbc_rows(partials, dbc, dtr, split=False) -> None:
    """dbc = x_proj's result (B, R+2N) f32, the sum of conv_x_proj's partials; dtr = its
    first R columns in dtr's dtype (in halves with split)."""
    B, J = dbc.shape
    NP, _, LD = partials.shape
    BP = triton.next_power_of_2(NP)
    BJ = max(1, min(LD, 4096 // BP))  # columns a program: up to 4096 partials in registers
    _dbc_kernel[(B, LD // BJ)](partials, dbc, dtr, B, J, dtr.shape[1], NP, LD, SPLIT=split, BP=BP, BJ=BJ, num_warps=4)


def ssm_update(dt, dbc, xc, xz, ssm_state, dt_bias, A, D, R, y, split=False, y_halves=None) -> None:
    """y = gated output of one recurrence step (B and C from dbc[:, R:]); updates ssm_state.
    split: dt and xz in halves; y_halves (default: split): y written in halves."""
    B, E, N = ssm_state.shape
    BE, warps = SSM_UPDATE_BLOCK
    _ssm_update_kernel[(triton.cdiv(E, BE), B)](
        dt, dbc, xc, xz, ssm_state, dt_bias, A, D, y, B, E, R, dbc.shape[1],
        N=N, NP=triton.next_power_of_2(N), SPLIT=split, Y_HALVES=split if y_halves is None else y_halves, BE=BE, num_warps=warps,
    )


class GemmDecodeStep:
    """One decode step for a fixed batch size through cuBLAS products; same interface as
    decode_step.DecodeStep (`__call__(tokens, state) -> logits`, `.logits`)."""

    # out_proj's operand y rounded once to 16 bits rather than split in two halves: half
    # the rows in the largest product after in_proj (2.8b batch 128: 6.12 ms a step against
    # 6.29). The halves matter where rounding moves the logits most: in_proj's and
    # x_proj's operands (lm_head's are kept split too).
    SPLIT_OUT_PROJ = False

    def __init__(self, model, batch: int):
        c, w = model.config, model.weights
        dev, sdt = w.embedding.device, w.embedding.dtype
        self.model, self.B = model, batch
        self.split = sdt != torch.float32  # 16-bit operands in two halves (split16.py)
        self.split_out = self.split and self.SPLIT_OUT_PROJ
        P = 2 * batch if self.split else batch  # rows of the products
        Po = 2 * batch if self.split_out else batch  # rows of out_proj's product
        d, E, N, R = c.d_model, c.d_inner, c.d_state, c.dt_rank
        f32 = dict(device=dev, dtype=torch.float32)
        self.h = torch.zeros(batch, d, **f32)
        self.o = torch.zeros(Po, d, **f32)
        self.u = torch.zeros(P, d, device=dev, dtype=sdt)
        self.xz = torch.zeros(P, 2 * E, **f32)
        self.xc = torch.zeros(batch, E, **f32)
        self.partials = x_proj_partials(batch, w.layers[0].x_proj_w)
        self.dbc = torch.zeros(batch, R + 2 * N, **f32)
        self.dtr16 = torch.zeros(P, R, device=dev, dtype=sdt)
        self.dt = torch.zeros(P, E, **f32)
        self.y16 = torch.zeros(Po, E, device=dev, dtype=sdt)
        self.logits_raw = torch.zeros(P, c.vocab_size, **f32) if self.split else None
        self.logits = torch.zeros(batch, c.vocab_size, **f32)

    def __call__(self, tokens: torch.Tensor, state) -> torch.Tensor:
        c, w = self.model.config, self.model.weights
        R, eps, B, split = c.dt_rank, c.norm_eps, self.B, self.split
        torch.index_select(w.embedding, 0, tokens, out=self.u[:B])  # u as scratch for the lookup
        self.h.copy_(self.u[:B])
        prev = None  # the previous layer's out_proj bias, added with its output
        for i, lw in enumerate(w.layers):
            residual_rmsnorm(self.h, self.o if i else None, prev, lw.norm_w, eps, self.u, o_halves=self.split_out, u_halves=split)
            gemm(self.u, lw.in_proj_w, self.xz)
            if lw.in_proj_b is not None:
                self.xz[:B] += lw.in_proj_b
            conv_x_proj(self.xz, state.conv[i], lw.conv_w, lw.conv_b, lw.x_proj_w, self.xc, self.partials, split)
            dbc_rows(self.partials, self.dbc, self.dtr16, split)
            gemm(self.dtr16, lw.dt_proj_w, self.dt)
            ssm_update(self.dt, self.dbc, self.xc, self.xz, state.ssm[i], lw.dt_bias, lw.A, lw.D, R, self.y16, split, self.split_out)
            gemm(self.y16, lw.out_proj_w, self.o)
            prev = lw.out_proj_b
        residual_rmsnorm(self.h, self.o, prev, w.norm_f, eps, self.u, o_halves=self.split_out, u_halves=split)
        if split:
            gemm(self.u, w.lm_head, self.logits_raw)
            torch.add(self.logits_raw[:B], self.logits_raw[B:], out=self.logits)
        else:
            gemm(self.u, w.lm_head, self.logits)
        return self.logits
