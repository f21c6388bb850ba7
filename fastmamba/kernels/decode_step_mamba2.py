"""Mamba-2's decode step as one-row Triton kernels, three launches a layer (the plan's
"one-row" step for a Mamba-2 model), with their `_ref` twins.

One step, per layer, for B slots (rows), h + dh the residual stream as in decode_step.py
(dh: the last out_proj's share, in fixed point, not yet folded into h):

    rmsnorm_linear   h + dh -> rmsnorm * norm_w -> in_proj   -> zxbcdt (B, 2E + 2GN + H)
                     (decode_step.py's kernel, unchanged)
    ssd_conv_step    per row, head and BP of its channels: the conv step + SiLU of its x
                     channels and of its group's B and C, the step size, the state update,
                     the D skip, the gate: v = y * silu(z) (or y, norm_before_gate) -> (B, E),
                     and v's sum of squares over the program's channels -> part (B, programs);
                     h += dh, dh = 0 (as ssm_step)
    gated_out_proj   each group's rms from the parts (a fixed order), then
                     dh += (v / rms * gate_norm_w (* silu(z))) @ out_proj.T (+ bias);
                     and B's and C's conv windows shift by one, a share in each program

and around the layers the Mamba-1 step's embed, lm_head (+ argmax) and take_argmax.
Against the layer over the GPU ops ("layer-ops": seven launches a layer) this is the
Mamba-1 step's design: GEMVs a row a program, the small work inside the launches around
it, PDL between them. A row's result does not depend on the batch: every sum has a fixed
order (the parts: by program; dh: in fixed point).

Why B's and C's conv windows move in gated_out_proj: every head of a group computes the
group's B and C from the same window, so no program of ssd_conv_step may write it until
all have read it; the next kernel moves it after its wait, when they all have finished.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton
from .activations import silu
from .decode_step import DecodeStep
from .fp8_gemm import linear_ref, weight_parts
from .gated_norm import gated_rmsnorm_ref, group_rmsnorm_ref
from .gemv import add_fixed, add_row_tile, residual_tile, row_sums, row_total, split_k_start
from .pdl import let_next_kernel_launch, wait_for_prior_kernel
from .ssd import ssd_scan_ref, ssd_step_update

# -- reference twins -------------------------------------------------------------------------


def ssd_conv_step_ref(zxbcdt, conv_state, ssm_state, lw, c) -> torch.Tensor:
    """zxbcdt (B, 2E + 2GN + H) f32 (in_proj's output) -> v (B, E) f32: the conv step +
    SiLU of x, B, C, the state update, y = s C + D x, gated (y * silu(z), or y where
    norm_before_gate); updates conv_state (B, E + 2GN, K) and ssm_state (B, H, P, N)."""
    E, G, N, H, P = c.d_inner, c.n_groups, c.d_state, c.n_heads, c.head_dim
    z, xbc, dt = zxbcdt.split([E, E + 2 * G * N, H], dim=-1)
    window = torch.cat([conv_state[:, :, 1:].float(), xbc[:, :, None]], dim=-1)  # (B, E + 2GN, K)
    conv_state.copy_(window)
    xbc = F.silu(torch.linalg.vecdot(window, lw.conv_w) + (lw.conv_b if lw.conv_b is not None else 0))
    x, Bm, Cm = xbc.split([E, G * N, G * N], dim=-1)
    y = ssd_scan_ref(x.view(-1, 1, H, P), dt[:, None], lw.dt_bias, c.dt_limit, lw.A, Bm.view(-1, 1, G, N),
                     Cm.view(-1, 1, G, N), lw.D, ssm_state, 1)[:, 0].flatten(-2)
    return y if c.norm_before_gate and lw.gate_norm_w is not None else y * F.silu(z)


def gated_out_proj_ref(v, zxbcdt, lw, c) -> torch.Tensor:
    """v (B, E) from ssd_conv_step -> out_proj(gated norm) (B, d) f32: the group RMSNorm of
    v times gate_norm_w (then times silu(z) where norm_before_gate); v itself where the
    layer has no norm."""
    E, G = c.d_inner, c.n_groups
    z = zxbcdt[:, :E]
    if lw.gate_norm_w is None:  # no norm (Falcon-H1's option): v is y * silu(z) already
        u = v
    elif c.norm_before_gate:
        u = gated_rmsnorm_ref(v, z, lw.gate_norm_w, G, c.norm_eps, True)
    else:  # v is y * silu(z) already: its group norm, with no gate after
        u = group_rmsnorm_ref(v, lw.gate_norm_w, G, c.norm_eps)
    return linear_ref(u, lw.out_proj_w, lw.out_proj_b)


# -- kernels -----------------------------------------------------------------------------------


@jit
def _conv_window(cs_ptr, cw_ptr, cb_ptr, row, ch, chmask, CS, K: tl.constexpr, KP: tl.constexpr,
                 HAS_CB: tl.constexpr):
    """Channels ch's conv weights for the K - 1 older taps (C, KP), the newest tap's (C,),
    the bias (C,), and the window's K - 1 newer inputs (C, KP), in float32. CS: channels a
    row's conv state holds."""
    kk = tl.arange(0, KP)
    older = kk < K - 1
    m = chmask[:, None] & older[None, :]
    cw = tl.load(cw_ptr + ch[:, None] * K + kk[None, :], mask=m, other=0.0)
    cw_new = tl.load(cw_ptr + ch * K + K - 1, mask=chmask, other=0.0)
    if HAS_CB:
        cb = tl.load(cb_ptr + ch, mask=chmask, other=0.0)
    else:
        cb = tl.zeros(ch.shape, dtype=tl.float32)
    window = tl.load(cs_ptr + (row * CS + ch[:, None]) * K + kk[None, :] + 1, mask=m, other=0.0).to(tl.float32)
    return cw, cw_new, cb, window


@jit
def _ssd_conv_step_kernel(
    zx_ptr, cs_ptr, cw_ptr, cb_ptr, ss_ptr, dtb_ptr, A_ptr, D_ptr, v_ptr, part_ptr, h_ptr, dh_ptr,
    DM, heads_per_group, dt_min, dt_max,
    E: tl.constexpr, G: tl.constexpr, N: tl.constexpr, H: tl.constexpr, P: tl.constexpr, K: tl.constexpr,
    KP: tl.constexpr, HAS_CB: tl.constexpr, BP: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr, PDL: tl.constexpr,
):
    let_next_kernel_launch(PDL)
    row = tl.program_id(0)  # rows first: see DecodeStep
    h = tl.program_id(1)
    pb = tl.program_id(2)
    prog = h * tl.num_programs(2) + pb  # this program's index in its row
    row64 = row.to(tl.int64)
    g = h // heads_per_group
    p = pb * BP + tl.arange(0, BP)
    pm = p < P
    n = tl.arange(0, NP)
    nm = n < N
    CS: tl.constexpr = E + 2 * G * N  # a row's conv channels: x, B, C
    W: tl.constexpr = 2 * E + 2 * G * N + H  # in_proj's outputs: z, x, B, C, dt
    xch = h * P + p  # this program's x channels (of xBC and of the conv state)
    bch = E + g * N + n  # its group's B channels, then C's
    cch = E + G * N + g * N + n
    # Before the wait: this kernel's own from the last step (the states, the conv windows)
    # and the weights.
    sp = ss_ptr + ((row64 * H + h) * P + p[:, None]) * N + n[None, :]
    sm = pm[:, None] & nm[None, :]
    s = tl.load(sp, mask=sm, other=0.0).to(tl.float32)  # (BP, NP); the state may be 16-bit
    xw, xw_new, xb, xwin = _conv_window(cs_ptr, cw_ptr, cb_ptr, row64, xch, pm, CS, K, KP, HAS_CB)
    bw, bw_new, bb, bwin = _conv_window(cs_ptr, cw_ptr, cb_ptr, row64, bch, nm, CS, K, KP, HAS_CB)
    cw, cw_new, cb, cwin = _conv_window(cs_ptr, cw_ptr, cb_ptr, row64, cch, nm, CS, K, KP, HAS_CB)
    A = tl.load(A_ptr + h)
    Dv = tl.load(D_ptr + h)
    dtb = tl.load(dtb_ptr + h)
    wait_for_prior_kernel(PDL)
    zx = zx_ptr + row64 * W
    x_in = tl.load(zx + E + xch, mask=pm, other=0.0)
    x = silu(tl.sum(xwin * xw, 1) + x_in * xw_new + xb)
    Bv = silu(tl.sum(bwin * bw, 1) + tl.load(zx + E + bch, mask=nm, other=0.0) * bw_new + bb)
    Cv = silu(tl.sum(cwin * cw, 1) + tl.load(zx + E + cch, mask=nm, other=0.0) * cw_new + cb)
    Bv, Cv = tl.where(nm, Bv, 0.0), tl.where(nm, Cv, 0.0)
    s = ssd_step_update(s, x, Bv, tl.load(zx + 2 * E + 2 * G * N + h), dtb, A, dt_min, dt_max)
    y = tl.sum(s * Cv[None, :], 1) + Dv * x
    if not NORM_BEFORE_GATE:
        y = y * silu(tl.load(zx + xch, mask=pm, other=0.0))
    y = tl.where(pm, y, 0.0)
    # in_proj has read h + dh: this program folds its BD columns of dh into h and zeroes
    # them for the next out_proj (as ssm_step)
    cols = prog * BD + tl.arange(0, BD)
    hm = cols < DM
    h_new = residual_tile(h_ptr, dh_ptr, row64 * DM + cols, hm)
    # Every thread has read its part of the state, the x channels' windows and h / dh
    # before any of them is rewritten (see ssm_step).
    tl.debug_barrier()
    tl.store(sp, s.to(ss_ptr.dtype.element_ty), mask=sm)  # rounded once, where the state is 16-bit
    kk = tl.arange(0, KP)
    win = cs_ptr + (row64 * CS + xch[:, None]) * K + kk[None, :]
    tl.store(win, xwin.to(cs_ptr.dtype.element_ty), mask=pm[:, None] & (kk < K - 1)[None, :])  # shifted left
    tl.store(cs_ptr + (row64 * CS + xch) * K + K - 1, x_in.to(cs_ptr.dtype.element_ty), mask=pm)
    tl.store(h_ptr + row64 * DM + cols, h_new, mask=hm)
    tl.store(dh_ptr + row64 * DM + cols, tl.zeros([BD], dtype=tl.int64), mask=hm)
    tl.store(v_ptr + row64 * E + xch, y, mask=pm)
    tl.store(part_ptr + row64 * tl.num_programs(1) * tl.num_programs(2) + prog, tl.sum(y * y, 0))


@jit
def _gated_out_proj_kernel(
    v_ptr, zx_ptr, part_ptr, gw_ptr, w_ptr, ws_ptr, b_ptr, dh_ptr, cs_ptr, D, KCHUNK, eps,
    E: tl.constexpr, G: tl.constexpr, N: tl.constexpr, H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    PARTS: tl.constexpr, PPG: tl.constexpr, GP: tl.constexpr, PPGP: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    BC: tl.constexpr, TILE_IN_GROUP: tl.constexpr, W_SCALED: tl.constexpr, PDL: tl.constexpr, MMA: tl.constexpr,
):
    let_next_kernel_launch(PDL)
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    row64 = row.to(tl.int64)
    n, nmask, k_end, w = split_k_start(w_ptr, D, E, KCHUNK, BN, BK)  # (the first tile before the wait)
    wait_for_prior_kernel(PDL)
    W: tl.constexpr = 2 * E + 2 * G * N + H
    CS: tl.constexpr = E + 2 * G * N
    GS: tl.constexpr = E // G
    # Each group's 1 / rms from ssd_conv_step's parts (PPG programs a group, in their order)
    gi = tl.arange(0, GP)
    j = tl.arange(0, PPGP)
    parts = tl.load(part_ptr + row64 * PARTS + gi[:, None] * PPG + j[None, :],
                    mask=(gi < G)[:, None] & (j < PPG)[None, :], other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(parts, 1) / GS + eps)  # (GP,)
    # B's and C's conv windows shift left by one, the new input in: BC channels a program
    # (the row's programs cover all 2GN)
    kk = tl.arange(0, KP)
    ch = E + (pid_n * tl.num_programs(2) + pid_s) * BC + tl.arange(0, BC)
    chm = ch < CS
    win = cs_ptr + (row64 * CS + ch[:, None]) * K + kk[None, :]
    newer = tl.load(win + 1, mask=chm[:, None] & (kk < K - 1)[None, :], other=0.0)
    x_in = tl.load(zx_ptr + row64 * W + E + ch, mask=chm, other=0.0)
    tl.debug_barrier()  # (every thread has read the window before any of it moves)
    tl.store(win, newer, mask=chm[:, None] & (kk < K - 1)[None, :])
    tl.store(cs_ptr + (row64 * CS + ch) * K + K - 1, x_in.to(cs_ptr.dtype.element_ty), mask=chm)
    acc = row_sums(BN, MMA)  # (MMA: on the tensor cores, gemv.mma_terms)
    for k0 in range(pid_s * KCHUNK, k_end, BK):
        k = k0 + tl.arange(0, BK)
        km = k < k_end
        u = tl.load(v_ptr + row64 * E + k, mask=km, other=0.0)
        if NORM:
            if TILE_IN_GROUP:  # the tile's group's 1 / rms, one number (GP selects, not BK x GP)
                scale = tl.sum(tl.where(gi == k0 // GS, rstd, 0.0), 0)
            else:  # each column's group's
                scale = tl.sum(tl.where((k // GS)[:, None] == gi[None, :], rstd[None, :], 0.0), 1)
            u = u * scale * tl.load(gw_ptr + k, mask=km, other=0.0)
        if NORM_BEFORE_GATE:
            u = u * silu(tl.load(zx_ptr + row64 * W + k, mask=km, other=0.0))
        w_now = w
        k = k + BK  # the next tile (nothing past this split's end)
        w = tl.load(w_ptr + n[:, None] * E + k[None, :], mask=nmask[:, None] & (k < k_end)[None, :], other=0.0)
        acc = add_row_tile(acc, u[None, :], w_now, MMA)
    acc = row_total(acc, MMA)
    if W_SCALED:  # FP8 weights: this split's sums times their rows' scales
        acc *= tl.load(ws_ptr + n, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:  # once, with the first split (n >= pid_s * D holds there only)
        acc += tl.load(b_ptr + n, mask=nmask & (n >= pid_s * D), other=0.0)[None, :]
    add_fixed(dh_ptr + row64 * D + n[None, :], acc, nmask[None, :])


class Mamba2DecodeStep(DecodeStep):
    """The one-row step of a Mamba-2 model (see the module's doc): decode_step.DecodeStep's
    buffers, embed, lm_head and argmax, with Mamba-2's layer in three kernels."""

    def __init__(self, model, batch: int, plan=None):
        super().__init__(model, batch, plan)
        c = model.config
        E, G, N, H, P = c.d_inner, c.n_groups, c.d_state, c.n_heads, c.head_dim
        dev = model.weights.embedding.device
        self.BP = min(plan.blocks.ssd_block, triton.next_power_of_2(P))  # a head's channels a program
        self.nPB = triton.cdiv(P, self.BP)
        programs = H * self.nPB  # ssd_conv_step's, a row
        self.BD2 = triton.next_power_of_2(triton.cdiv(c.d_model, programs))  # h columns each folds
        # B's and C's conv channels each gated_out_proj program moves
        self.BC = triton.next_power_of_2(triton.cdiv(2 * G * N, self.nt_d * self.nsplit_out))
        self.zxbcdt = torch.zeros(batch, 2 * E + 2 * G * N + H, device=dev, dtype=torch.float32)
        self.part = torch.zeros(batch, programs, device=dev, dtype=torch.float32)

    def ssd_conv_step(self, lw, conv_state, ssm_state, fold=None) -> None:
        """v and its parts from zxbcdt; updates both states; folds `fold` (default dh) into h."""
        c = self.model.config
        _ssd_conv_step_kernel[(self.B, c.n_heads, self.nPB)](
            self.zxbcdt, conv_state, lw.conv_w, lw.conv_b if lw.conv_b is not None else lw.conv_w, ssm_state,
            lw.dt_bias, lw.A, lw.D, self.y, self.part, self.h, self.dh if fold is None else fold,
            c.d_model, c.n_heads // c.n_groups, float(c.dt_limit[0]), float(c.dt_limit[1]),
            E=c.d_inner, G=c.n_groups, N=c.d_state, H=c.n_heads, P=c.head_dim, K=c.d_conv,
            KP=triton.next_power_of_2(c.d_conv), HAS_CB=lw.conv_b is not None, BP=self.BP,
            NP=triton.next_power_of_2(c.d_state), BD=self.BD2, NORM_BEFORE_GATE=c.norm_before_gate and lw.gate_norm_w is not None,
            num_warps=4, **self.pdl_for("ssm_step"),  # (its place in the layer, and the plan's PDL choice for it)
        )

    def gated_out_proj(self, lw, conv_state, dh=None) -> None:
        """dh (default self.dh) += out_proj(the gated norm of v); B's and C's conv windows shift.
        Without a norm (gate_norm_w None: Falcon-H1's option) v itself, y * silu(z)."""
        c = self.model.config
        norm = lw.gate_norm_w is not None
        parts = self.part.shape[1]
        w, ws = weight_parts(lw.out_proj_w)
        _gated_out_proj_kernel[(self.B, self.nt_d, self.nsplit_out)](
            self.y, self.zxbcdt, self.part, lw.gate_norm_w if norm else w, w, w if ws is None else ws,
            lw.out_proj_b if lw.out_proj_b is not None else w, self.dh if dh is None else dh, conv_state,
            c.d_model, self.kchunk_out, c.norm_eps,
            E=c.d_inner, G=c.n_groups, N=c.d_state, H=c.n_heads, K=c.d_conv, KP=triton.next_power_of_2(c.d_conv),
            PARTS=parts, PPG=parts // c.n_groups, GP=triton.next_power_of_2(c.n_groups),
            PPGP=triton.next_power_of_2(parts // c.n_groups), HAS_BIAS=lw.out_proj_b is not None,
            NORM=norm, NORM_BEFORE_GATE=c.norm_before_gate and norm, BN=self.BN_out, BK=self.BK_out, BC=self.BC,
            # every K tile inside one group (the splits start at whole tiles): its scale is
            # one number; the per-column choice took Codestral's out_proj to 44 µs against
            # 16 µs of weights (8 groups: 8 selects a column against 8 products a column)
            TILE_IN_GROUP=(c.d_inner // c.n_groups) % self.BK_out == 0, W_SCALED=ws is not None,
            MMA=self.out_proj_mma, num_warps=self.warps_out, **self.pdl_for("out_proj_residual"),  # (likewise)
        )

    def __call__(self, tokens: torch.Tensor, state, argmax: bool = False, h: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B,) -> logits (B, V) f32; updates `state`. With argmax, take_argmax must
        follow (see DecodeStep)."""
        assert h is None, "Mamba-2's step takes tokens"
        w = self.model.weights
        self.embed(tokens.contiguous())
        linear = dict(blocks=self.in_proj_blocks, sum_last=self.sum_last, unroll=self.in_proj_unroll, mma=self.in_proj_mma)
        for i, lw in enumerate(w.layers):
            self._rmsnorm_linear(lw.norm_w, lw.in_proj_w, lw.in_proj_b, self.zxbcdt, **linear)
            self.ssd_conv_step(lw, state.conv[i], state.ssm[i])
            self.gated_out_proj(lw, state.conv[i])
        self.lm_head(argmax)
        return self.logits[: self.B]
