"""The decode step as Triton kernels, three or four launches a layer, with their `_ref` twins.

One step, per layer, for B slots (rows), with h + dh the float32 residual stream (dh: the
last out_proj's share, not yet folded into h):

    rmsnorm_linear     h + dh -> rmsnorm * norm_w -> in_proj          -> xz (B, 2E)
      (in_proj)        and in the programs of the x half, their
                       channels' conv step + SiLU, then x_proj        -> xc (B, E), dbc (B, R+2N)
    ssm_step           dt_proj + softplus, state update, D skip, gate -> y (B, E)
                       (and h += dh, dh = 0)
    out_proj_residual  dh += y @ out_proj.T (+ bias)

and around the layers: `embed` before, `rmsnorm_linear` with norm_f and lm_head after (for
greedy sampling it also finds each row's argmax, which `take_argmax` hands out as the
tokens: see argmax_keys).
The conv step needs only its own channels of x, so it runs where they are computed, and
x_proj's split over K is in_proj's split of x's channels: one kernel boundary a layer
fewer (each costs a few microseconds of drain and ramp whatever the kernels' sizes). That
pays up to d_model 1024; wider models run the conv step and x_proj as a kernel of their
own, `conv_x_proj`, which loads x_proj's columns before its wait (the engine's plan: OneRowBlocks.conv_in_in_proj).

Why it is shaped this way:
- Small batches (where the engine's plan table says "one-row") run one row per program
  with float32 multiply-and-sum products: bandwidth-bound GEMVs. Every reduction runs over
  a fixed split of K in a fixed order, so a row's result never depends on the other rows
  or on how many there are.
- Short-and-wide products (x_proj, out_proj) are split over K so that enough programs
  stream the weights. Their partial sums meet by atomic adds in fixed point (gemv.py: FIXED_ONE)
  in dbc and dh: exact in any order, so deterministic, and with no round trip to wait
  for (no last program adding splits up). The next kernel but one zeroes each for the
  next layer: out_proj zeroes dbc, ssm_step folds dh into h.
- rmsnorm_linear sums the row's squares along its own product loop and scales the sums
  at the end, so it needs no pass over h first.
- On Hopper the kernels launch with programmatic dependent launch: each starts while the
  previous one drains, loads what the previous kernel does not write (its first weight
  tile; in in_proj also the conv weights and window, and x_proj's columns into L2; in
  conv_x_proj x_proj's columns; in ssm_step the layer's state), and only then waits for
  the previous kernel's results (pdl.py). Some let the next kernel
  launch even before their own wait (`OneRowBlocks.early_launch`).
- Larger batches run decode_gemm.py's step instead (the engine's plan table).
"""

from __future__ import annotations

import torch

from ._triton import jit, tl, triton
from .activations import activate, silu, softplus
from .argmax_keys import (
    ARGMAX_EMPTY,
    EMPTY_KEY,
    advance_slots,
    argmax_keys,
    token_of_key,
)
from .decode_conv import add_x_proj_share, conv_inputs, conv_step_tile, x_proj_columns
from .decode_gemm import conv_step_ref, ssm_update_ref
from .fp8_gemm import linear_ref, weight_parts
from .gemv import (
    add_fixed,
    add_row_tile,
    fold_share,
    from_fixed_tile,
    mm,
    mm_terms,
    mm_total,
    mma_terms,
    mma_total,
    prefetch_to_l2,
    residual_tile,
    row_sums,
    row_total,
    split_k_start,
)
from .pdl import NO_PDL, let_next_kernel_launch, pdl_launch, wait_for_prior_kernel
from .rmsnorm import residual_rmsnorm_ref

# -- reference twins -------------------------------------------------------------------------


def rmsnorm_linear_ref(h, norm_w, eps, weight, bias=None):
    """(B, d) f32 -> (B, n_out) f32: linear(rmsnorm(h) * norm_w)."""
    return linear_ref(residual_rmsnorm_ref(h, None, None, norm_w, eps)[1], weight, bias)


def conv_x_proj_ref(x, conv_state, conv_w, conv_b, x_proj_w):
    """x (B, E) -> xc (B, E) f32 after conv + SiLU, and dbc (B, R+2N) f32; updates conv_state."""
    xc = conv_step_ref(x, conv_state, conv_w, conv_b)
    return xc, linear_ref(xc, x_proj_w)


def ssm_step_ref(dbc, xc, z, ssm_state, dt_proj_w, dt_bias, A, D):
    """One recurrence step -> y (B, E) f32 (D skip and SiLU(z) gate applied); updates ssm_state."""
    N = A.shape[1]
    R = dbc.shape[1] - 2 * N
    dt = linear_ref(dbc[:, :R], dt_proj_w)  # (B, E)
    return ssm_update_ref(dt, dbc[:, R : R + N], dbc[:, R + N :], xc, z, ssm_state, dt_bias, A, D)


def out_proj_residual_ref(y, weight, bias, h):
    """h + y @ weight.T + bias, f32."""
    return h + linear_ref(y, weight, bias)


def embed_ref(tokens, embedding):
    return embedding[tokens].float()


# -- kernels -----------------------------------------------------------------------------------


@jit
def _embed_kernel(tok_ptr, emb_ptr, h_ptr, dh_ptr, dh2_ptr, B, D, mult, BN: tl.constexpr, PDL: tl.constexpr):
    # h = embedding[token] * mult (a family's embedding multiplier, else 1); dh and dh2 (a
    # hybrid's second pending share, decode_step_hybrid.py; else dh again) zeroed
    wait_for_prior_kernel(PDL)
    pid_b = tl.program_id(0)  # rows first: see DecodeStep
    pid_n = tl.program_id(1)
    rows = pid_b + tl.arange(0, 1)  # the row, as a 1-vector: tiles are (1, n)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < B
    m = rmask[:, None] & (cols < D)[None, :]
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    x = tl.load(emb_ptr + tok[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(h_ptr + rows[:, None] * D + cols[None, :], x * mult, mask=m)
    tl.store(dh_ptr + rows[:, None] * D + cols[None, :], tl.zeros([1, BN], dtype=tl.int64), mask=m)
    tl.store(dh2_ptr + rows[:, None] * D + cols[None, :], tl.zeros([1, BN], dtype=tl.int64), mask=m)


@jit
def _rmsnorm_linear_kernel(
    h_ptr, dh_ptr, nw_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, cs_ptr, cw_ptr, cb_ptr, wx_ptr, wxs_ptr, xc_ptr, dbc_ptr,
    best_ptr, w2_ptr, ws2_ptr, b2_ptr, out2_ptr, B, D, NOUT, NOUT2, TILES1, E, J, eps,
    W_SCALED: tl.constexpr, WX_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, CONV: tl.constexpr, ARGMAX: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    HAS_CB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    BJ: tl.constexpr, STAGES: tl.constexpr, SUM_LAST: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr,
    MMA: tl.constexpr, TWO: tl.constexpr,
):
    let_next_kernel_launch(PDL)
    pid_b = tl.program_id(0)  # rows first: see DecodeStep
    pid_n = tl.program_id(1)
    if TWO:  # a second matrix over the same row (its bias, scales and output), in the programs past TILES1
        if pid_n >= TILES1:
            pid_n -= TILES1
            w_ptr, ws_ptr, b_ptr, out_ptr, NOUT = w2_ptr, ws2_ptr, b2_ptr, out2_ptr, NOUT2
    rows = pid_b + tl.arange(0, 1)  # the row, as a 1-vector: tiles are (1, n)
    rmask = rows < B
    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < NOUT
    # The weights depend on no earlier kernel: the first tile is on its way before the wait.
    k = tl.arange(0, BK)
    w = tl.load(w_ptr + n[:, None] * D + k[None, :], mask=nmask[:, None] & (k < D)[None, :], other=0.0)
    if CONV:  # so are the conv step's and x_proj's, and the conv window (this kernel's own)
        cw, cw_new, cb, window = conv_inputs(rows, rmask, n, cs_ptr, cw_ptr, cb_ptr, E, K, KP, HAS_CB, BN)
        if pid_n * BN < E:  # x_proj's columns into L2 (loaded after the GEMV: see below)
            j = tl.minimum(tl.arange(0, BJ), J - 1)
            prefetch_to_l2(wx_ptr + j[:, None] * E + pid_n * BN + tl.arange(0, 2)[None, :] * (BN - 1))
    wait_for_prior_kernel(PDL)
    # rmsnorm(h) * nw @ W.T = rstd * ((h * nw) @ W.T): the row's squares add up along the
    # same loop, element-wise (one sum across threads at the end, not one a tile), and
    # scale the sums at the end, so no pass over h comes first.
    # h is the residual plus the last out_proj's share, still in dh (see ssm_step).
    # The first tile's product, then the rest in a loop (carrying a prefetched tile through
    # it in registers doubled the registers and halved the bandwidth; STAGES > 1 streams
    # tiles through shared memory instead: slower here).
    hk = residual_tile(h_ptr, dh_ptr, rows[:, None] * D + k[None, :], rmask[:, None] & (k < D)[None, :])
    nw = tl.load(nw_ptr + k, mask=k < D, other=0.0)
    sq = hk * hk
    if MMA:  # on the tensor cores (gemv.mma_terms)
        acc = mma_terms(hk * nw[None, :], w, tl.zeros([BN, 16], dtype=tl.float32))
    else:
        acc = mm_terms(hk * nw[None, :], w, SUM_LAST)
    for k0 in tl.range(BK, D, BK, num_stages=STAGES, loop_unroll_factor=UNROLL):
        k = k0 + tl.arange(0, BK)
        kmask = k < D
        hk = residual_tile(h_ptr, dh_ptr, rows[:, None] * D + k[None, :], rmask[:, None] & kmask[None, :])
        nw = tl.load(nw_ptr + k, mask=kmask, other=0.0)
        w = tl.load(w_ptr + n[:, None] * D + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        sq += hk * hk
        if MMA:
            acc = mma_terms(hk * nw[None, :], w, acc)
        else:
            acc += mm_terms(hk * nw[None, :], w, SUM_LAST)
    if MMA:
        acc = mma_total(acc)
    else:
        acc = mm_total(acc, SUM_LAST)
    acc = acc * (1.0 / tl.sqrt(tl.sum(sq, 1) / D + eps))[:, None]
    if W_SCALED:  # FP8 weights: each sum times its row's scale, once
        acc *= tl.load(ws_ptr + n, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * NOUT + n[None, :], acc, mask=rmask[:, None] & nmask[None, :])
    if ARGMAX:  # lm_head for greedy sampling: each row's best so far, across programs
        tl.atomic_max(best_ptr + rows, tl.max(argmax_keys(acc, n, nmask), 1), mask=rmask, sem="relaxed")
    if CONV:
        if pid_n * BN < E:  # a program of in_proj's x half: its channels' conv step, x_proj
            xc = conv_step_tile(acc, cw, cw_new, cb, window, rows, rmask, n, cs_ptr, xc_ptr, E, K, KP)
            # x_proj's columns are loaded only now, from L2 (prefetched before the wait: 130m
            # 0.196 ms a step against 0.203 from memory); loaded into registers before the
            # wait, they slowed the whole step 1.3x (bf16) to 3.5x (float32)
            add_x_proj_share(xc, x_proj_columns(wx_ptr, n, E, J, BJ), rows, rmask, dbc_ptr, wxs_ptr, J, BJ, WX_SCALED)


@jit
def _take_argmax_kernel(best_ptr, tok_ptr, hist_ptr, step_ptr, seen_ptr, B, V, BR: tl.constexpr, PDL: tl.constexpr):
    # After an lm_head with ARGMAX: the tokens (into tokens and a row of history), the
    # slots advanced; `best` emptied for the next lm_head.
    wait_for_prior_kernel(PDL)
    rows = tl.arange(0, BR)
    m = rows < B
    tok = token_of_key(tl.load(best_ptr + rows, mask=m, other=0))
    tl.store(tok_ptr + rows, tok, mask=m)
    tl.store(hist_ptr + rows, tok, mask=m)
    advance_slots(tok, rows, m, step_ptr, seen_ptr, V, BR)
    tl.store(best_ptr + rows, tl.full([BR], EMPTY_KEY, tl.int64), mask=m)


@jit
def _conv_x_proj_kernel(
    xz_ptr, cs_ptr, cw_ptr, cb_ptr, wx_ptr, wxs_ptr, xc_ptr, dbc_ptr, B, E, J,
    K: tl.constexpr, KP: tl.constexpr, HAS_CB: tl.constexpr, BN: tl.constexpr, BJ: tl.constexpr, WX_SCALED: tl.constexpr,
    PDL: tl.constexpr,
):
    # The conv step and x_proj as a kernel of their own, for wide models (see
    # OneRowBlocks.conv_in_in_proj): the same work as in_proj's epilogue, on x from xz.
    let_next_kernel_launch(PDL)
    pid_b = tl.program_id(0)  # rows first: see DecodeStep
    pid_n = tl.program_id(1)
    rows = pid_b + tl.arange(0, 1)  # the row, as a 1-vector: tiles are (1, n)
    rmask = rows < B
    n = pid_n * BN + tl.arange(0, BN)
    cw, cw_new, cb, window = conv_inputs(rows, rmask, n, cs_ptr, cw_ptr, cb_ptr, E, K, KP, HAS_CB, BN)
    wx = x_proj_columns(wx_ptr, n, E, J, BJ)  # before the wait too: here registers are plenty
    wait_for_prior_kernel(PDL)
    x = tl.load(xz_ptr + rows[:, None] * (2 * E) + n[None, :], mask=rmask[:, None] & (n < E)[None, :], other=0.0)
    xc = conv_step_tile(x, cw, cw_new, cb, window, rows, rmask, n, cs_ptr, xc_ptr, E, K, KP)
    add_x_proj_share(xc, wx, rows, rmask, dbc_ptr, wxs_ptr, J, BJ, WX_SCALED)


@jit
def _ssm_step_kernel(
    dbc_ptr, xc_ptr, xz_ptr, ss_ptr, dtw_ptr, dts_ptr, dtb_ptr, A_ptr, D_ptr, y_ptr, h_ptr, dh_ptr, B, E, R, DM, eps,
    N: tl.constexpr, NP: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr,
    BE: tl.constexpr, BD: tl.constexpr, DBC_NORM: tl.constexpr, DT_SCALED: tl.constexpr, PDL: tl.constexpr,
):
    let_next_kernel_launch(PDL)
    pid_b = tl.program_id(0)
    pid_e = tl.program_id(1)
    rows = pid_b + tl.arange(0, 1)  # the row, as a 1-vector: tiles are (1, n)
    rmask = rows < B
    e = pid_e * BE + tl.arange(0, BE)
    emask = e < E
    m = rmask[:, None] & emask[None, :]
    r = tl.arange(0, BR)
    nn = tl.arange(0, NP)
    nmask = nn < N
    # Before the wait: the weights and constants, and the state, this kernel's own from
    # the last step.
    w = tl.load(dtw_ptr + e[:, None] * R + r[None, :], mask=emask[:, None] & (r < R)[None, :], other=0.0)
    A = tl.load(A_ptr + e[:, None] * N + nn[None, :], mask=emask[:, None] & nmask[None, :], other=0.0)
    dtb = tl.load(dtb_ptr + e, mask=emask, other=0.0)
    if DT_SCALED:  # FP8 dt_proj: its rows' scales
        dts = tl.load(dts_ptr + e, mask=emask, other=0.0)
    Dv = tl.load(D_ptr + e, mask=emask, other=0.0)
    sp = ss_ptr + rows[:, None, None] * (E * N) + e[None, :, None] * N + nn[None, None, :]
    sm = m[:, :, None] & nmask[None, None, :]
    s = tl.load(sp, mask=sm, other=0.0).to(tl.float32)  # (1, BE, NP); the state may be 16-bit
    wait_for_prior_kernel(PDL)
    dtr = from_fixed_tile(tl.load(dbc_ptr + rows[:, None] * BJ + r[None, :], mask=rmask[:, None] & (r < R)[None, :], other=0))
    Bv = from_fixed_tile(tl.load(dbc_ptr + rows[:, None] * BJ + R + nn[None, :], mask=rmask[:, None] & nmask[None, :], other=0))
    Cv = from_fixed_tile(tl.load(dbc_ptr + rows[:, None] * BJ + R + N + nn[None, :], mask=rmask[:, None] & nmask[None, :], other=0))
    if DBC_NORM:  # Falcon-Mamba: dt_r, B and C each over its rms (masked lanes hold 0)
        dtr = dtr * tl.rsqrt(tl.sum(dtr * dtr, 1)[:, None] / R + eps)
        Bv = Bv * tl.rsqrt(tl.sum(Bv * Bv, 1)[:, None] / N + eps)
        Cv = Cv * tl.rsqrt(tl.sum(Cv * Cv, 1)[:, None] / N + eps)
    x = tl.load(xc_ptr + rows[:, None] * E + e[None, :], mask=m, other=0.0)
    z = tl.load(xz_ptr + rows[:, None] * (2 * E) + E + e[None, :], mask=m, other=0.0)
    # in_proj has read h + dh: this program folds its BD columns of dh into h and zeroes
    # them for the next out_proj
    cols = pid_e * BD + tl.arange(0, BD)
    offs, hm = rows[:, None] * DM + cols[None, :], rmask[:, None] & (cols < DM)[None, :]
    h_new = residual_tile(h_ptr, dh_ptr, offs, hm)
    dt = mm(dtr, w)  # (1, BE)
    if DT_SCALED:
        dt *= dts[None, :]
    dt = softplus(dt + dtb[None, :])
    s = s * tl.exp(dt[:, :, None] * A[None, :, :]) + (dt * x)[:, :, None] * Bv[:, None, :]
    # Every thread holding an element of the state or of h / dh has read it before it is
    # rewritten (dh's zeros go out in another layout than dh came in: without a barrier a
    # 16-row version of this kernel lost shares of dh on the GPU).
    tl.debug_barrier()
    tl.store(sp, s.to(ss_ptr.dtype.element_ty), mask=sm)  # rounded once, where the state is 16-bit
    tl.store(h_ptr + offs, h_new, mask=hm)
    tl.store(dh_ptr + offs, tl.zeros([1, BD], dtype=tl.int64), mask=hm)
    y = tl.sum(s * Cv[:, None, :], 2) + Dv[None, :] * x
    y = y * silu(z)
    tl.store(y_ptr + rows[:, None] * E + e[None, :], y, mask=m)


@jit
def _out_proj_residual_kernel(
    y_ptr, w_ptr, ws_ptr, b_ptr, dh_ptr, dbc_ptr, h_ptr, dhp_ptr, B, D, E, KCHUNK,
    W_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BJ: tl.constexpr, PDL: tl.constexpr,
    MMA: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, BD: tl.constexpr,
):
    # The hybrids' use (decode_step_hybrid.py) adds: ACT (not "none"), the product's input y
    # taken through an MLP's activation as it is read (GATED: act(y[:E]) * y[E:], y 2E wide);
    # BJ 0, no dbc to zero; BD > 0, this program folds BD columns of the other pending share
    # dhp into h (h += dhp, dhp = 0) where no kernel of the sublayer before has.
    let_next_kernel_launch(PDL)
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_b + tl.arange(0, 1)  # the row, as a 1-vector: tiles are (1, n)
    rmask = rows < B
    n, nmask, k_end, w = split_k_start(w_ptr, D, E, KCHUNK, BN, BK)
    wait_for_prior_kernel(PDL)
    if BJ > 0:
        # ssm_step has read dbc: the first program of each row tile zeroes the tile's rows for
        # the next layer's in_proj (jj >= 0 there, jj >= BJ or more in the others)
        jj = tl.arange(0, BJ)
        first = jj[None, :] >= (pid_n + pid_s) * BJ
        tl.store(dbc_ptr + rows[:, None] * BJ + jj[None, :], tl.zeros([1, BJ], dtype=tl.int64), mask=rmask[:, None] & first)
    if BD > 0:
        cols = (pid_n * tl.num_programs(2) + pid_s) * BD + tl.arange(0, BD)
        fold_share(h_ptr, dhp_ptr, rows[:, None] * D + cols[None, :], rmask[:, None] & (cols < D)[None, :])
    acc = row_sums(BN, MMA)  # (MMA: on the tensor cores, gemv.mma_terms)
    for k0 in range(pid_s * KCHUNK, k_end, BK):
        k = k0 + tl.arange(0, BK)
        km = rmask[:, None] & (k < k_end)[None, :]
        if GATED:
            yk = activate(tl.load(y_ptr + rows[:, None] * (2 * E) + k[None, :], mask=km, other=0.0), ACT)
            yk *= tl.load(y_ptr + rows[:, None] * (2 * E) + E + k[None, :], mask=km, other=0.0)
        elif ACT != "none":
            yk = activate(tl.load(y_ptr + rows[:, None] * E + k[None, :], mask=km, other=0.0), ACT)
        else:
            yk = tl.load(y_ptr + rows[:, None] * E + k[None, :], mask=km, other=0.0)
        w_now = w
        k = k + BK  # the next tile (nothing past this split's end)
        w = tl.load(w_ptr + n[:, None] * E + k[None, :], mask=nmask[:, None] & (k < k_end)[None, :], other=0.0)
        acc = add_row_tile(acc, yk, w_now, MMA)
    acc = row_total(acc, MMA)
    if W_SCALED:  # FP8 weights: this split's sums times their rows' scales
        acc *= tl.load(ws_ptr + n, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:  # once, with the first split (n >= pid_s * D holds there only)
        acc += tl.load(b_ptr + n, mask=nmask & (n >= pid_s * D), other=0.0)[None, :]
    # This split's share of y @ W.T, added to dh in fixed point (exact in any order); the
    # next rmsnorm_linear reads h + dh, the ssm_step after it folds dh into h.
    add_fixed(dh_ptr + rows[:, None] * D + n[None, :], acc, rmask[:, None] & nmask[None, :])


# -- launchers -----------------------------------------------------------------------------------


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


class DecodeStep:
    """Launch plan and scratch buffers for one batch size; `__call__` runs one decode step.

    One row a program. Block sizes depend on the model's shapes only, never on the batch
    size, so a slot's result is the same for every batch size it runs at.

    Every kernel's grid has the rows as its first, fastest-varying axis:
    the programs that read the same weight tile for different rows are launched side by
    side, so the tile comes from memory once and from L2 for the other rows. With the rows
    last, each row's programs swept the whole matrix before the next row's began, and a
    matrix larger than L2 was read from memory once a row (2.8b bf16 batch 8: 9.63 ms a
    step against 7.31).
    """

    def __init__(self, model, batch: int, plan):
        """model: its config and weights; plan: the engine's decode plan (engine/plan.py's
        DecodePlan), of which the step reads `blocks` (the launch settings) and `pdl`."""
        c, w = model.config, model.weights
        dev = w.embedding.device
        self.plan, blocks = plan, plan.blocks
        self.model, self.B = model, batch
        # the launch settings, as attributes the kernels' launchers read (tests narrow some)
        self.in_proj_blocks, self.lm_head_blocks = blocks.in_proj, blocks.lm_head
        self.sum_last, self.lm_head_sum_last, self.in_proj_unroll = blocks.in_proj_sum_last, blocks.lm_head_sum_last, blocks.in_proj_unroll
        self.early_launch = blocks.early_launch
        # (a hybrid's experts' products take in_proj's and out_proj's flags, with tiles of their own where given)
        for flag, name, on, tile in (("in_proj", "in_proj", blocks.in_proj_mma, blocks.in_proj),
                                     ("out_proj", "out_proj", blocks.out_proj_mma, blocks.out_proj),
                                     ("in_proj", "moe_in", blocks.in_proj_mma, blocks.moe_in),
                                     ("out_proj", "moe_out", blocks.out_proj_mma, blocks.moe_out)):
            if on and tile is not None and tile[0] < 16:  # (the tensor cores' smallest tile)
                raise ValueError(f"OneRowBlocks.{flag}_mma needs 16 or more rows a program, got {name} {tile[0]}")
        # the products on the tensor cores where the plan says and the weights are 16-bit or
        # FP8 (float32 weights keep the multiply-and-sum: see OneRowBlocks)
        self.in_proj_mma = blocks.in_proj_mma and w.dtype != torch.float32
        self.out_proj_mma = blocks.out_proj_mma and w.dtype != torch.float32
        d, E, N, R = c.d_model, c.d_inner, c.d_state, c.dt_rank
        self.J, self.BJ = R + 2 * N, _pow2(R + 2 * N)
        self.BR, self.NP = _pow2(R), _pow2(N, 1)
        # out_proj: BN_out-wide tiles of d, K split so that enough programs stream the weights.
        self.out_proj_blocks = blocks.out_proj
        self.BN_out, self.BK_out, self.warps_out, self.programs_out = blocks.out_proj
        self.nt_d = triton.cdiv(d, self.BN_out)
        self.nsplit_out, self.kchunk_out = self.split_k(E)
        self.BE_ssm, self.warps_ssm = blocks.ssm_block
        self.BD_ssm = triton.next_power_of_2(triton.cdiv(d, triton.cdiv(E, self.BE_ssm)))  # h columns each folds
        self.fused_conv = blocks.conv_in_in_proj
        self.BN_conv = blocks.conv_block
        f32 = dict(device=dev, dtype=torch.float32)
        self.h = torch.zeros(batch, d, **f32)
        self.dh = torch.zeros(batch, d, device=dev, dtype=torch.int64)  # out_proj's share, fixed point
        self.xz = torch.zeros(batch, 2 * E, **f32)
        self.xc = torch.zeros(batch, E, **f32)
        self.y = torch.zeros(batch, E, **f32)
        self.dbc = torch.zeros(batch, self.BJ, device=dev, dtype=torch.int64)  # fixed point: see gemv.FIXED_ONE
        self.logits = torch.zeros(batch, c.vocab_size, **f32)
        self.best = torch.full((batch,), ARGMAX_EMPTY, device=dev, dtype=torch.int64)  # see argmax_keys
        self.pdl = pdl_launch(dev) if plan.pdl else NO_PDL

    def split_k(self, K: int, products: int = 1, blocks: tuple | None = None) -> tuple[int, int]:
        """An out_proj-style product's splits of its K (its input's width) and their length:
        enough programs (OneRowBlocks.out_proj, or `blocks` of its form, shared by `products`
        such products side by side in the launch) that they stream the weights, whole BK
        tiles a split, at most 16 splits."""
        BN, BK, _, programs = blocks or self.out_proj_blocks
        splits = max(1, min(16, programs // (triton.cdiv(self.model.config.d_model, BN) * products),
                            triton.cdiv(K, BK)))
        chunk = triton.cdiv(triton.cdiv(K, splits), BK) * BK
        return triton.cdiv(K, chunk), chunk  # (whole BK steps a split may need fewer splits)

    def pdl_for(self, kernel: str) -> dict:
        """The PDL launch settings for one of the step's kernels (see pdl.let_next_kernel_launch)."""
        if self.pdl["PDL"] and kernel in self.early_launch:
            return dict(self.pdl, PDL=2)
        return self.pdl

    # Each method launches one kernel on the scratch buffers; __call__ chains them.

    def embed(self, tokens: torch.Tensor, dh2=None, mult: float = 1.0) -> None:
        """h[:B] = embedding[tokens] * mult, dh = 0 (and dh2, a hybrid's second share)."""
        emb = self.model.weights.embedding
        _embed_kernel[(self.B, self.nt_d)](tokens, emb, self.h, self.dh, self.dh if dh2 is None else dh2, self.B,
                                           emb.shape[1], float(mult), BN=self.BN_out, **self.pdl)

    def _rmsnorm_linear(self, norm_w, weight, bias, out, blocks, conv=None, argmax=False, sum_last=False, unroll=1,
                        mma=False, dh=None, also=None) -> None:
        """out[:B] = linear(rmsnorm(h + dh) * norm_w, weight, bias) in blocks (BN, BK, warps,
        stages); with conv = (lw, conv_state), out is xz, and the x half goes on through the
        conv step and x_proj; with argmax, each row's argmax goes into `best` too (see
        argmax_keys). sum_last: one row's products summed over K once, after the loop
        (mm_terms), where d takes more than one K tile (in one tile the products would wait
        through the loop in registers for nothing). unroll: the K loop unrolled by this much
        where the products are summed after it. mma: a 16-bit or FP8 weight's products on the
        tensor cores (gemv.mma_terms). dh: the pending share h adds (default self.dh).
        also = (weight2, bias2, out2): a second product of the same normalised row in the same
        launch (Falcon-H1's in_proj and q/k/v), its programs after the first's; where the two
        differ in kind (FP8 or not, a bias or not), two launches."""
        if also is not None:
            (w2, s2), b2, out2 = weight_parts(also[0]), also[1], also[2]
            if (s2 is None) != (weight_parts(weight)[1] is None) or (b2 is None) != (bias is None):
                self._rmsnorm_linear(norm_w, weight, bias, out, blocks, sum_last=sum_last, unroll=unroll, mma=mma,
                                     dh=dh)
                weight, bias, out, also = also[0], b2, out2, None
        weight, scale = weight_parts(weight)
        n_out, d = weight.shape
        BN, BK, warps, stages = blocks
        sum_last = sum_last and d > BK
        tiles = triton.cdiv(n_out, BN)
        if also is not None:
            assert w2.shape[1] == d and conv is None and not argmax
            second, n_out2 = (w2, w2 if s2 is None else s2, b2 if b2 is not None else w2, out2), w2.shape[0]
        else:  # unused pointers
            second, n_out2 = (weight,) * 4, 0
        grid = (self.B, tiles + triton.cdiv(n_out2, BN))
        c = self.model.config
        if conv is not None:
            lw, conv_state = conv
            cb = lw.conv_b if lw.conv_b is not None else lw.conv_w
            wx, wxs = weight_parts(lw.x_proj_w)
            conv_args = (conv_state, lw.conv_w, cb, wx, wx if wxs is None else wxs, self.xc, self.dbc)
        else:  # unused pointers
            wxs = None
            conv_args = (out,) * 7
        _rmsnorm_linear_kernel[grid](
            self.h, self.dh if dh is None else dh, norm_w, weight, weight if scale is None else scale, bias if bias is not None else weight, out,
            *conv_args, self.best, *second, self.B, d, n_out, n_out2, tiles, c.d_inner, self.J, c.norm_eps,
            W_SCALED=scale is not None, WX_SCALED=wxs is not None, HAS_BIAS=bias is not None, CONV=conv is not None, ARGMAX=argmax, K=c.d_conv, KP=triton.next_power_of_2(c.d_conv),
            HAS_CB=conv is not None and conv[0].conv_b is not None,
            BN=BN, BK=BK, BJ=self.BJ, STAGES=stages, SUM_LAST=sum_last and not mma, UNROLL=unroll if sum_last and not mma else 1,
            MMA=mma, TWO=also is not None, num_warps=warps, **self.pdl_for("rmsnorm_linear"),
        )

    def in_proj(self, lw, conv_state) -> None:
        """xz[:B] = in_proj(rmsnorm(h + dh) * norm_w); then from its x half the conv step +
        SiLU -> xc, conv_state (B, E, K) updated, and xc @ x_proj.T added to dbc (zero
        before: out_proj_residual leaves it so): in in_proj's own programs where
        OneRowBlocks.conv_in_in_proj says, else in a second kernel."""
        linear = dict(blocks=self.in_proj_blocks, sum_last=self.sum_last, unroll=self.in_proj_unroll, mma=self.in_proj_mma)
        if self.fused_conv:
            self._rmsnorm_linear(lw.norm_w, lw.in_proj_w, lw.in_proj_b, self.xz, conv=(lw, conv_state), **linear)
            return
        self._rmsnorm_linear(lw.norm_w, lw.in_proj_w, lw.in_proj_b, self.xz, **linear)
        c = self.model.config
        wx, wxs = weight_parts(lw.x_proj_w)
        _conv_x_proj_kernel[(self.B, triton.cdiv(c.d_inner, self.BN_conv))](
            self.xz, conv_state, lw.conv_w, lw.conv_b if lw.conv_b is not None else lw.conv_w,
            wx, wx if wxs is None else wxs, self.xc, self.dbc, self.B, c.d_inner, self.J,
            K=c.d_conv, KP=triton.next_power_of_2(c.d_conv), HAS_CB=lw.conv_b is not None,
            BN=self.BN_conv, BJ=self.BJ, WX_SCALED=wxs is not None, num_warps=max(4, self.BN_conv // 16), **self.pdl_for("conv_x_proj"),
        )

    def lm_head(self, argmax: bool = False, norm_f=None, dh=None) -> None:
        """logits[:B] = lm_head(rmsnorm(h + dh) * norm_f); with argmax, each row's argmax
        into `best` too, for take_argmax. norm_f, dh: the model's and self.dh unless given."""
        w = self.model.weights
        self._rmsnorm_linear(w.norm_f if norm_f is None else norm_f, w.lm_head, None, self.logits, self.lm_head_blocks,
                             argmax=argmax, sum_last=self.lm_head_sum_last, dh=dh)

    def take_argmax(self, slots, tokens: torch.Tensor, history_row: torch.Tensor) -> None:
        """Greedy sampling after a step with argmax: tokens[:B] and history_row[:B] = the
        logits' argmax, and slots advanced as sampling.sample_greedy does, in one small
        kernel instead of torch's argmax and a few element-wise ones."""
        _take_argmax_kernel[(1,)](
            self.best, tokens, history_row, slots.step, slots.seen, self.B, slots.seen.shape[1],
            BR=_pow2(self.B, 1), **self.pdl,
        )

    def ssm_step(self, lw, ssm_state) -> None:
        """y from dbc, xc and the z half of xz; updates ssm_state (B, E, N); folds dh into h
        (h += dh, dh = 0)."""
        c = self.model.config
        dtw, dts = weight_parts(lw.dt_proj_w)
        _ssm_step_kernel[(self.B, triton.cdiv(c.d_inner, self.BE_ssm))](
            self.dbc, self.xc, self.xz, ssm_state, dtw, dtw if dts is None else dts, lw.dt_bias, lw.A, lw.D, self.y,
            self.h, self.dh, self.B, c.d_inner, c.dt_rank, c.d_model, c.dbc_norm_eps or 0.0, N=c.d_state, NP=self.NP,
            BJ=self.BJ, BR=self.BR, BE=self.BE_ssm, BD=self.BD_ssm, DBC_NORM=c.dbc_norm_eps is not None,
            DT_SCALED=dts is not None, num_warps=self.warps_ssm,
            **self.pdl_for("ssm_step"),
        )

    def out_proj_residual(self, lw) -> None:
        """dh += y @ out_proj.T + bias (dh is zero before: ssm_step leaves it so); zeroes dbc."""
        self.out_product(self.y, lw.out_proj_w, lw.out_proj_b, self.dh, dbc=self.dbc)

    def out_product(self, y, weight, bias, dh, *, dbc=None, act: str = "none", gated: bool = False, fold=None) -> None:
        """dh += y' @ weight.T + bias, split over K (y's width), where y' is y, or with `act`
        an MLP's activation of it (gated: act(y[:, :K]) * y[:, K:]); dbc: zeroed as well;
        fold: the other pending share, folded into h (h += fold, fold = 0)."""
        w, ws = weight_parts(weight)
        K = w.shape[1]
        splits, chunk = self.split_k(K)
        BD = triton.next_power_of_2(triton.cdiv(self.h.shape[1], self.nt_d * splits)) if fold is not None else 0
        _out_proj_residual_kernel[(self.B, self.nt_d, splits)](
            y, w, w if ws is None else ws, bias if bias is not None else w, dh, dh if dbc is None else dbc,
            self.h, dh if fold is None else fold, self.B, w.shape[0], K, chunk,
            W_SCALED=ws is not None, HAS_BIAS=bias is not None, BN=self.BN_out, BK=self.BK_out,
            BJ=0 if dbc is None else dbc.shape[1], ACT=act, GATED=gated, BD=BD,
            MMA=self.out_proj_mma, num_warps=self.warps_out, **self.pdl_for("out_proj_residual"),
        )

    def __call__(self, tokens: torch.Tensor, state, argmax: bool = False, h: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B,) -> logits (B, V) f32; updates `state` (conv, ssm of B slots). With
        argmax, take_argmax must follow (it empties `best` for the next step). h (B, d) f32:
        vectors in place of the embedding lookup (fastmamba.Backbone's step; tokens unused)."""
        w = self.model.weights
        if h is None:
            self.embed(tokens.contiguous())  # (the kernel reads a row's token at its index)
        else:
            self.h[: self.B].copy_(h)
            self.dh.zero_()
        for i, lw in enumerate(w.layers):
            self.in_proj(lw, state.conv[i])
            self.ssm_step(lw, state.ssm[i])
            self.out_proj_residual(lw)
        self.lm_head(argmax)
        return self.logits[: self.B]
