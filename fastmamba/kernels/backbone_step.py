"""fastmamba.Backbone's whole step in one Triton launch, for narrow models (d_model in the
hundreds, a few layers: the sizes of reinforcement learning and control), with its `_ref` twin.

One program carries RB rows (environments) through input_proj, every layer and norm_f:

    h      = input_proj(x)                       (or x itself)
    per layer:
      u    = rmsnorm(h) * norm_w                 in the storage dtype (in_proj's operand)
      pass 1, over blocks of BE channels:
        x, z = u @ in_proj.T                     (RB, BE) each
        conv step + SiLU on x -> xc              the window (RB, BE, K) shifts in place
        dbc += xc @ x_proj[:, block].T           dt_r (RB, R), B and C (RB, N): x_proj's sum
                                                 runs over every channel, so the scan waits
      pass 2, over the same blocks:
        dt   = softplus(dt_r @ dt_proj[block].T + dt_bias)
        s    = s * exp(dt A) + dt xc B           the state (RB, BE, N) read and written once
        y    = (s C + D xc) * silu(z)
        o   += y @ out_proj[:, block].T
      h   += o
    out    = rmsnorm(h) * norm_f                 (B, d_model) float32

Why one launch: at these widths a step is a few hundred thousand multiply-adds a row, so
the language model's decode kernels (a few launches a layer, each a few microseconds of
launch, drain and ramp) spend the step waiting on their own boundaries. Here nothing
crosses between programs: a row's layers run back to back in one program's registers,
with xc and z parked in a small scratch (L1/L2) between the two passes. Each program reads
every weight once (from L2 after the first), so the rows a program carries set the weight
traffic: 16 rows a program at large batches (tensor-core products, tl.dot), one row a
program below (float32 multiply-and-sum, no tile of empty rows). At large batches the step
is the state streamed once; at batch 1 one program's reach of L2 (benchmarks/RESULTS.md).

The layers' parameters are read through a table of their addresses (`StepParams`), so the
kernel reads the module's own tensors (no stacked copies to keep in sync with an
optimizer), and A = -exp(A_log) is taken here, from the parameter itself.
Numerics as the rest of the engine (docs/architecture.md): float32 residual, state update
and accumulation; a 16-bit product's operand rounded once to the storage dtype; float32
weights through three TF32 products (tf32x3) or float32 multiply-and-sum. The state in any
float dtype, updated in float32 and rounded once on store.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import INTERPRET, jit, tl, triton
from .activations import silu, softplus
from .decode_step import conv_x_proj_ref, ssm_step_ref
from .rmsnorm import residual_rmsnorm_ref

# -- reference twin ----------------------------------------------------------------------------


def backbone_step_ref(x, conv, ssm, layers, norm_f, eps, input_proj_w=None, input_proj_b=None):
    """x (B, I) -> (B, d) float32: input_proj, the layers (model.LayerWeights each) and
    norm_f for one step; conv (L, B, E, K) and ssm (L, B, E, N) updated in place."""
    h = F.linear(x.float(), input_proj_w.float(), input_proj_b) if input_proj_w is not None else x.float()
    o = None
    for i, lw in enumerate(layers):
        E = lw.D.shape[0]
        h, u = residual_rmsnorm_ref(h, o, None, lw.norm_w, eps)
        xz = F.linear(u, lw.in_proj_w.float(), lw.in_proj_b)  # (B, 2E)
        xc, dbc = conv_x_proj_ref(xz[:, :E], conv[i], lw.conv_w, lw.conv_b, lw.x_proj_w)
        y = ssm_step_ref(dbc, xc, xz[:, E:], ssm[i], lw.dt_proj_w, lw.dt_bias, lw.A, lw.D)
        o = F.linear(y, lw.out_proj_w.float(), lw.out_proj_b)
    return residual_rmsnorm_ref(h, o, None, norm_f, eps)[1]


# -- the kernel --------------------------------------------------------------------------------

# The table's columns: one row of addresses a layer (StepParams).
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
def _times_wt(a, w, DOT: tl.constexpr, W32: tl.constexpr):
    """a (M, K) times w (NOUT, K).T -> (M, NOUT) float32. a comes in w's dtype (16-bit
    operands rounded once by the caller). DOT: the tensor cores (M >= 16), float32 weights
    in three TF32 products; else float32 multiply-and-sum (one row)."""
    if DOT:
        if W32:
            return tl.dot(a, tl.trans(w), input_precision="tf32x3")
        elif INTERPRET:  # (the interpreter's tl.dot of 16-bit operands: see _triton)
            return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            return tl.dot(a, tl.trans(w))
    else:
        return tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@jit
def _rmsnorm(h, w_ptr, d, D: tl.constexpr, eps):
    """h (RB, DP) float32, zero past D -> rmsnorm(h) * w (float32)."""
    w = tl.load(w_ptr + d, mask=d < D, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 1) / D + eps)
    return h * rstd[:, None] * w[None, :]


@jit
def _backbone_step_kernel(
    x_ptr, y_ptr, conv_ptr, ssm_ptr, table_ptr, ipw_ptr, ipb_ptr, normf_ptr, us_ptr, xs_ptr, zs_ptr,
    B, L, eps,
    I: tl.constexpr, IP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, E: tl.constexpr, N: tl.constexpr,
    NP: tl.constexpr, K: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
    RB: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, WTYPE: tl.constexpr,
    INPUT_PROJ: tl.constexpr, PROJ_BIAS: tl.constexpr, CONV_BIAS: tl.constexpr,
):
    DOT: tl.constexpr = RB >= 16
    W32: tl.constexpr = WTYPE == tl.float32
    f32: tl.constexpr = tl.float32
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    d = tl.arange(0, DP)
    dmask = d < D
    r = tl.arange(0, RP)
    n = tl.arange(0, NP)
    nmask = n < N
    be = tl.arange(0, BE)

    if INPUT_PROJ:
        i = tl.arange(0, IP)
        xin = tl.load(x_ptr + rows64[:, None] * I + i[None, :], mask=rmask[:, None] & (i < I)[None, :], other=0.0)
        w = tl.load(ipw_ptr + d[:, None] * I + i[None, :], mask=dmask[:, None] & (i < I)[None, :], other=0.0)
        h = _times_wt(xin.to(f32).to(WTYPE), w, DOT, W32)
        h += tl.load(ipb_ptr + d, mask=dmask, other=0.0)[None, :]
    else:
        h = tl.load(x_ptr + rows64[:, None] * D + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0).to(f32)

    for layer in range(L):
        in_w = _param(table_ptr, layer, _IN_W, WTYPE)
        in_b = _param(table_ptr, layer, _IN_B, f32)
        conv_w = _param(table_ptr, layer, _CONV_W, f32)
        conv_b = _param(table_ptr, layer, _CONV_B, f32)
        xp_w = _param(table_ptr, layer, _XP_W, WTYPE)
        # u goes through the scratch: in_proj reads it a K tile at a time (a whole row as a
        # tensor-core operand would be copied into every warp's registers)
        u = _rmsnorm(h, _param(table_ptr, layer, _NORM, f32), d, D, eps)  # (RB, DP)
        tl.store(us_ptr + rows64[:, None] * D + d[None, :], u.to(us_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
        tl.debug_barrier()
        # this layer's state rows: conv (L, B, E, K), ssm (L, B, E, N)
        state_row = (layer * B + rows64) * E  # (RB,)
        dt_r = tl.zeros([RB, RP], dtype=f32)
        Bv = tl.zeros([RB, NP], dtype=f32)
        Cv = tl.zeros([RB, NP], dtype=f32)
        # pass 1: in_proj, the conv step, x_proj's sum
        for c0 in range(0, E, BE):
            e = c0 + be
            emask = e < E
            m = rmask[:, None] & emask[None, :]
            xv = tl.zeros([RB, BE], dtype=f32)
            zv = tl.zeros([RB, BE], dtype=f32)
            for k0 in range(0, D, BK):
                k = k0 + tl.arange(0, BK)
                kmask = k < D
                uk = tl.load(us_ptr + rows64[:, None] * D + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                wm = emask[:, None] & kmask[None, :]
                wx = tl.load(in_w + e[:, None] * D + k[None, :], mask=wm, other=0.0)  # (BE, BK)
                wz = tl.load(in_w + (E + e)[:, None] * D + k[None, :], mask=wm, other=0.0)
                xv += _times_wt(uk, wx, DOT, W32)  # (RB, BE)
                zv += _times_wt(uk, wz, DOT, W32)
            if PROJ_BIAS:
                xv += tl.load(in_b + e, mask=emask, other=0.0)[None, :]
                zv += tl.load(in_b + E + e, mask=emask, other=0.0)[None, :]
            # The conv window (K inputs, newest last) shifts left by one with x in: each
            # thread reads a tap, writes it one place down, then the next (same thread, same
            # element: no barrier needed).
            win = conv_ptr + (state_row[:, None] + e[None, :]) * K  # (RB, BE)
            conv = xv * tl.load(conv_w + e * K + K - 1, mask=emask, other=0.0)[None, :]
            if CONV_BIAS:
                conv += tl.load(conv_b + e, mask=emask, other=0.0)[None, :]
            for k in tl.static_range(K - 1):
                tap = tl.load(win + k + 1, mask=m, other=0.0)
                conv += tap.to(f32) * tl.load(conv_w + e * K + k, mask=emask, other=0.0)[None, :]
                tl.store(win + k, tap, mask=m)
            tl.store(win + K - 1, xv.to(conv_ptr.dtype.element_ty), mask=m)
            xc = tl.where(m, silu(conv), 0.0)
            scratch = rows64[:, None] * E + e[None, :]
            tl.store(xs_ptr + scratch, xc, mask=m)
            tl.store(zs_ptr + scratch, zv, mask=m)
            xc16 = xc.to(WTYPE)  # x_proj's operand
            w_r = tl.load(xp_w + r[:, None] * E + e[None, :], mask=(r < R)[:, None] & emask[None, :], other=0.0)
            w_b = tl.load(xp_w + (R + n)[:, None] * E + e[None, :], mask=nmask[:, None] & emask[None, :], other=0.0)
            w_c = tl.load(xp_w + (R + N + n)[:, None] * E + e[None, :], mask=nmask[:, None] & emask[None, :], other=0.0)
            dt_r += _times_wt(xc16, w_r, DOT, W32)
            Bv += _times_wt(xc16, w_b, DOT, W32)
            Cv += _times_wt(xc16, w_c, DOT, W32)
        tl.debug_barrier()  # the scratch written above by other threads of this program
        # pass 2: step sizes, the state update, the gate, out_proj
        dt_w = _param(table_ptr, layer, _DT_W, WTYPE)
        dt_b = _param(table_ptr, layer, _DT_B, f32)
        A_log = _param(table_ptr, layer, _A_LOG, f32)
        Dskip = _param(table_ptr, layer, _D, f32)
        out_w = _param(table_ptr, layer, _OUT_W, WTYPE)
        dt_r16 = dt_r.to(WTYPE)  # dt_proj's operand
        o = tl.zeros([RB, DP], dtype=f32)
        for c0 in range(0, E, BE):
            e = c0 + be
            emask = e < E
            m = rmask[:, None] & emask[None, :]
            w_dt = tl.load(dt_w + e[:, None] * R + r[None, :], mask=emask[:, None] & (r < R)[None, :], other=0.0)
            dt = softplus(_times_wt(dt_r16, w_dt, DOT, W32) + tl.load(dt_b + e, mask=emask, other=0.0)[None, :])
            A = -tl.exp(tl.load(A_log + e[:, None] * N + n[None, :], mask=emask[:, None] & nmask[None, :], other=0.0))
            scratch = rows64[:, None] * E + e[None, :]
            xc = tl.load(xs_ptr + scratch, mask=m, other=0.0)
            zv = tl.load(zs_ptr + scratch, mask=m, other=0.0)
            sp = ssm_ptr + (state_row[:, None, None] + e[None, :, None]) * N + n[None, None, :]  # (RB, BE, NP)
            sm = m[:, :, None] & nmask[None, None, :]
            s = tl.load(sp, mask=sm, other=0.0).to(f32)
            s = s * tl.exp(dt[:, :, None] * A[None, :, :]) + (dt * xc)[:, :, None] * Bv[:, None, :]
            tl.store(sp, s.to(ssm_ptr.dtype.element_ty), mask=sm)  # rounded once where the state is 16-bit
            y = tl.sum(s * Cv[:, None, :], 2) + tl.load(Dskip + e, mask=emask, other=0.0)[None, :] * xc
            y = tl.where(m, y * silu(zv), 0.0)
            w_o = tl.load(out_w + d[:, None] * E + e[None, :], mask=dmask[:, None] & emask[None, :], other=0.0)  # (DP, BE)
            o += _times_wt(y.to(WTYPE), w_o, DOT, W32)
        if PROJ_BIAS:
            o += tl.load(_param(table_ptr, layer, _OUT_B, f32) + d, mask=dmask, other=0.0)[None, :]
        h += o
        tl.debug_barrier()  # the next layer's pass 1 rewrites the scratch this pass read
    out = _rmsnorm(h, normf_ptr, d, D, eps)
    tl.store(y_ptr + rows64[:, None] * D + d[None, :], out, mask=rmask[:, None] & dmask[None, :])


# -- launcher ----------------------------------------------------------------------------------


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


_TL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _layer_tensors(layer) -> dict:
    m = layer.mixer
    return dict(
        norm_w=layer.norm.weight, in_proj_w=m.in_proj.weight, in_proj_b=m.in_proj.bias, conv_w=m.conv1d.weight,
        conv_b=m.conv1d.bias, x_proj_w=m.x_proj.weight, dt_proj_w=m.dt_proj.weight, dt_bias=m.dt_proj.bias,
        A_log=m.A_log, D=m.D, out_proj_w=m.out_proj.weight, out_proj_b=m.out_proj.bias,
    )


def unfusable(bb) -> str | None:
    """Why the fused step cannot read this Backbone's parameters, or None: it needs the large
    matrices (and input_proj's) in one of float32, bfloat16, float16, everything else in
    float32, all contiguous (a module cast whole with .half() runs the decode kernels)."""
    storage = bb.layers[0].mixer.in_proj.weight.dtype
    if storage not in _TL_DTYPES:
        return f"weights in {storage}"
    named = [(f"layers.{i}.{k}", k, t) for i, layer in enumerate(bb.layers) for k, t in _layer_tensors(layer).items()]
    named.append(("norm_f.weight", "norm_f", bb.norm_f.weight))
    if bb.input_proj is not None:
        named += [("input_proj.weight", "input_proj_w", bb.input_proj.weight), ("input_proj.bias", "", bb.input_proj.bias)]
    for name, kind, t in named:
        want = storage if kind.endswith("_proj_w") else torch.float32
        if t is not None and (t.dtype != want or not t.is_contiguous()):
            return f"{name} is {t.dtype}{'' if t.is_contiguous() else ', not contiguous'}; the fused step reads it as {want}"
    return None


class StepParams:
    """The Backbone's parameters as the kernel reads them: a (L, len(SLOTS)) table of the
    layers' tensors' addresses on the device, and the dtype of the large matrices. The
    table holds addresses, not copies: an optimizer's in-place updates are seen at once;
    moving the module (`.to()`) makes a new one (Backbone drops its steps then)."""

    def __init__(self, bb):
        if (why := unfusable(bb)) is not None:
            raise ValueError(why)
        rows, self.tensors = [], []  # the tensors are held so that their addresses stay theirs
        for layer in bb.layers:
            tensors = _layer_tensors(layer)
            self.tensors += [t for t in tensors.values() if t is not None]
            # an absent bias: address 0, never read (a flag of the kernel's says so)
            rows.append([tensors[name].data_ptr() if tensors[name] is not None else 0 for name in SLOTS])
        self.table = torch.tensor(rows, dtype=torch.int64, device=bb.device)
        self.storage = bb.layers[0].mixer.in_proj.weight.dtype
        self.input_proj = bb.input_proj
        self.norm_f = bb.norm_f.weight
        self.config = bb.config


class FusedBackboneStep:
    """The fused step for one batch size: `__call__(x, state)` -> (B, d_model) float32, the
    state updated in place. Its scratch and output are the step's own (a CUDA graph
    captures them)."""

    def __init__(self, bb, batch: int, blocks):
        c = bb.config
        self.params, self.batch, self.blocks = StepParams(bb), batch, blocks
        dev = bb.device
        self.y = torch.empty(batch, c.d_model, device=dev)
        self.us = torch.empty(batch, c.d_model, device=dev, dtype=self.params.storage)  # in_proj's operand
        self.xs = torch.empty(batch, c.d_inner, device=dev)  # xc and z between the two passes
        self.zs = torch.empty(batch, c.d_inner, device=dev)

    def __call__(self, x: torch.Tensor, state) -> torch.Tensor:
        p, c, blk = self.params, self.params.config, self.blocks
        ip = p.input_proj
        _backbone_step_kernel[(triton.cdiv(self.batch, blk.rows),)](
            x, self.y, state.conv, state.ssm, p.table, ip.weight if ip is not None else x,
            ip.bias if ip is not None else x, p.norm_f, self.us, self.xs, self.zs,
            self.batch, c.n_layer, c.norm_eps,
            I=c.input_dim, IP=_pow2(c.input_dim, 16), D=c.d_model, DP=_pow2(c.d_model, 16), E=c.d_inner,
            N=c.d_state, NP=_pow2(c.d_state, 16), K=c.d_conv, R=c.dt_rank, RP=_pow2(c.dt_rank, 16),
            RB=blk.rows, BE=blk.channels, BK=blk.k_block, WTYPE=getattr(tl, _TL_DTYPES[p.storage]),
            INPUT_PROJ=ip is not None, PROJ_BIAS=c.proj_bias, CONV_BIAS=c.conv_bias, num_warps=blk.warps,
        )
        return self.y
