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
tokens: see _argmax_keys).
The conv step needs only its own channels of x, so it runs where they are computed, and
x_proj's split over K is in_proj's split of x's channels: one kernel boundary a layer
fewer (each costs a few microseconds of drain and ramp whatever the kernels' sizes). That
pays up to d_model 1024; wider models run the conv step and x_proj as a kernel of their
own, `conv_x_proj`, which loads x_proj's columns before its wait (DecodeStep.FUSED_CONV_UP_TO).

Why it is shaped this way:
- Small batches (up to one_row_up_to rows) run one row per program with float32
  multiply-and-sum products: bandwidth-bound GEMVs. Every reduction runs over a fixed split
  of K in a fixed order, so a row's result never depends on the other rows or on how many
  there are (up to one_row_up_to; `deterministic=True` runs decode_gemm.py's step with
  batch-invariant products instead, at every batch size).
- Short-and-wide products (x_proj, out_proj) are split over K so that enough programs
  stream the weights. Their partial sums meet by atomic adds in fixed point (FIXED_ONE)
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
  launch even before their own wait (`DecodeStep.EARLY_LAUNCH`).
- Larger batches run decode_gemm.py's step instead, from batch 3 up on bf16 2.8b and
  1.4b, 4 on 370m, 5 on 130m (`one_row_up_to`): its products through gemm.py's Triton GEMM
  (in_proj through cuBLAS above 32 rows, and at some float32 batch sizes: `cublas_in_proj`)
  up to 128 rows on the wide models and 256 on the narrow ones (`triton_products_up_to`),
  all through cuBLAS beyond. float32 weights likewise above 8 rows on 130m and 370m, 3 on
  1.4b and 2.8b.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import INTERPRET, jit, tl, triton
from .activations import silu, softplus
from .decode_gemm import conv_step_ref, ssm_update_ref
from .pdl import let_next_kernel_launch, pdl_launch, wait_for_prior_kernel
from .rmsnorm import residual_rmsnorm_ref

SMALL_BATCH = 8  # the most rows make_decode_step gives the one-row kernels (see one_row_up_to)


# -- reference twins -------------------------------------------------------------------------


def rmsnorm_linear_ref(h, norm_w, eps, weight, bias=None):
    """(B, d) f32 -> (B, n_out) f32: linear(rmsnorm(h) * norm_w)."""
    return F.linear(residual_rmsnorm_ref(h, None, None, norm_w, eps)[1], weight.float(), bias)


def conv_x_proj_ref(x, conv_state, conv_w, conv_b, x_proj_w):
    """x (B, E) -> xc (B, E) f32 after conv + SiLU, and dbc (B, R+2N) f32; updates conv_state."""
    xc = conv_step_ref(x, conv_state, conv_w, conv_b)
    return xc, F.linear(xc, x_proj_w.float())


def ssm_step_ref(dbc, xc, z, ssm_state, dt_proj_w, dt_bias, A, D):
    """One recurrence step -> y (B, E) f32 (D skip and SiLU(z) gate applied); updates ssm_state."""
    N = A.shape[1]
    R = dbc.shape[1] - 2 * N
    dt = F.linear(dbc[:, :R], dt_proj_w.float())  # (B, E)
    return ssm_update_ref(dt, dbc[:, R : R + N], dbc[:, R + N :], xc, z, ssm_state, dt_bias, A, D)


def out_proj_residual_ref(y, weight, bias, h):
    """h + y @ weight.T + bias, f32."""
    return h + F.linear(y.float(), weight.float(), bias)


def embed_ref(tokens, embedding):
    return embedding[tokens].float()


# -- kernels -----------------------------------------------------------------------------------


@jit
def _mm(x, w):
    """x (1, K) f32 times w (N, K).T -> (1, N) f32: a float32 multiply-and-sum, the fastest
    way to stream a matrix past one row (16-bit weights upcast exactly, float32 products)."""
    return tl.sum(w.to(tl.float32) * x, axis=1)[None, :]


@jit
def _mm_terms(x, w, SUM_LAST: tl.constexpr):
    """_mm's products for one K tile, to add up over a loop of K tiles and finish with
    _mm_total. With SUM_LAST: the (N, K) products themselves, unsummed (their sum across
    the tile's threads and warps, a shared-memory round trip with barriers, then runs once
    after the loop instead of once a tile); otherwise _mm's (1, N)."""
    if SUM_LAST:
        return w.to(tl.float32) * x
    else:
        return _mm(x, w)


@jit
def _mm_total(acc, SUM_LAST: tl.constexpr):
    """The (1, N) product from the _mm_terms added up over K."""
    if SUM_LAST:
        return tl.sum(acc, axis=1)[None, :]
    else:
        return acc


# The split-K partial sums of x_proj and out_proj meet in fixed point: int64 in units of
# 2^-32, so that the atomic adds of the splits are exact and their order cannot change
# the result. Each partial loses under 2^-32 (truncated), so a sum of S splits is within
# S * 2^-32 of the exact one: about float32's own rounding of values near 1, for S = 160
# (2.8b). Clamped to +-2^20 first (no working model comes near), a partial leaves room for
# 2^11 splits; a NaN one reads back finite, but the conv output that made it carries it
# on (D skip, state).
FIXED_SCALE = 2.0**32  # the host-side twin of FIXED_ONE, for from_fixed / to_fixed
FIXED_ONE = tl.constexpr(FIXED_SCALE)
FIXED_LIMIT = tl.constexpr(2.0**20)


@jit
def _from_fixed(v):
    return v.to(tl.float32) * (1.0 / FIXED_ONE)


@jit
def _add_fixed(ptr, v, mask):
    """*ptr += v (float32) in fixed point, an atomic add that nothing waits for."""
    v = tl.minimum(tl.maximum(v, -FIXED_LIMIT), FIXED_LIMIT)
    tl.atomic_add(ptr, (v * FIXED_ONE).to(tl.int64), mask=mask, sem="relaxed")


def from_fixed(v: torch.Tensor) -> torch.Tensor:
    """dbc or dh as float32 (for tests and debugging)."""
    return v.float() / FIXED_SCALE


def to_fixed(v: torch.Tensor) -> torch.Tensor:
    """float32 values in dbc's and dh's fixed point (for tests)."""
    return (v.double() * FIXED_SCALE).to(torch.int64)


@jit
def _prefetch_to_l2(ptrs):
    """Asks for the lines at ptrs to be fetched into L2, without waiting or holding
    registers: for weights a kernel reads only after its wait, fetched while the kernel
    before it, latency-bound, leaves the memory idle. On the GPU only (a no-op in the
    interpreter)."""
    if not INTERPRET:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1,
        )


@jit
def _embed_kernel(tok_ptr, emb_ptr, h_ptr, dh_ptr, B, D, BN: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior_kernel(PDL)
    pid_b = tl.program_id(0)  # rows first: see DecodeStep
    pid_n = tl.program_id(1)
    rows = pid_b + tl.arange(0, 1)  # the row, as a 1-vector: tiles are (1, n)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < B
    m = rmask[:, None] & (cols < D)[None, :]
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    x = tl.load(emb_ptr + tok[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(h_ptr + rows[:, None] * D + cols[None, :], x, mask=m)
    tl.store(dh_ptr + rows[:, None] * D + cols[None, :], tl.zeros([1, BN], dtype=tl.int64), mask=m)


@jit
def _residual_tile(h_ptr, dh_ptr, offs, mask):
    """h + dh: the residual stream with out_proj's pending share added (float32)."""
    return tl.load(h_ptr + offs, mask=mask, other=0.0) + _from_fixed(tl.load(dh_ptr + offs, mask=mask, other=0))


@jit
def _rmsnorm_linear_kernel(
    h_ptr, dh_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, cs_ptr, cw_ptr, cb_ptr, wx_ptr, xc_ptr, dbc_ptr, best_ptr,
    B, D, NOUT, E, J, eps,
    HAS_BIAS: tl.constexpr, CONV: tl.constexpr, ARGMAX: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    HAS_CB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    BJ: tl.constexpr, STAGES: tl.constexpr, SUM_LAST: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr,
):
    let_next_kernel_launch(PDL)
    pid_b = tl.program_id(0)  # rows first: see DecodeStep
    pid_n = tl.program_id(1)
    rows = pid_b + tl.arange(0, 1)  # the row, as a 1-vector: tiles are (1, n)
    rmask = rows < B
    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < NOUT
    # The weights depend on no earlier kernel: the first tile is on its way before the wait.
    k = tl.arange(0, BK)
    w = tl.load(w_ptr + n[:, None] * D + k[None, :], mask=nmask[:, None] & (k < D)[None, :], other=0.0)
    if CONV:  # so are the conv step's and x_proj's, and the conv window (this kernel's own)
        cw, cw_new, cb, window = _conv_inputs(rows, rmask, n, cs_ptr, cw_ptr, cb_ptr, E, K, KP, HAS_CB, BN)
        if pid_n * BN < E:  # x_proj's columns into L2 (loaded after the GEMV: see below)
            j = tl.minimum(tl.arange(0, BJ), J - 1)
            _prefetch_to_l2(wx_ptr + j[:, None] * E + pid_n * BN + tl.arange(0, 2)[None, :] * (BN - 1))
    wait_for_prior_kernel(PDL)
    # rmsnorm(h) * nw @ W.T = rstd * ((h * nw) @ W.T): the row's squares add up along the
    # same loop, element-wise (one sum across threads at the end, not one a tile), and
    # scale the sums at the end, so no pass over h comes first.
    # h is the residual plus the last out_proj's share, still in dh (see ssm_step).
    # The first tile's product, then the rest in a loop (carrying a prefetched tile through
    # it in registers doubled the registers and halved the bandwidth; STAGES > 1 streams
    # tiles through shared memory instead: slower here).
    hk = _residual_tile(h_ptr, dh_ptr, rows[:, None] * D + k[None, :], rmask[:, None] & (k < D)[None, :])
    nw = tl.load(nw_ptr + k, mask=k < D, other=0.0)
    sq = hk * hk
    acc = _mm_terms(hk * nw[None, :], w, SUM_LAST)
    for k0 in tl.range(BK, D, BK, num_stages=STAGES, loop_unroll_factor=UNROLL):
        k = k0 + tl.arange(0, BK)
        kmask = k < D
        hk = _residual_tile(h_ptr, dh_ptr, rows[:, None] * D + k[None, :], rmask[:, None] & kmask[None, :])
        nw = tl.load(nw_ptr + k, mask=kmask, other=0.0)
        w = tl.load(w_ptr + n[:, None] * D + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        sq += hk * hk
        acc += _mm_terms(hk * nw[None, :], w, SUM_LAST)
    acc = _mm_total(acc, SUM_LAST) * (1.0 / tl.sqrt(tl.sum(sq, 1) / D + eps))[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * NOUT + n[None, :], acc, mask=rmask[:, None] & nmask[None, :])
    if ARGMAX:  # lm_head for greedy sampling: each row's best so far, across programs
        tl.atomic_max(best_ptr + rows, tl.max(_argmax_keys(acc, n, nmask), 1), mask=rmask, sem="relaxed")
    if CONV:
        if pid_n * BN < E:  # a program of in_proj's x half: its channels' conv step, x_proj
            xc = _conv_step(acc, cw, cw_new, cb, window, rows, rmask, n, cs_ptr, xc_ptr, E, K, KP)
            # x_proj's columns are loaded only now, from L2 (prefetched before the wait: 130m
            # 0.196 ms a step against 0.203 from memory); loaded into registers before the
            # wait, they slowed the whole step 1.3x (bf16) to 3.5x (float32)
            _add_x_proj_share(xc, _x_proj_columns(wx_ptr, n, E, J, BJ), rows, rmask, dbc_ptr, J, BJ)


# Greedy sampling inside lm_head: every program offers its outputs' largest value per row
# to an atomic max over int64 keys that order as (value, then the lower index) do, so
# the row's argmax needs no pass over the logits, and the order of the programs cannot
# change it (ties go to the lower index, as in torch.argmax; NaN is the largest).
ARGMAX_EMPTY = -(2**63)  # the key no output's beats: `best` before lm_head's programs
_EMPTY = tl.constexpr(ARGMAX_EMPTY)
_LOW32 = tl.constexpr(2**32 - 1)


@jit
def _ordered_bits(v):
    """float32 v -> int32 that order as the values do (NaN aside)."""
    return _flip_negative((v + 0.0).to(tl.int32, bitcast=True))  # + 0.0: -0.0 ties with 0.0


@jit
def _flip_negative(bits):
    """float32 bits with a negative value's magnitude bits reversed: float bits -> ordered
    int32 (_ordered_bits) and back, being its own inverse."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@jit
def _argmax_keys(v, n, nmask):
    """(1, BN) float32 values of outputs n -> int64 keys: the value's bits made to order
    as signed integers in the high half, 2^32 - 1 - n in the low; masked outputs lowest."""
    key = tl.where(v != v, 0x7FFFFFFF, _ordered_bits(v))
    low = _LOW32 - n.to(tl.int64)
    packed = (key.to(tl.int64) << 32) | low[None, :]
    return tl.where(nmask[None, :], packed, _EMPTY)


@jit
def _token_of_key(key):
    """The output (token id) an _argmax_keys key stands for."""
    return _LOW32 - (key & _LOW32)


@jit
def _advance_slots(tok, rows, m, step_ptr, seen_ptr, V, BR: tl.constexpr):
    """After a token is drawn for each slot: step + 1 and the token marked seen, as
    sampling.sample and sample_greedy do."""
    tl.store(step_ptr + rows, tl.load(step_ptr + rows, mask=m, other=0) + 1, mask=m)
    tl.store(seen_ptr + rows.to(tl.int64) * V + tok, tl.full([BR], 1, tl.int1), mask=m)


@jit
def _take_argmax_kernel(best_ptr, tok_ptr, hist_ptr, step_ptr, seen_ptr, B, V, BR: tl.constexpr, PDL: tl.constexpr):
    # After an lm_head with ARGMAX: the tokens (into tokens and a row of history), the
    # slots advanced; `best` emptied for the next lm_head.
    wait_for_prior_kernel(PDL)
    rows = tl.arange(0, BR)
    m = rows < B
    tok = _token_of_key(tl.load(best_ptr + rows, mask=m, other=0))
    tl.store(tok_ptr + rows, tok, mask=m)
    tl.store(hist_ptr + rows, tok, mask=m)
    _advance_slots(tok, rows, m, step_ptr, seen_ptr, V, BR)
    tl.store(best_ptr + rows, tl.full([BR], _EMPTY, tl.int64), mask=m)


@jit
def _conv_inputs(rows, rmask, n, cs_ptr, cw_ptr, cb_ptr, E, K: tl.constexpr, KP: tl.constexpr, HAS_CB: tl.constexpr, BN: tl.constexpr):
    """What the conv step of channels n needs besides x: the conv weights (BN, KP) with
    the newest tap apart (BN,), the bias (BN,) and the window's K - 1 newer inputs
    (1, BN, KP)."""
    cmask = n < E
    kk = tl.arange(0, KP)
    older = kk < K - 1
    cw = tl.load(cw_ptr + n[:, None] * K + kk[None, :], mask=cmask[:, None] & older[None, :], other=0.0)
    cw_new = tl.load(cw_ptr + n * K + K - 1, mask=cmask, other=0.0)
    if HAS_CB:
        cb = tl.load(cb_ptr + n, mask=cmask, other=0.0)
    else:
        cb = tl.zeros([BN], dtype=tl.float32)
    win = cs_ptr + rows[:, None, None] * (E * K) + n[None, :, None] * K + kk[None, None, :]
    wm = (rmask[:, None] & cmask[None, :])[:, :, None] & older[None, None, :]
    window = tl.load(win + 1, mask=wm, other=0.0)
    return cw, cw_new, cb, window


@jit
def _conv_step(x, cw, cw_new, cb, window, rows, rmask, n, cs_ptr, xc_ptr, E, K: tl.constexpr, KP: tl.constexpr):
    """Channels n's conv step + SiLU on x (1, BN) -> xc (stored, and returned with zeros
    past E); the window shifts by one, x in. The rest comes from _conv_inputs."""
    cmask = n < E
    m = rmask[:, None] & cmask[None, :]
    conv = tl.sum(window * cw[None, :, :], 2) + x * cw_new[None, :] + cb[None, :]
    xc = silu(conv)
    tl.store(xc_ptr + rows[:, None] * E + n[None, :], xc, mask=m)
    # The window, shifted left by one, goes back where it came from, with x last. Every
    # thread read its part before the wait; the barrier keeps a write from landing before
    # another thread's read of the same element.
    kk = tl.arange(0, KP)
    win = cs_ptr + rows[:, None, None] * (E * K) + n[None, :, None] * K + kk[None, None, :]
    tl.debug_barrier()
    tl.store(win, window, mask=m[:, :, None] & (kk < K - 1)[None, None, :])
    tl.store(cs_ptr + rows[:, None] * (E * K) + n[None, :] * K + K - 1, x, mask=m)
    return tl.where(m, xc, 0.0)


@jit
def _x_proj_columns(wx_ptr, n, E, J, BJ: tl.constexpr):
    """x_proj's columns for channels n: (BJ, BN)."""
    j = tl.arange(0, BJ)
    return tl.load(wx_ptr + j[:, None] * E + n[None, :], mask=(j < J)[:, None] & (n < E)[None, :], other=0.0)


@jit
def _add_x_proj_share(xc, wx, rows, rmask, dbc_ptr, J, BJ: tl.constexpr):
    """This program's share of xc @ x_proj.T, added to dbc in fixed point (exact in any order)."""
    j = tl.arange(0, BJ)
    _add_fixed(dbc_ptr + rows[:, None] * BJ + j[None, :], _mm(xc, wx), rmask[:, None] & (j < J)[None, :])


@jit
def _conv_x_proj_kernel(
    xz_ptr, cs_ptr, cw_ptr, cb_ptr, wx_ptr, xc_ptr, dbc_ptr, B, E, J,
    K: tl.constexpr, KP: tl.constexpr, HAS_CB: tl.constexpr, BN: tl.constexpr, BJ: tl.constexpr, PDL: tl.constexpr,
):
    # The conv step and x_proj as a kernel of their own, for wide models (see
    # DecodeStep.FUSED_CONV_UP_TO): the same work as in_proj's epilogue, on x from xz.
    let_next_kernel_launch(PDL)
    pid_b = tl.program_id(0)  # rows first: see DecodeStep
    pid_n = tl.program_id(1)
    rows = pid_b + tl.arange(0, 1)  # the row, as a 1-vector: tiles are (1, n)
    rmask = rows < B
    n = pid_n * BN + tl.arange(0, BN)
    cw, cw_new, cb, window = _conv_inputs(rows, rmask, n, cs_ptr, cw_ptr, cb_ptr, E, K, KP, HAS_CB, BN)
    wx = _x_proj_columns(wx_ptr, n, E, J, BJ)  # before the wait too: here registers are plenty
    wait_for_prior_kernel(PDL)
    x = tl.load(xz_ptr + rows[:, None] * (2 * E) + n[None, :], mask=rmask[:, None] & (n < E)[None, :], other=0.0)
    xc = _conv_step(x, cw, cw_new, cb, window, rows, rmask, n, cs_ptr, xc_ptr, E, K, KP)
    _add_x_proj_share(xc, wx, rows, rmask, dbc_ptr, J, BJ)


@jit
def _ssm_step_kernel(
    dbc_ptr, xc_ptr, xz_ptr, ss_ptr, dtw_ptr, dtb_ptr, A_ptr, D_ptr, y_ptr, h_ptr, dh_ptr, B, E, R, DM, eps,
    N: tl.constexpr, NP: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr,
    BE: tl.constexpr, BD: tl.constexpr, DBC_NORM: tl.constexpr, PDL: tl.constexpr,
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
    Dv = tl.load(D_ptr + e, mask=emask, other=0.0)
    sp = ss_ptr + rows[:, None, None] * (E * N) + e[None, :, None] * N + nn[None, None, :]
    sm = m[:, :, None] & nmask[None, None, :]
    s = tl.load(sp, mask=sm, other=0.0)  # (1, BE, NP)
    wait_for_prior_kernel(PDL)
    dtr = _from_fixed(tl.load(dbc_ptr + rows[:, None] * BJ + r[None, :], mask=rmask[:, None] & (r < R)[None, :], other=0))
    Bv = _from_fixed(tl.load(dbc_ptr + rows[:, None] * BJ + R + nn[None, :], mask=rmask[:, None] & nmask[None, :], other=0))
    Cv = _from_fixed(tl.load(dbc_ptr + rows[:, None] * BJ + R + N + nn[None, :], mask=rmask[:, None] & nmask[None, :], other=0))
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
    h_new = _residual_tile(h_ptr, dh_ptr, offs, hm)
    dt = _mm(dtr, w) + dtb[None, :]  # (1, BE)
    dt = softplus(dt)
    s = s * tl.exp(dt[:, :, None] * A[None, :, :]) + (dt * x)[:, :, None] * Bv[:, None, :]
    # Every thread holding an element of the state or of h / dh has read it before it is
    # rewritten (dh's zeros go out in another layout than dh came in: without a barrier a
    # 16-row version of this kernel lost shares of dh on the GPU).
    tl.debug_barrier()
    tl.store(sp, s, mask=sm)
    tl.store(h_ptr + offs, h_new, mask=hm)
    tl.store(dh_ptr + offs, tl.zeros([1, BD], dtype=tl.int64), mask=hm)
    y = tl.sum(s * Cv[:, None, :], 2) + Dv[None, :] * x
    y = y * silu(z)
    tl.store(y_ptr + rows[:, None] * E + e[None, :], y, mask=m)


@jit
def _out_proj_residual_kernel(
    y_ptr, w_ptr, b_ptr, dh_ptr, dbc_ptr, B, D, E, KCHUNK,
    HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BJ: tl.constexpr, PDL: tl.constexpr,
):
    let_next_kernel_launch(PDL)
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_b + tl.arange(0, 1)  # the row, as a 1-vector: tiles are (1, n)
    rmask = rows < B
    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < D
    k_end = tl.minimum((pid_s + 1) * KCHUNK, E)
    k = pid_s * KCHUNK + tl.arange(0, BK)  # the first weight tile is on its way before the wait
    w = tl.load(w_ptr + n[:, None] * E + k[None, :], mask=nmask[:, None] & (k < k_end)[None, :], other=0.0)
    wait_for_prior_kernel(PDL)
    # ssm_step has read dbc: the first program of each row tile zeroes the tile's rows for
    # the next layer's in_proj (jj >= 0 there, jj >= BJ or more in the others)
    jj = tl.arange(0, BJ)
    first = jj[None, :] >= (pid_n + pid_s) * BJ
    tl.store(dbc_ptr + rows[:, None] * BJ + jj[None, :], tl.zeros([1, BJ], dtype=tl.int64), mask=rmask[:, None] & first)
    acc = tl.zeros([1, BN], dtype=tl.float32)
    for k0 in range(pid_s * KCHUNK, k_end, BK):
        k = k0 + tl.arange(0, BK)
        yk = tl.load(y_ptr + rows[:, None] * E + k[None, :], mask=rmask[:, None] & (k < k_end)[None, :], other=0.0)
        w_now = w
        k = k + BK  # the next tile (nothing past this split's end)
        w = tl.load(w_ptr + n[:, None] * E + k[None, :], mask=nmask[:, None] & (k < k_end)[None, :], other=0.0)
        acc += _mm(yk, w_now)
    if HAS_BIAS:  # once, with the first split (n >= pid_s * D holds there only)
        acc += tl.load(b_ptr + n, mask=nmask & (n >= pid_s * D), other=0.0)[None, :]
    # This split's share of y @ W.T, added to dh in fixed point (exact in any order); the
    # next rmsnorm_linear reads h + dh, the ssm_step after it folds dh into h.
    _add_fixed(dh_ptr + rows[:, None] * D + n[None, :], acc, rmask[:, None] & nmask[None, :])


# -- launchers -----------------------------------------------------------------------------------


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def one_row_up_to(d_model: int, dtype: torch.dtype) -> int:
    """The largest batch that make_decode_step gives the one-row kernels; larger ones go to
    decode_gemm.py's step. A one-row step reads every weight once a row (the rows of a
    weight tile run side by side, so the copies after the first come from L2), so each row
    adds about as much L2 traffic as a batch-1 step's memory traffic, where a product reads
    each weight once for all rows at a cost that hardly grows with them. The crossover falls
    as the model widens. Whole graph-replayed steps on the H200, ms, one-row against the
    Triton products (16-bit) or cuBLAS (float32): bf16 130m batch 4 0.409 / 0.446, 5 0.461 /
    0.450, 8 0.665 / 0.460; 370m 4 1.011 / 0.924; 1.4b 2 1.442 / 1.472, 3 1.806 / 1.490;
    2.8b 2 2.355 / 2.479 (with one-warp ssm_step programs; 2.547 / 2.480 before); float32
    130m 8 0.803 / 1.183, 2.8b 3 5.514 / 9.329, 4 7.396 / 6.311."""
    if dtype == torch.float32:
        return SMALL_BATCH if d_model <= 1024 else 3
    if d_model <= 768:
        return 4
    return 3 if d_model <= 1024 else 2


def triton_products_up_to(d_model: int, dtype: torch.dtype) -> int:
    """The largest batch whose default step runs its products through gemm.py (the
    batch-invariant Triton GEMM of the deterministic mode, its kernels chained by PDL; in_proj
    through cuBLAS where cublas_in_proj says); larger ones all through cuBLAS. Whole steps on
    the H200, ms, Triton / Triton with cuBLAS's in_proj / cuBLAS: bf16 2.8b batch 16 3.062 /
    3.072 / 3.497, 32 3.445 / 3.494 / 3.965, 48 4.220 / 3.907 / 4.363, 64 4.602 / 4.280 /
    4.621, 128 6.522 / 5.880 / 5.953, 256 11.749 / 10.165 / 9.640; 1.4b 64 2.826 / 2.616 /
    2.864, 128 3.704 / 3.543 / 3.654, 256 6.570 / 5.747 / 5.631; 130m 128 0.910 / 0.860 /
    0.955, 256 1.273 / 1.249 / 1.303. float32 (three TF32 products a tile): 130m 128 1.768 /
    1.715 / 1.950, 256 2.333 / 2.503 / 2.967; 1.4b 128 8.962 / 9.810 / 11.372, 256 16.863 /
    17.619 / 18.990; 2.8b 128 18.111 / 18.826 / 20.804 (256 not measured)."""
    if dtype == torch.float32:
        return 256 if d_model <= 2048 else 128
    return 256 if d_model <= 1024 else 128


def cublas_in_proj(batch: int, d_model: int, dtype: torch.dtype) -> bool:
    """Whether the default step's in_proj, the largest product, goes to cuBLAS within
    triton_products_up_to. 16-bit weights: above 32 rows, where gemm.py's 64-row tiles read
    its weights at 1.3 TB/s (tables in triton_products_up_to). float32: from 33 to 64 rows,
    where tf32x3's 64-row tiles run partly empty, and on the wide models also from 17 (its
    16-row tiles read in_proj's weights again each 16 rows) and up to 6 (where cuBLAS picks
    a GEMV-like kernel). Whole steps, ms, Triton / Triton with cuBLAS's in_proj (/ cuBLAS):
    1.4b batch 4 3.699 / 3.442, 6 3.779 / 3.604, 7 3.819 / 4.307, 16 4.050 / 5.307 / 6.932,
    32 6.062 / 5.471 / 5.712, 64 7.246 / 6.869 / 7.157; 2.8b 4 6.384 / 5.767, 5 6.400 /
    6.299, 6 6.675 / 6.621, 7 6.511 / 7.348, 16 7.301 / 8.422 / 10.269, 32 10.605 / 9.498 /
    9.909, 64 12.562 / 12.097 / 12.527; 130m 17 0.933 / 0.946, 32 0.960 / 0.983, 40 1.232 /
    1.152, 64 1.381 / 1.296; 370m 17 2.169 / 2.296, 32 2.250 / 2.379, 40 2.958 / 2.767, 64
    3.503 / 3.298."""
    if dtype == torch.float32:
        return 32 < batch <= 64 or (d_model > 1024 and (batch <= 6 or 16 < batch <= 64))
    return batch > 32


def make_decode_step(model, batch: int, deterministic: bool = False):
    """The fastest decode step for this batch size: Triton GEMVs (one row a program) up to
    one_row_up_to rows, decode_gemm.py's step above, its products through gemm.py up to
    triton_products_up_to rows (in_proj through cuBLAS where cublas_in_proj says) and
    through cuBLAS beyond; with `deterministic`, decode_gemm.py's step with gemm.py's
    batch-invariant products at every batch size, so that a slot's bits never depend on
    the batch."""
    d, dtype = model.config.d_model, model.weights.embedding.dtype
    if not deterministic and batch <= one_row_up_to(d, dtype):
        return DecodeStep(model, batch)
    from .decode_gemm import GemmDecodeStep

    if deterministic:
        return GemmDecodeStep(model, batch, triton_products=True)
    triton = batch <= triton_products_up_to(d, dtype)
    return GemmDecodeStep(model, batch, triton_products=triton, cublas_in_proj=triton and cublas_in_proj(batch, d, dtype))


class DecodeStep:
    """Launch plan and scratch buffers for one batch size; `__call__` runs one decode step.

    One row a program. Block sizes depend on the model's shapes only, never on the batch
    size, so a slot's result is the same for every batch size it runs at.

    Every kernel's grid has the rows as its first, fastest-varying axis:
    the programs that read the same weight tile for different rows are launched side by
    side, so the tile comes from memory once and from L2 for the other rows. With the rows
    last, each row's programs swept the whole matrix before the next row's began, and a
    matrix larger than L2 was read from memory once a row (2.8b bf16: batch 8 9.63 ms a
    step against 7.31, batch 2 2.92 against 2.55).
    """

    # Launch settings, chosen by timing whole graph-replayed batch-1 steps
    # (benchmarks/tune_decode.py --in-graph).
    @staticmethod
    def ssm_blocks(d_model: int) -> tuple[int, int]:
        """ssm_step's channels a program and warps: few channels a program, one warp,
        so that the chain after its wait (dt_proj's sum over dt_rank, softplus, the state,
        the sum over the states for y) runs in one warp's registers and shuffles, with no
        barrier between warps, and many programs share the work. bf16 batch 1, whole steps,
        A B .. B A twice, means, ms, 16 channels and 4 warps (as before) / 8 and 1 / 4 and
        1: 130m 0.2075 / 0.2028 / **0.1978**, 370m 0.4664 / 0.4363 / **0.4260**, 1.4b
        0.9884 / **0.9727** / 0.9778, 2.8b 1.7410 / **1.7045** / 1.7253; float32 130m 0.2463
        / 0.2444 / **0.2395**, 2.8b 3.1276 / **3.0821** / 3.0910."""
        return (4 if d_model <= 1024 else 8), 1
    # in_proj does the conv step and x_proj itself up to this d_model; wider models run them
    # as a kernel of their own. bf16 batch 1, ms a step, in in_proj against on their own
    # (H200, 2026-11-30): 130m 0.232 / 0.282, 370m 0.498 / 0.622 (on their own: the
    # previous commit); 1.4b 1.217 / 1.140, 2.8b 2.19 / 2.008. In in_proj, x_proj's
    # columns load after the product (held through it they cost resident programs), and
    # the extra latency outweighs the saved boundary once the product is long.
    # (Re-measured with 128-channel conv_x_proj programs: 130m 0.211 / 0.221, 370m 0.457 /
    # 0.496; 1.4b 1.618 / 0.995, 2.8b 2.389 / 1.798.)
    FUSED_CONV_UP_TO = 1024
    # conv_x_proj's channels a program where it runs alone (see conv_warps): its
    # programs all finish at once, right after the wait, and each adds its share of all of
    # x_proj's outputs to the same few addresses, so fewer programs queue fewer atomic adds
    # there. bf16 batch 1, ms a step, 32 / 64 / 128 / 256 channels: 1.4b 1.100 / 1.022 /
    # 0.995 / 1.182, 2.8b 1.954 / 1.852 / 1.798 / 2.035.
    CONV_BLOCK = 128

    @staticmethod
    def conv_warps(block: int) -> int:
        """conv_x_proj's warps for `block` channels a program: one a 16 channels, at least 4
        (x_proj's columns, held from before the wait, then take 100-160 registers a thread
        at 128 channels, tools/compile_kernels.py)."""
        return max(4, block // 16)

    # Kernels that let the next kernel launch as soon as all their programs have
    # started instead of after their wait (PDL 2), so that it loads its first weights
    # sooner: ssm_step and out_proj (bf16 batch 1, whole steps, against none: 130m 0.339
    # ms / 0.360, 370m 0.762 / 0.800, 1.4b 1.344 / 1.394; at 2.8b it once lost, 2.254 /
    # 2.239, and wins since conv_x_proj runs 128 channels a program: 1.786 / 1.796), and
    # conv_x_proj where it runs (the wide models; since ssm_step runs one warp a program:
    # 1.4b 0.964 / 0.973, 2.8b 1.698 / 1.701). ssm_step reads nothing before its wait that
    # in_proj or conv_x_proj write, and conv_x_proj cannot finish before in_proj has.
    EARLY_LAUNCH = frozenset({"conv_x_proj", "ssm_step", "out_proj_residual"})
    # in_proj and lm_head with weights of these dtypes sum their products over K
    # once, after their loop (_mm_terms); out_proj and float32 weights sum every K tile.
    # Summed after the loop, out_proj made 2.8b's bf16 step 1.939 ms against 1.800;
    # float32 in_proj 3.280 against 3.152 at 2.8b (1.4b: 1.555 against 1.625). With
    # in_proj's blocks: see linear_blocks; models whose d_model fits one K tile sum it at
    # once (_rmsnorm_linear).
    SUM_LAST = frozenset({torch.bfloat16, torch.float16})
    # lm_head's K tiles where it sums after its loop (bf16 batch 1, whole steps in the
    # order A B B A, against linear_blocks' 1024 / 512 summed every tile: 130m 0.1900 /
    # 0.2029 ms against 0.1955 / 0.2086, 370m 0.4538 / 0.4525 against 0.4554 / 0.4551,
    # 1.4b 0.9914 / 0.9913 against 0.9936 / 0.9944, 2.8b 1.7631 / 1.7640 against 1.7660 /
    # 1.7661; float32 in 256-wide tiles summed every tile lost: 130m 0.2445 against
    # 0.2425, 2.8b 3.1620 against 3.1589; tune_decode.py --lm-head-sum-last).
    LM_HEAD_K_TILE = 256
    # in_proj's K loop unrolled by this much where its products are summed after the loop
    # (16-bit weights, d_model past one K tile): two tiles' loads in flight a thread, not one
    # (bf16 batch 1, whole steps, A B C D D C B A twice, means, ms, against no unroll: 1.4b
    # 0.9919 / 1.0070, 2.8b 1.7492 / 1.7680). lm_head unrolled gained nothing (1.4b 1.0017,
    # 2.8b 1.7680); float32 in_proj lost at 2.8b (3.608 against 3.166, in_proj and lm_head
    # both unrolled); 4 lost everywhere (2.8b bf16 1.992); benchmarks/RESULTS.md.
    IN_PROJ_UNROLL = 2

    @staticmethod
    def out_blocks(d_model: int) -> tuple[int, int, int, int]:
        """out_proj's BN, BK, warps, and the programs to aim for by splitting K.
        Whole bf16 batch-1 steps: (8, 512, 4) and 640 against (32, 256, 4) and 320: 130m
        0.398 ms / 0.430, 2.8b 2.494 / 2.512; above d_model 1024 (8, 256, 4) and 1280
        against those: 1.4b 1.137 / 1.140, 2.8b 1.959 / 1.976 (fresh processes, twice)."""
        return (8, 256, 4, 1280) if d_model > 1024 else (8, 512, 4, 640)

    @staticmethod
    def linear_blocks(n_out: int, d: int) -> tuple[int, int, int, int]:
        """rmsnorm_linear's (BN, BK, warps, pipeline stages of its loop) for n_out outputs of
        d inputs: 16 rows a program (2.8b in_proj: 2.72 ms a step against 2.82
        with 32; lm_head: 130m 0.333 ms against 0.339 with 64, 2.8b 2.238 / 2.250), and
        rows of up to 1024 in one tile, all of it loaded before the wait (130m in_proj
        0.331 ms against 0.339 in two tiles of 512); tune_decode.py --in-graph, --lm-head.
        Wider in_proj (n_out = 4 d), whose products are summed after the loop (sum_last),
        walks K in tiles of 256 (bf16 batch 1, whole steps, against 512 tiles summed in
        every step: 2.8b 1.773 / 1.775 ms against 1.800 / 1.799, 1.4b 0.995 / 0.995 against
        0.997 / 0.998; summed after the loop with 512 tiles 1.876 / 1.034, and 256 tiles
        summed every step 2.016 / 1.152: tune_decode.py --sum-last); so does float32's,
        summed every tile (2.8b 3.152 against 3.189 with 512, 1.4b 1.625 against 1.603-1.613:
        --sum-last --f32)."""
        # 1.4b's in_proj (n_out = 4 d) 8 rows a program: 1.120 ms against 1.140 (2.8b's:
        # 2.240 against 1.976)
        in_proj = n_out == 4 * d
        return (8 if 1024 < d <= 2048 and in_proj else 16), (1024 if d <= 1024 else (256 if in_proj else 512)), 4, 1

    def __init__(self, model, batch: int):
        c, w = model.config, model.weights
        dev = w.embedding.device
        self.model, self.B = model, batch
        self.sum_last = w.embedding.dtype in self.SUM_LAST
        d, E, N, R = c.d_model, c.d_inner, c.d_state, c.dt_rank
        self.J, self.BJ = R + 2 * N, _pow2(R + 2 * N)
        self.BR, self.NP = _pow2(R), _pow2(N, 1)
        # out_proj: BN_out-wide tiles of d, K split so that enough programs stream the weights.
        self.BN_out, self.BK_out, self.warps_out, programs = self.out_blocks(d)
        self.nt_d = triton.cdiv(d, self.BN_out)
        self.nsplit_out = max(1, min(16, programs // self.nt_d, triton.cdiv(E, self.BK_out)))
        self.kchunk_out = triton.cdiv(triton.cdiv(E, self.nsplit_out), self.BK_out) * self.BK_out
        self.nsplit_out = triton.cdiv(E, self.kchunk_out)  # whole BK steps per split may need fewer
        self.BE_ssm, self.warps_ssm = self.ssm_blocks(d)
        self.BD_ssm = triton.next_power_of_2(triton.cdiv(d, triton.cdiv(E, self.BE_ssm)))  # h columns each folds
        self.fused_conv = d <= self.FUSED_CONV_UP_TO
        self.BN_conv = self.CONV_BLOCK
        f32 = dict(device=dev, dtype=torch.float32)
        self.h = torch.zeros(batch, d, **f32)
        self.dh = torch.zeros(batch, d, device=dev, dtype=torch.int64)  # out_proj's share, fixed point
        self.xz = torch.zeros(batch, 2 * E, **f32)
        self.xc = torch.zeros(batch, E, **f32)
        self.y = torch.zeros(batch, E, **f32)
        self.dbc = torch.zeros(batch, self.BJ, device=dev, dtype=torch.int64)  # fixed point: see FIXED_ONE
        self.logits = torch.zeros(batch, c.vocab_size, **f32)
        self.best = torch.full((batch,), ARGMAX_EMPTY, device=dev, dtype=torch.int64)  # see _argmax_keys
        self.pdl = pdl_launch(dev)

    def pdl_for(self, kernel: str) -> dict:
        """The PDL launch settings for one of the step's kernels (see pdl.let_next_kernel_launch)."""
        if self.pdl["PDL"] and kernel in self.EARLY_LAUNCH:
            return dict(self.pdl, PDL=2)
        return self.pdl

    # Each method launches one kernel on the scratch buffers; __call__ chains them.

    def embed(self, tokens: torch.Tensor) -> None:
        """h[:B] = embedding[tokens], dh = 0."""
        emb = self.model.weights.embedding
        _embed_kernel[(self.B, self.nt_d)](tokens, emb, self.h, self.dh, self.B, emb.shape[1], BN=self.BN_out, **self.pdl)

    def _rmsnorm_linear(self, norm_w, weight, bias, out, conv=None, argmax=False, sum_last=False, k_tile=None, unroll=1) -> None:
        """out[:B] = linear(rmsnorm(h + dh) * norm_w, weight, bias); with conv = (lw,
        conv_state), out is xz, and the x half goes on through the conv step and x_proj;
        with argmax, each row's argmax goes into `best` too (see _argmax_keys). sum_last:
        one row's products summed over K once, after the loop (_mm_terms), where d takes
        more than one K tile (in one tile the products would wait through the loop in
        registers for nothing: 370m bf16 0.513 ms a step against 0.456). k_tile: K tiles
        of this width instead of linear_blocks' (lm_head: LM_HEAD_K_TILE). unroll: the K loop
        unrolled by this much where the products are summed after it (IN_PROJ_UNROLL)."""
        n_out, d = weight.shape
        BN, BK, warps, stages = self.linear_blocks(n_out, d)
        BK = k_tile or BK
        sum_last = sum_last and d > BK
        grid = (self.B, triton.cdiv(n_out, BN))
        c = self.model.config
        if conv is not None:
            lw, conv_state = conv
            cb = lw.conv_b if lw.conv_b is not None else lw.conv_w
            conv_args = (conv_state, lw.conv_w, cb, lw.x_proj_w, self.xc, self.dbc)
        else:  # unused pointers
            conv_args = (out,) * 6
        _rmsnorm_linear_kernel[grid](
            self.h, self.dh, norm_w, weight, bias if bias is not None else weight, out, *conv_args, self.best,
            self.B, d, n_out, c.d_inner, self.J, c.norm_eps,
            HAS_BIAS=bias is not None, CONV=conv is not None, ARGMAX=argmax, K=c.d_conv, KP=triton.next_power_of_2(c.d_conv),
            HAS_CB=conv is not None and conv[0].conv_b is not None,
            BN=BN, BK=BK, BJ=self.BJ, STAGES=stages, SUM_LAST=sum_last, UNROLL=unroll if sum_last else 1,
            num_warps=warps, **self.pdl_for("rmsnorm_linear"),
        )

    def in_proj(self, lw, conv_state) -> None:
        """xz[:B] = in_proj(rmsnorm(h + dh) * norm_w); then from its x half the conv step +
        SiLU -> xc, conv_state (B, E, K) updated, and xc @ x_proj.T added to dbc (zero
        before: out_proj_residual leaves it so): in in_proj's own programs up to
        FUSED_CONV_UP_TO, else in a second kernel."""
        linear = dict(sum_last=self.sum_last, unroll=self.IN_PROJ_UNROLL)
        if self.fused_conv:
            self._rmsnorm_linear(lw.norm_w, lw.in_proj_w, lw.in_proj_b, self.xz, conv=(lw, conv_state), **linear)
            return
        self._rmsnorm_linear(lw.norm_w, lw.in_proj_w, lw.in_proj_b, self.xz, **linear)
        c = self.model.config
        _conv_x_proj_kernel[(self.B, triton.cdiv(c.d_inner, self.BN_conv))](
            self.xz, conv_state, lw.conv_w, lw.conv_b if lw.conv_b is not None else lw.conv_w,
            lw.x_proj_w, self.xc, self.dbc, self.B, c.d_inner, self.J,
            K=c.d_conv, KP=triton.next_power_of_2(c.d_conv), HAS_CB=lw.conv_b is not None,
            BN=self.BN_conv, BJ=self.BJ, num_warps=self.conv_warps(self.BN_conv), **self.pdl_for("conv_x_proj"),
        )

    def lm_head(self, argmax: bool = False) -> None:
        """logits[:B] = lm_head(rmsnorm(h + dh) * norm_f); with argmax, each row's argmax
        into `best` too, for take_argmax."""
        w = self.model.weights
        k_tile = self.LM_HEAD_K_TILE if self.sum_last else None
        self._rmsnorm_linear(w.norm_f, w.lm_head, None, self.logits, argmax=argmax, sum_last=self.sum_last, k_tile=k_tile)

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
        _ssm_step_kernel[(self.B, triton.cdiv(c.d_inner, self.BE_ssm))](
            self.dbc, self.xc, self.xz, ssm_state, lw.dt_proj_w, lw.dt_bias, lw.A, lw.D, self.y, self.h, self.dh,
            self.B, c.d_inner, c.dt_rank, c.d_model, c.dbc_norm_eps or 0.0, N=c.d_state, NP=self.NP, BJ=self.BJ,
            BR=self.BR, BE=self.BE_ssm, BD=self.BD_ssm, DBC_NORM=c.dbc_norm_eps is not None, num_warps=self.warps_ssm,
            **self.pdl_for("ssm_step"),
        )

    def out_proj_residual(self, lw) -> None:
        """dh += y @ out_proj.T + bias (dh is zero before: ssm_step leaves it so); zeroes dbc."""
        c = self.model.config
        _out_proj_residual_kernel[(self.B, self.nt_d, self.nsplit_out)](
            self.y, lw.out_proj_w, lw.out_proj_b if lw.out_proj_b is not None else lw.out_proj_w,
            self.dh, self.dbc, self.B, c.d_model, c.d_inner, self.kchunk_out,
            HAS_BIAS=lw.out_proj_b is not None, BN=self.BN_out, BK=self.BK_out, BJ=self.BJ, num_warps=self.warps_out, **self.pdl_for("out_proj_residual"),
        )

    def __call__(self, tokens: torch.Tensor, state, argmax: bool = False, h: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B,) -> logits (B, V) f32; updates `state` (conv, ssm of B slots). With
        argmax, take_argmax must follow (it empties `best` for the next step). h (B, d) f32:
        vectors in place of the embedding lookup (fastmamba.Backbone's step; tokens unused)."""
        w = self.model.weights
        if h is None:
            self.embed(tokens)
        else:
            self.h[: self.B].copy_(h)
            self.dh.zero_()
        for i, lw in enumerate(w.layers):
            self.in_proj(lw, state.conv[i])
            self.ssm_step(lw, state.ssm[i])
            self.out_proj_residual(lw)
        self.lm_head(argmax)
        return self.logits[: self.B]
