"""The selective scan for training: an autograd Function whose forward and backward run in
Triton, for fastmamba.Backbone's sequence pass on CUDA (selective_scan_ref under autograd is
the CPU path and the oracle).

The forward is the one-pass scan (selective_scan.py's `_selective_scan_kernel`: one program
a row and BE channels, time in chunks of BT steps combined by an associative scan). It
takes dt_proj's raw output with the bias and softplus inside, and saves only the state each
chunk starts from: (B, T / BT, E, N), 1/BT of every step's state. dt_proj's product runs
inside the Function, made again in the backward, so that its (B, T, E) output is not kept.

The backward walks the same chunks from the last to the first, one program a row and BE
channels as in the forward. In each chunk it recomputes the chunk's states from the saved
start (the forward's associative scan), then runs the adjoint recurrence backwards

    g_t = C_t dy'_t + decay_{t+1} g_{t+1}          (g: dL/d state after step t; dy' = dy silu(z))

as an associative scan in reverse, with g of the next chunk's first step carried in
registers. With both in registers every gradient of the step is elementwise work and a sum:

    d delta_t = sum_n g_t (A decay_t s_{t-1} + x_t B_t),   decay_t s_{t-1} = s_t - delta_t x_t B_t
    dA       += sum_t g_t delta_t decay_t s_{t-1}
    dx_t      = delta_t sum_n g_t B_t + D dy'_t
    dB_t      = sum_e g_t delta_t x_t,   dC_t = sum_e s_t dy'_t     (over the channels: atomics)
    dz_t      = dy_t y_t silu'(z_t),     d dt_raw = d delta sigmoid(dt_raw + bias)
    d state0  = decay_0 g_0

A reset at step t decays by zero: nothing flows through it to the steps before, and its
decay has no gradient.

`deterministic=True` (fastmamba.Backbone(deterministic=True)): each program writes its
channels' shares of dB and dC to a slice of its own, which torch sums in a fixed order
instead of the atomics (whose order changes run to run): E / BE times dB's and dC's memory
for the backward's while. dt_proj's product goes through products.linear_invariant (a row's
step sizes the same bits at any batch size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton
from .activations import softplus
from .products import linear_invariant
from .selective_scan import _combine, _selective_scan_kernel, selective_scan_ref, step_and_scan_ref
from .step_size import step_size_ref


@dataclass(frozen=True)
class TrainScanTiles:
    """step_and_scan_train's launch settings, forward and backward alike (the chosen ones:
    engine/plan.py's TRAIN_SCAN_TILES)."""

    bt: int  # steps a chunk: the saved states' spacing
    be: int  # channels a program
    warps: int


@jit
def _decay_at(dt, A, resets_ptr, t, tmask, RESETS: tl.constexpr):
    """exp(dt * A) of steps t (BT, BE, NP); zero at a reset step."""
    decay = tl.exp(dt[:, :, None] * A[None, :, :])
    if RESETS:
        r = tl.load(resets_ptr + t, mask=tmask, other=0)
        decay = tl.where((r != 0)[:, None, None], 0.0, decay)
    return decay


@jit
def _scan_backward_kernel(
    x_ptr, sxb, sxe, sxt, dt_ptr, sdb, sde, sdt, z_ptr, szb, sze, szt, dy_ptr, syb, sye, syt,
    B_ptr, sbb, sbn, sbt, C_ptr, scb, scn, sct, dtb_ptr, A_ptr, D_ptr,
    saved_ptr, resets_ptr, dfinal_ptr,
    dx_ptr, ddt_ptr, dz_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, dinit_ptr, T, E,
    N: tl.constexpr, NP: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr, RESETS: tl.constexpr,
    PARTIALS: tl.constexpr = False,
):
    # One program: one row b, BE channels, the chunks from last to first (see the module's
    # docstring). x, dt (raw), z and dy come as (B, E, T) with their strides, B and C as
    # (B, N, T). dx, ddt, dz are written (B, T, E) contiguous; dB and dC are added into
    # (B, N, T) float32 zeros; dA (B, E, N) and dD (B, E) are this row's sums.
    b64 = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    emask = e < E
    n = tl.arange(0, NP)
    nmask = n < N
    sm = emask[:, None] & nmask[None, :]
    A = tl.load(A_ptr + e[:, None] * N + n[None, :], mask=sm, other=0.0)  # (BE, NP)
    Dv = tl.load(D_ptr + e, mask=emask, other=0.0)
    dtb = tl.load(dtb_ptr + e, mask=emask, other=0.0)
    state_at = e[:, None] * N + n[None, :]
    g_next = tl.load(dfinal_ptr + b64 * E * N + state_at, mask=sm, other=0.0)  # g of the step after the chunk
    dA = tl.zeros([BE, NP], dtype=tl.float32)
    dD = tl.zeros([BE], dtype=tl.float32)
    chunks = tl.cdiv(T, BT)
    rrow = resets_ptr + b64 * T
    for i in range(chunks):
        c = chunks - 1 - i
        t = c * BT + tl.arange(0, BT)
        tmask = t < T
        m = tmask[:, None] & emask[None, :]
        x = tl.load(x_ptr + b64 * sxb + t[:, None] * sxt + e[None, :] * sxe, mask=m, other=0.0).to(tl.float32)
        raw = tl.load(dt_ptr + b64 * sdb + t[:, None] * sdt + e[None, :] * sde, mask=m, other=0.0).to(tl.float32)
        raw += dtb[None, :]
        dt = tl.where(m, softplus(raw), 0.0)
        z = tl.load(z_ptr + b64 * szb + t[:, None] * szt + e[None, :] * sze, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + b64 * syb + t[:, None] * syt + e[None, :] * sye, mask=m, other=0.0).to(tl.float32)
        bn = tmask[:, None] & nmask[None, :]
        Bt = tl.load(B_ptr + b64 * sbb + t[:, None] * sbt + n[None, :] * sbn, mask=bn, other=0.0).to(tl.float32)
        Ct = tl.load(C_ptr + b64 * scb + t[:, None] * sct + n[None, :] * scn, mask=bn, other=0.0).to(tl.float32)
        # the forward's states in this chunk, from the one it starts from
        decay = _decay_at(dt, A, rrow, t, tmask, RESETS)
        inp = (dt * x)[:, :, None] * Bt[:, None, :]
        decay_cum, inp_cum = tl.associative_scan((decay, inp), 0, _combine)
        s0 = tl.load(saved_ptr + (b64 * chunks + c) * E * N + state_at, mask=sm, other=0.0)
        s = decay_cum * s0[None, :, :] + inp_cum  # (BT, BE, NP)
        y = tl.sum(s * Ct[:, None, :], 2) + Dv[None, :] * x
        sig = tl.sigmoid(z)
        dyg = dy * z * sig  # dL/dy before the gate
        dz = dy * y * sig * (1.0 + z * (1.0 - sig))
        # the adjoint: g_t = C_t dyg_t + decay_{t+1} g_{t+1}; past T (and at T - 1) the
        # factor is 1, so the last step's g takes the final state's gradient
        t1 = t + 1
        t1mask = t1 < T
        m1 = t1mask[:, None] & emask[None, :]
        raw1 = tl.load(dt_ptr + b64 * sdb + t1[:, None] * sdt + e[None, :] * sde, mask=m1, other=0.0).to(tl.float32)
        decay1 = _decay_at(tl.where(m1, softplus(raw1 + dtb[None, :]), 0.0), A, rrow, t1, t1mask, RESETS)
        g_cum_decay, g_cum = tl.associative_scan((decay1, Ct[:, None, :] * dyg[:, :, None]), 0, _combine, reverse=True)
        g = g_cum + g_cum_decay * g_next[None, :, :]
        before = s - inp  # decay_t * s_{t-1}
        ddelta = tl.sum(g * (A[None, :, :] * before + x[:, :, None] * Bt[:, None, :]), 2)
        dA += tl.sum(g * before * dt[:, :, None], 0)
        dD += tl.sum(dyg * x, 0)
        dx = dt * tl.sum(g * Bt[:, None, :], 2) + Dv[None, :] * dyg
        out = (b64 * T + t[:, None]) * E + e[None, :]
        tl.store(dx_ptr + out, dx, mask=m)
        tl.store(ddt_ptr + out, ddelta * tl.sigmoid(raw), mask=m)
        tl.store(dz_ptr + out, dz, mask=m)
        over = (b64 * N + n[None, :]) * T + t[:, None]  # (BT, NP) into (B, N, T)
        if PARTIALS:  # this program's slice: written once, summed later in a fixed order
            part = tl.program_id(1).to(tl.int64) * tl.num_programs(0) * N * T
            tl.store(dB_ptr + part + over, tl.sum(g * (dt * x)[:, :, None], 1), mask=bn)
            tl.store(dC_ptr + part + over, tl.sum(s * dyg[:, :, None], 1), mask=bn)
        else:
            tl.atomic_add(dB_ptr + over, tl.sum(g * (dt * x)[:, :, None], 1), mask=bn)
            tl.atomic_add(dC_ptr + over, tl.sum(s * dyg[:, :, None], 1), mask=bn)
        g_next = tl.sum(tl.where((t == c * BT)[:, None, None], g, 0.0), 0)  # the chunk's first step's
    # the state before step 0 reaches it through step 0's decay
    dt0 = tl.load(dt_ptr + b64 * sdb + e * sde, mask=emask, other=0.0).to(tl.float32)
    dt0 = tl.where(emask, softplus(dt0 + dtb), 0.0)
    decay0 = tl.exp(dt0[:, None] * A)
    if RESETS:
        decay0 = tl.where(tl.load(rrow) != 0, 0.0, decay0)
    tl.store(dinit_ptr + b64 * E * N + state_at, g_next * decay0, mask=sm)
    tl.store(dA_ptr + b64 * E * N + state_at, dA, mask=sm)
    tl.store(dD_ptr + b64 * E + e, dD, mask=emask)


def _forward(x, dt, dt_bias, A, Bm, Cm, D, z, state, resets, tiles):
    """The one-pass scan with the raw step sizes; y (B, E, T) float32 and the states the
    chunks start from (B, chunks, E, N). Updates state in place."""
    Bsz, E, T = x.shape
    N = A.shape[1]
    y = torch.empty(Bsz, T, E, device=x.device, dtype=torch.float32)
    start = torch.zeros(Bsz, device=x.device, dtype=torch.int32)
    flags = resets.to(torch.uint8).contiguous() if resets is not None else start
    saved = torch.empty(Bsz, triton.cdiv(T, tiles.bt), E, N, device=x.device)
    _selective_scan_kernel[(Bsz, triton.cdiv(E, tiles.be))](
        x, *x.stride(), dt, *dt.stride(), Bm, *Bm.stride(), Cm, *Cm.stride(), z, *z.stride(), A, D, state, y, start,
        flags, dt_bias, saved, T, E, N=N, NP=triton.next_power_of_2(N), BE=tiles.be, BT=tiles.bt,
        RESETS=resets is not None, RAW_DT=True, SAVE=True, num_warps=tiles.warps,
    )
    return y.transpose(1, 2), saved


def _dt_product(dt_r, dt_w, deterministic: bool) -> torch.Tensor:
    """dt_proj's product (B, T, E) float32, before the bias and softplus the kernels take."""
    return linear_invariant(dt_r, dt_w) if deterministic else F.linear(dt_r, dt_w)


class _Scan(torch.autograd.Function):
    """The scan with dt_proj inside: only dt_proj's input (B, T, R) is saved, and the step
    sizes' product (B, T, E) is made again in the backward, one (B, T, E) float32 tensor a
    layer less in memory between the passes. Under autocast its inputs come in float32 and
    its products run in float32 (the kernels' dtype; custom_fwd)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, x, dt_r, dt_w, dt_bias, A, Bm, Cm, D, z, state, resets, tiles, deterministic=False):
        s0 = state.detach().float().clone()  # the kernel runs on a float32 state
        dt = _dt_product(dt_r, dt_w, deterministic)  # (B, T, E)
        y, saved = _forward(x, dt.transpose(1, 2), dt_bias, A, Bm, Cm, D, z, s0, resets, tiles)
        ctx.save_for_backward(x, dt_r, dt_w, dt_bias, A, Bm, Cm, D, z, saved, resets)
        ctx.state_dtype, ctx.tiles, ctx.deterministic = state.dtype, tiles, deterministic
        with torch.no_grad():
            state.copy_(s0)
        ctx.mark_dirty(state)
        return y, state

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy, dstate):
        x, dt_r, dt_w, dt_bias, A, Bm, Cm, D, z, saved, resets = ctx.saved_tensors
        Bsz, E, T = x.shape
        N = A.shape[1]
        dev = x.device
        dt = _dt_product(dt_r, dt_w, ctx.deterministic).transpose(1, 2)
        dy = dy.float()
        dfinal = dstate.float().contiguous() if dstate is not None else torch.zeros(Bsz, E, N, device=dev)
        dx, ddt, dz = (torch.empty(Bsz, T, E, device=dev) for _ in range(3))  # the layout the products want
        tiles = ctx.tiles
        parts = triton.cdiv(E, tiles.be) if ctx.deterministic else None  # (E / BE, B, N, T): a slice a program
        if parts:
            dB, dC = torch.empty(parts, Bsz, N, T, device=dev), torch.empty(parts, Bsz, N, T, device=dev)
        else:
            dB, dC = torch.zeros(Bsz, N, T, device=dev), torch.zeros(Bsz, N, T, device=dev)
        dA, dinit = torch.empty(Bsz, E, N, device=dev), torch.empty(Bsz, E, N, device=dev)
        dD = torch.empty(Bsz, E, device=dev)
        flags = resets.to(torch.uint8).contiguous() if resets is not None else dx
        _scan_backward_kernel[(Bsz, triton.cdiv(E, tiles.be))](
            x, *x.stride(), dt, *dt.stride(), z, *z.stride(), dy, *dy.stride(), Bm, *Bm.stride(), Cm, *Cm.stride(),
            dt_bias, A, D, saved, flags, dfinal,
            dx, ddt, dz, dB, dC, dA, dD, dinit, T, E,
            N=N, NP=triton.next_power_of_2(N), BE=tiles.be, BT=tiles.bt, RESETS=resets is not None,
            PARTIALS=bool(parts), num_warps=tiles.warps,
        )
        if parts:  # the programs' shares in order of their channels
            dB, dC = dB.sum(0), dC.sum(0)
        ddt_flat = ddt.view(-1, E)
        d_dt_r = (ddt_flat @ dt_w).view(dt_r.shape)
        d_dt_w = ddt_flat.t() @ dt_r.reshape(-1, dt_r.shape[-1])
        return (dx.transpose(1, 2), d_dt_r, d_dt_w, ddt_flat.sum(0), dA.sum(0), dB, dC, dD.sum(0), dz.transpose(1, 2),
                dinit.to(ctx.state_dtype), None, None, None)


def step_and_scan_train(x, dt_r, dt_w, dt_b, A, Bm, Cm, D, z, state, start=None, out_dtype=None, resets=None, *,
                        tiles: TrainScanTiles, deterministic: bool = False):
    """The scan with gradients (Ops.scan of core/ops.training_ops, step_and_scan_ref's
    signature): x (B, E, T); dt_r (B, T, R) x_proj's step-size part, dt_w (E, R) and dt_b
    (E,) dt_proj's; A (E, N); Bm, Cm (B, N, T); D (E,); z (B, E, T); state (B, E, N),
    updated in place (autograd follows it); resets (B, T) bool or None. Returns y (B, E, T)
    float32, as step_and_scan_ref (whose out_dtype it ignores too). No left padding: a
    training pass has none. tiles: the kernels' launch settings. deterministic: no atomics,
    dt_proj's product batch-invariant (see the module's doc)."""
    if start is not None:
        raise ValueError("step_and_scan_train takes no left padding (start)")
    f = lambda t: t.float()  # noqa: E731  (the kernels' and the Function's float32)
    return _Scan.apply(f(x), f(dt_r), f(dt_w), f(dt_b), f(A).contiguous(), f(Bm), f(Cm), f(D), f(z), state, resets,
                       tiles, deterministic)[0]


# -- the CPU's training scan --------------------------------------------------------------------
# selective_scan_ref under autograd costs about 25 small operations a time step between its
# forward and its backward, each on a (B, E, N) slice: on the CPU the calls, not the
# arithmetic, took most of a Backbone's training pass. The same recurrence as a Function:
# every step's decay and input made at once over a chunk of time, the loop one multiply-add
# a step each way, the gradients (the adjoint recurrence of this module's doc) as whole-chunk
# products. It keeps the state each chunk starts from and makes the chunk's states again
# in the backward, as the Triton Function does.

def _cpu_chunk(state: torch.Tensor, elements: int) -> int:
    """Time steps a chunk: the most whose states (L x B x E x N) fit `elements`, 4 to 64 (a
    few steps a product at least; the working set bounded)."""
    return max(4, min(64, elements // max(1, state.numel())))


def _chunk_states(s, delta, gain, Bm, A):
    """One chunk's states from its start s (B, E, N): delta (L, B, E) time first, +inf where
    a reset zeroes the state first (its decay exp(-inf) = 0), gain = delta x (L, B, E) as
    given, Bm (L, B, N) -> the states after each step (L, B, E, N) and each step's decay (L,
    B, E, N)."""
    decay = torch.exp_(delta[..., None] * A)
    states = gain[..., None] * Bm[:, :, None, :]  # each step's input, then its state
    prev = s
    for t in range(states.shape[0]):
        prev = states[t].addcmul_(decay[t], prev)
    return states, decay


def _time_first(t: torch.Tensor) -> torch.Tensor:
    return t.permute(2, 0, 1).contiguous()  # (B, C, T) -> (T, B, C)


def _scan_inputs(x, delta, Bm, resets):
    """The chunks' inputs, time first: delta with +inf at resets (for the decays), the gains
    delta x, Bm, and delta and x as they are."""
    xt, dt = _time_first(x), _time_first(delta)
    decay_dt = dt if resets is None else dt.masked_fill(resets.t()[..., None], float("inf"))
    return decay_dt, dt * xt, _time_first(Bm), dt, xt


class _ScanCPU(torch.autograd.Function):
    """selective_scan_ref's values with the backward written out (see above): x, delta, z (B,
    E, T), A (E, N) (every entry negative, as -exp(A_log)), Bm, Cm (B, N, T), D (E,), state (B,
    E, N) the start state, `state` written in place with the final one, resets (B, T) bool or
    None. float32, or float64 for the gradient tests; under autocast float32 (custom_fwd), as
    the Triton Function. A backward that autograd is to differentiate again (create_graph)
    differentiates the reference's time loop instead."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, delta, A, Bm, Cm, D, z, s0, state, resets, chunk_elements):
        decay_dt, gain, Bt, _, _ = _scan_inputs(x, delta, Bm, resets)
        Ct = _time_first(Cm)
        T = gain.shape[0]
        ys = torch.empty_like(gain)  # (T, B, E)
        starts, s = [], s0.to(x.dtype)
        ctx.chunk = chunk = _cpu_chunk(state, chunk_elements)
        for c0 in range(0, T, chunk):
            c = slice(c0, c0 + chunk)
            starts.append(s)
            states, _ = _chunk_states(s, decay_dt[c], gain[c], Bt[c], A)
            ys[c] = torch.matmul(states, Ct[c, :, :, None])[..., 0]
            s = states[-1].clone()
        y = ys.permute(1, 2, 0) + D[None, :, None] * x  # (B, E, T)
        ctx.save_for_backward(x, delta, A, Bm, Cm, D, z, s0, resets, torch.stack(starts), y)
        ctx.state_dtype = state.dtype
        with torch.no_grad():
            state.copy_(s)
        ctx.mark_dirty(state)
        return y * F.silu(z), state

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, dout, dstate):
        x, delta, A, Bm, Cm, D, z, s0, resets, starts, y = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a gradient autograd can differentiate
            return _ScanCPU.differentiable_backward(x, delta, A, Bm, Cm, D, z, s0, resets, dout, dstate)
        decay_dt, gain, Bt, dt, xt = _scan_inputs(x, delta, Bm, resets)
        Ct = _time_first(Cm)
        sig = torch.sigmoid(z)
        dy = dout * z * sig  # through the gate: dL/dy
        dz = dout * y * sig * (1 + z * (1 - sig))
        dyt = _time_first(dy)
        T = gain.shape[0]
        ddelta, dB, dC = torch.empty_like(dt), torch.empty_like(Bt), torch.empty_like(Ct)
        dA = torch.zeros_like(A)
        # decay_{t+1} g_{t+1} from the chunk after (after the last step: the final state's gradient)
        carry = dstate.to(x.dtype) if dstate is not None else torch.zeros_like(starts[0])
        for k, c0 in reversed(list(enumerate(range(0, T, ctx.chunk)))):
            c = slice(c0, c0 + ctx.chunk)
            states, decay = _chunk_states(starts[k], decay_dt[c], gain[c], Bt[c], A)
            # g_t = C_t dy_t + decay_{t+1} g_{t+1}, from the chunk's last step to its first
            g = dyt[c, :, :, None] * Ct[c, :, None, :]
            g[-1] += carry
            for t in range(g.shape[0] - 2, -1, -1):
                g[t].addcmul_(decay[t + 1], g[t + 1])
            dC[c] = torch.matmul(states.transpose(-1, -2), dyt[c, :, :, None])[..., 0]
            dB[c] = torch.matmul(g.transpose(-1, -2), gain[c, :, :, None])[..., 0]
            d_gain = torch.matmul(g, Bt[c, :, :, None])[..., 0]  # dL/d(delta x)
            # dL/d(delta A) a step: g_t decay_t s_{t-1} (zero where a reset zeroed the decay)
            d_log_decay = g.mul_(decay)  # (g is done with)
            carry = d_log_decay[0].clone()  # decay_0 g_0: to the chunk before (or the start state)
            d_log_decay[1:] *= states[:-1]
            d_log_decay[0] *= starts[k]
            dA += (d_log_decay * dt[c, :, :, None]).sum((0, 1))
            ddelta[c] = (d_log_decay * A).sum(-1) + d_gain * xt[c]
            gain[c] = d_gain * dt[c]  # dL/dx's share (gain's chunk is done with: it holds dx from here)
        dstate0 = carry.to(ctx.state_dtype)
        back = lambda t: t.permute(1, 2, 0)  # noqa: E731  (T, B, C) -> (B, C, T)
        return (back(gain) + dy * D[None, :, None], back(ddelta), dA, back(dB), back(dC), (dy * x).sum((0, 2)), dz,
                dstate0, None, None, None)

    @staticmethod
    def differentiable_backward(x, delta, A, Bm, Cm, D, z, s0, resets, dout, dstate):
        """The gradients through selective_scan_ref's time loop under autograd, as a graph of
        their own (gradient penalties, second-order methods)."""
        inputs = (x, delta, A, Bm, Cm, D, z, s0)
        wanted = [t for t in inputs if t.requires_grad]  # (a start state of zeros, say, needs none)
        final = s0.clone()
        y = selective_scan_ref(x, delta, A, Bm, Cm, D, z, final, resets=resets)
        outs, grads = ([y, final], [dout, dstate]) if dstate is not None else ([y], [dout])
        found = iter(torch.autograd.grad(outs, wanted, grads, create_graph=True, allow_unused=True))
        return (*(next(found) if t.requires_grad else None for t in inputs), None, None, None)


def step_and_scan_train_ref(x, dt_r, dt_w, dt_b, A, Bm, Cm, D, z, state, start=None, out_dtype=None, resets=None, *,
                            chunk_elements: int):
    """step_and_scan_ref's values (its signature; out_dtype ignored, y float32, or float64 for
    float64 x) through _ScanCPU: a Backbone's scan off the GPU path, with autograd or without.
    Left padding (start) goes through step_and_scan_ref itself. chunk_elements: the states a
    chunk holds at most (engine/plan.CPU_SCAN_CHUNK_ELEMENTS)."""
    if start is not None:
        return step_and_scan_ref(x, dt_r, dt_w, dt_b, A, Bm, Cm, D, z, state, start, out_dtype, resets)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    delta = step_size_ref(dt_r, dt_w, dt_b).transpose(1, 2)  # (B, E, T)
    f = lambda t: t.to(wide)  # noqa: E731
    return _ScanCPU.apply(f(x), f(delta), f(A), f(Bm), f(Cm), f(D), f(z), state.clone(), state, resets,
                          chunk_elements)[0]
