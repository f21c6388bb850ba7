"""fastmamba.Backbone's whole step in one launch at small widths, its programs in lockstep
through grid barriers, with its `_ref` twin.

The programs form groups, one a block of RB rows (environments); a group's P programs
each own E / P of every layer's channels (a slice). Per layer:

    every program   u = rmsnorm(h) * norm_w                   (RB, d): h is in every program
    its slice       x, z = u @ in_proj[slice].T               (RB, C) each, C = E / P
                    conv step + SiLU on x -> xc               its channels' windows shift in place
                    its share of x_proj: xc @ x_proj[:, slice].T -> dt_r, B, C (RB, R + 2N)
    -- barrier --   every program sums the P shares (in a fixed order)
    its slice       dt = softplus(dt_r @ dt_proj[slice].T + dt_bias)
                    s = s exp(dt A) + dt xc B ; y = (s C + D xc) silu(z)
                    its share of out_proj: y @ out_proj[:, slice].T (RB, d)
    -- barrier --   every program sums the P shares: h += o

and around the layers input_proj before (every program, all of it) and norm_f after (the
group's first program writes the output).

Why: at these widths (d_model in the low hundreds, a few layers) a step is a few hundred
thousand multiply-adds a row, and the decode kernels' step (KernelStep: a few launches a
layer) waits mostly on its own kernel boundaries: at batch 1 about 13 dependent launches at
~1.4 us each. Two earlier one-launch steps carried each row through every layer in one
program and lost (benchmarks/RESULTS.md: 2-6x slower), one program's serial reach of the
weights being the limit. Here a layer's weights are spread over the P programs as the
decode kernels spread them, and a kernel boundary becomes a barrier: one atomic add and a
poll of one counter in L2.

The barrier needs every program of a group resident at once: the launcher keeps the grid
within the GPU's multiprocessor count (one program each at most). The counter of each
group counts on across launches (never reset: a launch finds its base by rounding what it
reads down to a multiple of the 2 L P arrivals a launch makes; a program of the launch can
have added at most one arrival before the slowest one reads it), in int64.
The Triton interpreter runs programs one after another, so there P is 1 (nothing to wait
for); on a GPU the tests run P > 1.

The shares meet in a scratch of their own per layer and barrier (never rewritten within a
launch: no program can overwrite a share another still reads) and are summed in program
order: a row's outputs do not depend on the other rows or on when programs arrive.
Numerics as the decode kernels: float32 residual, state update and accumulation; float32
multiply-and-sum products below 16 rows a group, tensor-core products above (16-bit
operands rounded once; float32 weights in three TF32 products). The state in any float
dtype, updated in float32 and rounded once on store.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import INTERPRET, jit, tl, triton
from .activations import silu, softplus
from .decode_step import _pow2, conv_x_proj_ref, ssm_step_ref
from .rmsnorm import residual_rmsnorm_ref

# -- reference twin ----------------------------------------------------------------------------


def lockstep_step_ref(x, conv, ssm, layers, norm_f, eps, input_proj_w=None, input_proj_b=None):
    """x (B, I) -> (B, d) float32: input_proj, the layers (mamba1.LayerWeights each) and
    norm_f for one step; conv (L, B, E, K) and ssm (L, B, E, N) updated in place (rounded
    once to their dtype)."""
    h = F.linear(x.float(), input_proj_w.float(), input_proj_b) if input_proj_w is not None else x.float()
    o = None
    for i, lw in enumerate(layers):
        E = lw.D.shape[0]
        h, u = residual_rmsnorm_ref(h, o, None, lw.norm_w, eps)
        xz = F.linear(u, lw.in_proj_w.float(), lw.in_proj_b)  # (B, 2E)
        conv_i, ssm_i = conv[i].float(), ssm[i].float()
        xc, dbc = conv_x_proj_ref(xz[:, :E], conv_i, lw.conv_w, lw.conv_b, lw.x_proj_w)
        y = ssm_step_ref(dbc, xc, xz[:, E:], ssm_i, lw.dt_proj_w, lw.dt_bias, lw.A, lw.D)
        conv[i].copy_(conv_i)
        ssm[i].copy_(ssm_i)
        o = F.linear(y, lw.out_proj_w.float(), lw.out_proj_b)
    return residual_rmsnorm_ref(h, o, None, norm_f, eps)[1]


# -- the kernel --------------------------------------------------------------------------------

# The table's columns: one row of addresses a layer (LockstepParams).
SLOTS = ("norm_w", "in_proj_w", "in_proj_b", "conv_w", "conv_b", "x_proj_w", "dt_proj_w", "dt_bias", "A_log", "D",
         "out_proj_w", "out_proj_b")
NSLOTS = tl.constexpr(len(SLOTS))
(_NORM, _IN_W, _IN_B, _CONV_W, _CONV_B, _XP_W, _DT_W, _DT_B, _A_LOG, _D, _OUT_W, _OUT_B) = (
    tl.constexpr(i) for i in range(len(SLOTS)))


@jit
def _param(table_ptr, layer, slot: tl.constexpr, dtype: tl.constexpr):
    """The address of one layer's parameter, from the table, as a pointer to `dtype`."""
    return tl.load(table_ptr + layer * NSLOTS + slot).to(tl.pointer_type(dtype))


@jit
def _times_wt(a, w, DOT: tl.constexpr, W32: tl.constexpr, WTYPE: tl.constexpr):
    """a (M, K) float32 times w (NOUT, K).T -> (M, NOUT) float32. DOT: the tensor cores
    (M >= 16; a rounded once to w's dtype, float32 weights in three TF32 products); else
    float32 multiply-and-sum."""
    if DOT:
        if W32:
            return tl.dot(a, tl.trans(w), input_precision="tf32x3")
        elif INTERPRET:  # (the interpreter's tl.dot of 16-bit operands: see _triton)
            return tl.dot(a.to(WTYPE).to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            return tl.dot(a.to(WTYPE), tl.trans(w))
    else:
        return tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@jit
def _rmsnorm(h, w_ptr, d, D: tl.constexpr, eps):
    """h (RB, DP) float32, zero past D -> rmsnorm(h) * w (float32)."""
    w = tl.load(w_ptr + d, mask=d < D, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 1) / D + eps)
    return h * rstd[:, None] * w[None, :]


@jit
def _arrive_and_wait(count_ptr, target, P: tl.constexpr):
    """The group's barrier: this program's stores made visible, then a wait until the
    group's counter reaches `target` (P arrivals a barrier)."""
    if P > 1:
        tl.debug_barrier()  # every thread's stores before the one release below
        seen = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") + 1
        while seen < target:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()


@jit
def _sum_shares(share_ptr, rows_local, cols, STRIDE: tl.constexpr, W: tl.constexpr, P: tl.constexpr):
    """The P programs' shares (P, RB, W) summed in program order -> (RB, len(cols)) float32.
    Read from L2 (.cg): other programs wrote them, whole (every row of the group, every padded
    column), so nothing is masked."""
    acc = tl.load(share_ptr + rows_local[:, None] * W + cols[None, :], cache_modifier=".cg")
    for p in tl.static_range(1, P):
        acc += tl.load(share_ptr + p * STRIDE + rows_local[:, None] * W + cols[None, :], cache_modifier=".cg")
    return acc


@jit
def _lockstep_step_kernel(
    x_ptr, y_ptr, conv_ptr, ssm_ptr, table_ptr, ipw_ptr, ipb_ptr, normf_ptr, hs_ptr, share_ptr, count_ptr,
    B, L, eps,
    I: tl.constexpr, IP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, E: tl.constexpr, N: tl.constexpr,
    NP: tl.constexpr, K: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
    RB: tl.constexpr, P: tl.constexpr, BD: tl.constexpr, WTYPE: tl.constexpr,
    INPUT_PROJ: tl.constexpr, PROJ_BIAS: tl.constexpr, CONV_BIAS: tl.constexpr,
):
    DOT: tl.constexpr = RB >= 16
    W32: tl.constexpr = WTYPE == tl.float32
    f32: tl.constexpr = tl.float32
    C: tl.constexpr = E // P  # this program's channels a layer
    DBC: tl.constexpr = RP + 2 * NP  # a dbc share's width: dt_r, B, C, each padded
    p = tl.program_id(0)
    group = tl.program_id(1)
    local = tl.arange(0, RB)
    rows = group * RB + local
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    d = tl.arange(0, DP)
    dmask = d < D
    r = tl.arange(0, RP)
    n = tl.arange(0, NP)
    nmask = n < N
    e = p * C + tl.arange(0, C)  # this program's channels
    counter = count_ptr + group
    # this launch's base: the group's counter rounded down to a whole launch's arrivals
    # (before this program's first arrival; nothing waits on it yet, so a relaxed read)
    arrivals = 2 * L * P
    base = tl.full([], 0, tl.int64)
    if P > 1:
        base = tl.atomic_add(counter, 0, sem="relaxed", scope="gpu")
        base = base - base % arrivals
    # the group's shares: per layer, a dbc share (P, RB, DBC) then an out_proj share (P, RB, DP)
    LAYER_SHARES: tl.constexpr = P * RB * (DBC + DP)
    shares = share_ptr + group.to(tl.int64) * L * LAYER_SHARES

    # h: input_proj of x (or x), through this program's own scratch (BD columns at a time)
    hs = hs_ptr + (group * P + p).to(tl.int64) * RB * DP
    if INPUT_PROJ:
        i = tl.arange(0, IP)
        xin = tl.load(x_ptr + rows64[:, None] * I + i[None, :], mask=rmask[:, None] & (i < I)[None, :], other=0.0)
        xin = xin.to(f32).to(WTYPE).to(f32)  # rounded once to the weights' dtype
        for d0 in tl.static_range(0, DP, BD):
            dd = d0 + tl.arange(0, BD)
            w = tl.load(ipw_ptr + dd[:, None] * I + i[None, :], mask=(dd < D)[:, None] & (i < I)[None, :], other=0.0)
            hd = _times_wt(xin, w, DOT, W32, WTYPE) + tl.load(ipb_ptr + dd, mask=dd < D, other=0.0)[None, :]
            tl.store(hs + local[:, None] * DP + dd[None, :], hd)
        tl.debug_barrier()
        h = tl.load(hs + local[:, None] * DP + d[None, :])
        h = tl.where(dmask[None, :], h, 0.0)
    else:
        h = tl.load(x_ptr + rows64[:, None] * D + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0).to(f32)

    for layer in range(L):
        in_w = _param(table_ptr, layer, _IN_W, WTYPE)
        conv_w = _param(table_ptr, layer, _CONV_W, f32)
        xp_w = _param(table_ptr, layer, _XP_W, WTYPE)
        dt_w = _param(table_ptr, layer, _DT_W, WTYPE)
        out_w = _param(table_ptr, layer, _OUT_W, WTYPE)
        wd = dmask[None, :]
        # every weight of this program's slice, loaded before the first product waits on one
        w_x = tl.load(in_w + e[:, None] * D + d[None, :], mask=wd, other=0.0)  # (C, DP)
        w_z = tl.load(in_w + (E + e)[:, None] * D + d[None, :], mask=wd, other=0.0)
        w_r = tl.load(xp_w + r[:, None] * E + e[None, :], mask=(r < R)[:, None], other=0.0)  # (RP, C)
        w_b = tl.load(xp_w + (R + n)[:, None] * E + e[None, :], mask=nmask[:, None], other=0.0)  # (NP, C)
        w_c = tl.load(xp_w + (R + N + n)[:, None] * E + e[None, :], mask=nmask[:, None], other=0.0)
        w_dt = tl.load(dt_w + e[:, None] * R + r[None, :], mask=(r < R)[None, :], other=0.0)  # (C, RP)
        w_o = tl.load(out_w + d[:, None] * E + e[None, :], mask=dmask[:, None], other=0.0)  # (DP, C)
        A = -tl.exp(tl.load(_param(table_ptr, layer, _A_LOG, f32) + e[:, None] * N + n[None, :],
                            mask=nmask[None, :], other=0.0))  # (C, NP)
        Dskip = tl.load(_param(table_ptr, layer, _D, f32) + e)
        dt_b = tl.load(_param(table_ptr, layer, _DT_B, f32) + e)
        state_row = (layer * B + rows64) * E  # (RB,): this layer's state rows, conv (L, B, E, K), ssm (L, B, E, N)
        m = rmask[:, None]
        sp = ssm_ptr + (state_row[:, None, None] + e[None, :, None]) * N + n[None, None, :]  # (RB, C, NP)
        sm = m[:, :, None] & nmask[None, None, :]
        s = tl.load(sp, mask=sm, other=0.0).to(f32)  # (not needed until after the barrier)

        u = _rmsnorm(h, _param(table_ptr, layer, _NORM, f32), d, D, eps)  # (RB, DP)
        xv = _times_wt(u, w_x, DOT, W32, WTYPE)  # (RB, C)
        zv = _times_wt(u, w_z, DOT, W32, WTYPE)
        if PROJ_BIAS:
            in_b = _param(table_ptr, layer, _IN_B, f32)
            xv += tl.load(in_b + e)[None, :]
            zv += tl.load(in_b + E + e)[None, :]
        # the conv window (K inputs, newest last) shifts left by one with x in: each thread
        # reads a tap and writes it one place down (the same element: no barrier needed)
        win = conv_ptr + (state_row[:, None] + e[None, :]) * K  # (RB, C)
        conv = xv * tl.load(conv_w + e * K + K - 1)[None, :]
        if CONV_BIAS:
            conv += tl.load(_param(table_ptr, layer, _CONV_B, f32) + e)[None, :]
        for k in tl.static_range(K - 1):
            tap = tl.load(win + k + 1, mask=m, other=0.0)
            conv += tap.to(f32) * tl.load(conv_w + e * K + k)[None, :]
            tl.store(win + k, tap, mask=m)
        tl.store(win + K - 1, xv.to(conv_ptr.dtype.element_ty), mask=m)
        xc = tl.where(m, silu(conv), 0.0)
        # this program's share of x_proj, to the layer's dbc shares
        dbc_shares = shares + layer * LAYER_SHARES
        mine = dbc_shares + p * RB * DBC + local[:, None] * DBC
        tl.store(mine + r[None, :], _times_wt(xc, w_r, DOT, W32, WTYPE))
        tl.store(mine + RP + n[None, :], _times_wt(xc, w_b, DOT, W32, WTYPE))
        tl.store(mine + RP + NP + n[None, :], _times_wt(xc, w_c, DOT, W32, WTYPE))
        _arrive_and_wait(counter, base + (2 * layer + 1) * P, P)

        dt_r = _sum_shares(dbc_shares, local, r, RB * DBC, DBC, P)  # (RB, RP)
        Bv = _sum_shares(dbc_shares + RP, local, n, RB * DBC, DBC, P)  # (RB, NP)
        Cv = _sum_shares(dbc_shares + RP + NP, local, n, RB * DBC, DBC, P)
        dt = softplus(_times_wt(dt_r, w_dt, DOT, W32, WTYPE) + dt_b[None, :])  # (RB, C)
        s = s * tl.exp(dt[:, :, None] * A[None, :, :]) + (dt * xc)[:, :, None] * Bv[:, None, :]
        tl.store(sp, s.to(ssm_ptr.dtype.element_ty), mask=sm)  # rounded once where the state is 16-bit
        y = tl.sum(s * Cv[:, None, :], 2) + Dskip[None, :] * xc
        y = tl.where(m, y * silu(zv), 0.0)
        out_shares = dbc_shares + P * RB * DBC
        tl.store(out_shares + p * RB * DP + local[:, None] * DP + d[None, :], _times_wt(y, w_o, DOT, W32, WTYPE))
        _arrive_and_wait(counter, base + (2 * layer + 2) * P, P)

        h += _sum_shares(out_shares, local, d, RB * DP, DP, P)
        if PROJ_BIAS:
            h += tl.load(_param(table_ptr, layer, _OUT_B, f32) + d, mask=dmask, other=0.0)[None, :]
    if p == 0:
        out = _rmsnorm(h, normf_ptr, d, D, eps)
        tl.store(y_ptr + rows64[:, None] * D + d[None, :], out, mask=rmask[:, None] & dmask[None, :])


# -- launcher ----------------------------------------------------------------------------------


_TL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def unfit(config, storage: torch.dtype, rows: int, programs: int) -> str | None:
    """Why the lockstep step cannot run a Backbone of this config (BackboneConfig's fields)
    with `rows` rows and `programs` programs a group, or None. It holds a row's h and a
    slice's weights in registers, so the widths are bounded; each program's slice of the
    channels is a power of two, at least 16 wide for the tensor cores' products."""
    c = config
    if c.layer != "mamba1":
        return f"layer {c.layer!r} (the lockstep step runs Mamba-1 layers)"
    if storage not in _TL_DTYPES:
        return f"weights in {storage}"
    limits = dict(d_model=256, input_dim=256, d_state=32, dt_rank=32, d_conv=8)
    for name, most in limits.items():
        if getattr(c, name) > most:
            return f"{name} {getattr(c, name)} > {most}"
    C = c.d_inner // programs
    if c.d_inner % programs or C & (C - 1) or C < (16 if rows >= 16 else 1):
        least = " of 16 or more" if rows >= 16 else ""
        return f"d_inner {c.d_inner} over {programs} programs is not a power-of-two slice{least}"
    return None


class LockstepStep:
    """The lockstep step for one batch size: `__call__(x, state)` -> (B, d_model) float32,
    the state updated in place. config: the Backbone's (BackboneConfig's fields); table:
    (n_layer, len(SLOTS)) int64 on the device, the addresses of each layer's parameters
    (float32 but for the large matrices, in `storage`; an absent bias 0); input_proj: its
    (weight, bias) or None; norm_f: norm_f's weight. The caller keeps those tensors alive
    and where they are. The scratch, counters and output are the step's own (a CUDA graph
    captures them).
    rows: rows a group (1 to 8: multiply-and-sum products; 16: the tensor cores);
    programs: programs a group; warps: each program's."""

    def __init__(self, config, table: torch.Tensor, storage: torch.dtype, input_proj, norm_f: torch.Tensor,
                 batch: int, rows: int, programs: int, warps: int = 4):
        c = config
        if (why := unfit(c, storage, rows, programs)) is not None:
            raise ValueError(f"the lockstep step does not take this Backbone: {why}")
        if INTERPRET:  # (the interpreter runs programs in turn: a barrier would wait forever)
            programs = 1
        self.config, self.batch, self.rows, self.programs, self.warps = c, batch, rows, programs, warps
        self.groups = triton.cdiv(batch, rows)
        dev = norm_f.device
        if dev.type == "cuda":
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            if self.groups * programs > sms:
                raise ValueError(f"the lockstep step at batch {batch} needs {self.groups * programs} programs at once; "
                                 f"this GPU runs {sms}")
        self.table, self.storage, self.input_proj, self.norm_f = table, storage, input_proj, norm_f
        DP, NP, RP = _pow2(c.d_model), _pow2(c.d_state), _pow2(c.dt_rank)
        self.sizes = dict(I=c.input_dim, IP=_pow2(c.input_dim), D=c.d_model, DP=DP, E=c.d_inner, N=c.d_state,
                          NP=NP, K=c.d_conv, R=c.dt_rank, RP=RP)
        self.y = torch.empty(batch, c.d_model, device=dev)
        self.hs = torch.empty(self.groups * self.programs * rows * DP, device=dev)  # each program's h scratch
        self.shares = torch.empty(self.groups * c.n_layer * self.programs * rows * (RP + 2 * NP + DP), device=dev)
        self.counts = torch.zeros(self.groups, device=dev, dtype=torch.int64)  # each group's barrier counter

    def __call__(self, x: torch.Tensor, state) -> torch.Tensor:
        c = self.config
        ipw, ipb = self.input_proj if self.input_proj is not None else (x, x)
        _lockstep_step_kernel[(self.programs, self.groups)](
            x, self.y, state.conv, state.ssm, self.table, ipw, ipb, self.norm_f, self.hs, self.shares, self.counts,
            self.batch, c.n_layer, c.norm_eps, **self.sizes,
            RB=self.rows, P=self.programs, BD=min(32, self.sizes["DP"]), WTYPE=getattr(tl, _TL_DTYPES[self.storage]),
            INPUT_PROJ=self.input_proj is not None, PROJ_BIAS=c.proj_bias, CONV_BIAS=c.conv_bias,
            num_warps=self.warps,
        )
        return self.y
