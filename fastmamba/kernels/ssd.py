"""The Mamba-2 (SSD) scan: H heads of P channels, each head's state (P, N) decaying by one
scalar a step, its input and output through the B and C of the head's group.

`ssd_scan_ref` is the pure-PyTorch twin: the step sizes (softplus of dt + bias, clamped to
dt_limit, zero at left padding), then the chunked SSD of `ssd_ref`: quadratic inside a
chunk, a scan across chunks. `ssd_scan` is the Triton engine's:
- a decode step (one token, no padding) is one kernel, `_ssd_step_kernel`, that updates
  every head's state in place;
- a longer pass is the chunked SSD in three kernels over chunks of SSDTiles.chunk steps, its
  products on the tensor cores: each chunk's own end state from a zero start
  (`_ssd_chunk_state_kernel`), the states passed from chunk to chunk
  (`_ssd_state_passing_kernel`: the state each chunk starts from, and the layer's new
  state), and each chunk's outputs (`_ssd_chunk_scan_kernel`: the masked C B^T product
  within the chunk, plus C times the state it starts from). A fourth kernel before them,
  `_ssd_step_sizes_kernel`, gives the step sizes and their running sums inside each chunk.
Resets (B, T) (the state is zero before step t: an episode's or a packed sequence's start)
enter the chunked kernels as each step's latest reset (causal_conv1d.segment_starts), a
constexpr branch each: a term from step s reaches step t only where both name the same
reset. A pass with resets takes the chunked kernels, even at one step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton
from .activations import softplus
from .causal_conv1d import segment_starts
from .products import tensor_dot
from .selective_scan import _combine


def ssd_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
            D: torch.Tensor, state: torch.Tensor, chunk: int, resets: torch.Tensor | None = None) -> torch.Tensor:
    """The Mamba-2 scan over T steps in chunks of `chunk`, from and into `state`.

    x (B, T, H, P), dt (B, T, H) (after softplus), A (H,), Bm and Cm (B, T, G, N), D (H,),
    state (B, H, P, N) (any float dtype: read in float32, rounded once on store).
    Returns y (B, T, H, P) float32, the D skip included. Inside a chunk, with a_t = dt_t A
    and S_t their running sum from the chunk's start,
      y_t = sum_{s<=t} exp(S_t - S_s) (C_t . B_s) dt_s x_s  +  exp(S_t) C_t . state_in
    and state_out = exp(S_last) state_in + sum_s exp(S_last - S_s) dt_s x_s (outer) B_s.
    (S_t - S_s <= 0 wherever it is used, so no exp overflows.)
    resets (B, T) bool: the row's state is zero before step t. A term from step s (or from
    state_in) then reaches step t only if no reset lies in (s, t] (in [chunk start, t]):
    each step's latest reset (segment_starts) is the same for s and t (before the chunk
    for state_in)."""
    Bsz, T, H, P = x.shape
    G = Bm.shape[2]
    Bh = Bm.float().repeat_interleave(H // G, dim=2)  # (B, T, H, N): head h reads group h // (H / G)
    Ch = Cm.float().repeat_interleave(H // G, dim=2)
    x, dt = x.float(), dt.float()
    first = None if resets is None else segment_starts(resets, 0)  # (B, T): the latest reset, -1 before any
    s = state.float()  # (B, H, P, N)
    ys = []
    for t0 in range(0, T, chunk):
        xs, dts, Bs, Cs = (v[:, t0 : t0 + chunk] for v in (x, dt, Bh, Ch))
        Q = xs.shape[1]
        S = torch.cumsum(dts * A, dim=1)  # (B, Q, H)
        diff = S[:, :, None, :] - S[:, None, :, :]  # (B, Q_t, Q_s, H): S_t - S_s
        reach = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()[None, :, :, None]  # s <= t
        state_in = torch.exp(S)  # (B, Q, H): state_in's decay to each step
        end = torch.exp(S[:, -1:] - S) * dts  # (B, Q, H): each step's input's weight in the end state
        if first is not None:
            f = first[:, t0 : t0 + chunk]  # (B, Q)
            reach = reach & (f[:, :, None] == f[:, None, :])[..., None]
            state_in = state_in * (f < t0)[..., None]
            end = end * (f == f[:, -1:])[..., None]
        decay = torch.exp(diff.masked_fill(~reach, float("-inf")))  # (B, Qt, Qs, H), 0 where s does not reach t
        scores = torch.einsum("bthn,bshn->btsh", Cs, Bs) * decay  # (B, Qt, Qs, H)
        y = torch.einsum("btsh,bshp->bthp", scores, xs * dts[..., None])  # within the chunk
        y = y + torch.einsum("bthn,bhpn->bthp", Cs, s) * state_in[..., None]  # from the state coming in
        ys.append(y)
        s = s * state_in[:, -1, :, None, None] + torch.einsum("bsh,bshp,bshn->bhpn", end, xs, Bs)
    state.copy_(s)
    return torch.cat(ys, dim=1) + x * D[:, None]


def step_sizes_ref(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float], start=None) -> torch.Tensor:
    """dt (B, T, H) in_proj's raw step sizes -> clamp(softplus(dt + dt_bias), dt_limit), float32,
    zero before start (B,) (left padding: no decay, no input)."""
    dt = F.softplus(dt.float() + dt_bias).clamp(*dt_limit)
    if start is not None:
        dt = dt * (torch.arange(dt.shape[1], device=dt.device)[None, :] >= start[:, None].long())[..., None]
    return dt


def ssd_scan_ref(x, dt, dt_bias, dt_limit, A, Bm, Cm, D, state, chunk: int, start=None, resets=None) -> torch.Tensor:
    """The layer's scan from in_proj's raw step sizes: x (B, T, H, P), dt (B, T, H) raw,
    Bm and Cm (B, T, G, N), state (B, H, P, N) updated in place; y (B, T, H, P) float32.
    start (B,): left padding; resets (B, T) bool: the state is zero before step t."""
    return ssd_ref(x, step_sizes_ref(dt, dt_bias, dt_limit, start), A, Bm, Cm, D, state, chunk, resets)


@jit
def ssd_step_update(s, x, Bv, dt_raw, dt_bias, A, dt_min, dt_max):
    """One step of a head's channels' states s (BP, NP) float32, from x (BP,), the group's B
    (NP,) and in_proj's raw step size: s exp(dt A) + dt x (outer) B, with
    dt = softplus(dt_raw + dt_bias) clamped to [dt_min, dt_max]. (y = s C + D x follows.)"""
    dt = tl.minimum(tl.maximum(softplus(dt_raw + dt_bias), dt_min), dt_max)
    return s * tl.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]


@jit
def _ssd_step_kernel(
    x_ptr, sxb, B_ptr, C_ptr, sbb, dt_ptr, sdb, dtb_ptr, A_ptr, D_ptr, st_ptr, y_ptr, heads_per_group, dt_min, dt_max,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, NP: tl.constexpr,
):
    # One program: one row b, one head h, BP of its P channels, all N states of each. The
    # state is read in its dtype, updated in float32 and rounded once on store.
    #   s = s exp(dt A) + dt x (outer) B_g;  y = s C_g + D x     (g = h // heads_per_group)
    # The channel blocks vary fastest, then the heads: the programs running together read
    # one stretch of the state. (With the rows fastest they would read the same 8 KB of
    # every head of every row, H x P x N apart; see benchmarks/RESULTS.md, "Mamba-2".)
    p = tl.program_id(0) * BP + tl.arange(0, BP)
    h = tl.program_id(1)
    b64 = tl.program_id(2).to(tl.int64)
    n = tl.arange(0, NP)
    pm, nm = p < P, n < N
    g = h // heads_per_group
    x = tl.load(x_ptr + b64 * sxb + h * P + p, mask=pm, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + b64 * sbb + g * N + n, mask=nm, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + b64 * sbb + g * N + n, mask=nm, other=0.0).to(tl.float32)
    sp = st_ptr + ((b64 * H + h) * P + p[:, None]) * N + n[None, :]
    sm = pm[:, None] & nm[None, :]
    s = ssd_step_update(tl.load(sp, mask=sm, other=0.0).to(tl.float32), x, Bv,
                        tl.load(dt_ptr + b64 * sdb + h).to(tl.float32), tl.load(dtb_ptr + h), tl.load(A_ptr + h),
                        dt_min, dt_max)
    tl.store(sp, s.to(st_ptr.dtype.element_ty), mask=sm)
    y = tl.sum(s * Cv[None, :], 1) + tl.load(D_ptr + h) * x
    tl.store(y_ptr + b64 * H * P + h * P + p, y, mask=pm)


@jit
def _ssd_step_sizes_kernel(
    dt_ptr, sdb, sdt, dtb_ptr, A_ptr, start_ptr, out_ptr, cum_ptr, T, n_chunks, dt_min, dt_max,
    H: tl.constexpr, Q: tl.constexpr, BH: tl.constexpr, START: tl.constexpr,
):
    # One program: row b, chunk c, BH heads. The step sizes clamp(softplus(dt + dt_bias)),
    # zero before the row's start and past T, into out (B, T, H) float32; the running sums of
    # dt A over the chunk's steps into cum (B, chunks, Q, H). In torch these were six
    # elementwise passes and a cumsum over an outer axis (53 µs a layer at 2.7b, 1 x 8192).
    b64 = (tl.program_id(0) // n_chunks).to(tl.int64)
    c = tl.program_id(0) % n_chunks
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    q = tl.arange(0, Q)
    t = c * Q + q
    hm = h < H
    live = t < T
    if START:
        live = live & (t >= tl.load(start_ptr + b64))
    raw = tl.load(dt_ptr + b64 * sdb + t[:, None] * sdt + h[None, :], mask=live[:, None] & hm[None, :], other=0.0)
    d = softplus(raw.to(tl.float32) + tl.load(dtb_ptr + h, mask=hm, other=0.0)[None, :])
    d = tl.where(live[:, None], tl.minimum(tl.maximum(d, dt_min), dt_max), 0.0)  # (Q, BH)
    tl.store(out_ptr + (b64 * T + t[:, None]) * H + h[None, :], d, mask=(t < T)[:, None] & hm[None, :])
    cum = tl.cumsum(d * tl.load(A_ptr + h, mask=hm, other=0.0)[None, :], 0)
    tl.store(cum_ptr + ((b64 * n_chunks + c) * Q + q[:, None]) * H + h[None, :], cum, mask=hm[None, :])


@jit
def _ssd_chunk_state_kernel(
    x_ptr, sxb, sxt, B_ptr, sbb, sbt, dt_ptr, cum_ptr, first_ptr, st_ptr, T, n_chunks, heads_per_group,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, Q: tl.constexpr, BS: tl.constexpr, BP: tl.constexpr,
    NP: tl.constexpr, F32: tl.constexpr, RESETS: tl.constexpr,
):
    # One program: row b, chunk c, head h, BP channels: the chunk's end state from a zero
    # start, sum_s exp(cum_last - cum_s) dt_s x_s (outer) B_s, as (x^T) (w B) in blocks of
    # BS steps; into states (B, chunks, H, P, N) float32. With RESETS only the steps after
    # the chunk's last reset count (first: each step's latest reset, see ssd_ref).
    b64 = (tl.program_id(0) // n_chunks).to(tl.int64)
    c = tl.program_id(0) % n_chunks
    h = tl.program_id(1)
    p = tl.program_id(2) * BP + tl.arange(0, BP)
    n = tl.arange(0, NP)
    g = h // heads_per_group
    cum_row = cum_ptr + (b64 * n_chunks + c) * Q * H + h  # (B, chunks, Q, H)
    last = tl.load(cum_row + (Q - 1) * H)
    if RESETS:
        first_last = tl.load(first_ptr + b64 * T + tl.minimum(c * Q + Q - 1, T - 1))
    acc = tl.zeros([BP, NP], dtype=tl.float32)
    for s0 in range(0, Q, BS):
        q = s0 + tl.arange(0, BS)
        t = c * Q + q
        tm = t < T
        w = tl.load(dt_ptr + (b64 * T + t) * H + h, mask=tm, other=0.0) * tl.exp(last - tl.load(cum_row + q * H))
        if RESETS:
            w = tl.where(tl.load(first_ptr + b64 * T + t, mask=tm, other=-1) == first_last, w, 0.0)
        xs = tl.load(x_ptr + b64 * sxb + t[None, :] * sxt + h * P + p[:, None], mask=tm[None, :] & (p < P)[:, None],
                     other=0.0)  # (BP, BS)
        Bs = tl.load(B_ptr + b64 * sbb + t[:, None] * sbt + g * N + n[None, :], mask=tm[:, None] & (n < N)[None, :],
                     other=0.0)  # (BS, NP)
        acc = tensor_dot(xs, (Bs.to(tl.float32) * w[:, None]).to(Bs.dtype), acc, F32)
    ptrs = st_ptr + (((b64 * n_chunks + c) * H + h) * P + p[:, None]) * N + n[None, :]
    tl.store(ptrs, acc, mask=(p < P)[:, None] & (n < N)[None, :])


@jit
def _ssd_state_passing_kernel(
    st_ptr, starts_ptr, layer_ptr, cum_ptr, first_ptr, T, n_chunks, H: tl.constexpr, PN: tl.constexpr,
    Q: tl.constexpr, BL: tl.constexpr, CB: tl.constexpr, RESETS: tl.constexpr,
):
    # One program: row b, head h, BL of the P x N state's elements. From each chunk's own
    # end state (states) it writes the state the chunk starts from (starts):
    #   start_0 = the layer's state,  start_{c+1} = exp(sum of chunk c's dt A) start_c + own_c
    # (with RESETS, the decay is 0 after a chunk with a reset in it). CB chunks at a time:
    # all their end states in one load, the recurrence over them as an associative scan.
    # Walking one chunk a load at a time kept one small load in flight a program and ran
    # at 1/7 of mamba_ssm's speed (2.7b, 1 x 8192: 263 µs against 37). The carried state
    # stays float32; the starts go out in the dtype the chunk scan's product rounds them
    # to (starts' dtype), and the layer's state is written back once, after the last
    # chunk. The element blocks vary fastest (the step kernel's reason).
    k = tl.program_id(0) * BL + tl.arange(0, BL)
    h = tl.program_id(1)
    b64 = tl.program_id(2).to(tl.int64)
    km = k < PN
    lp = layer_ptr + (b64 * H + h) * PN + k
    s = tl.load(lp, mask=km, other=0.0).to(tl.float32)  # (BL,) the state the block's first chunk starts from
    cc = tl.arange(0, CB)
    for c0 in range(0, n_chunks, CB):
        c = c0 + cc
        cm = c < n_chunks
        slot = ((b64 * n_chunks + c[:, None]) * H + h) * PN + k[None, :]  # (CB, BL)
        own = tl.load(st_ptr + slot, mask=cm[:, None] & km[None, :], other=0.0)
        decay = tl.exp(tl.load(cum_ptr + ((b64 * n_chunks + c) * Q + Q - 1) * H + h, mask=cm, other=0.0))
        if RESETS:
            decay = tl.where(tl.load(first_ptr + b64 * T + tl.minimum(c * Q + Q - 1, T - 1), mask=cm, other=0) < c * Q,
                             decay, 0.0)
        decay_cum, own_cum = tl.associative_scan((tl.broadcast_to(decay[:, None], (CB, BL)), own), 0, _combine)
        ends = decay_cum * s[None, :] + own_cum  # (CB, BL): the state after each chunk = the next one's start
        # chunk c0 starts from s; chunk c + 1 (inside this block) from chunk c's end
        out = starts_ptr + slot
        tl.store(out, tl.broadcast_to(s[None, :], (CB, BL)).to(starts_ptr.dtype.element_ty),
                 mask=(cc == 0)[:, None] & km[None, :])
        tl.store(out + H * PN, ends.to(starts_ptr.dtype.element_ty),
                 mask=((cc < CB - 1) & (c + 1 < n_chunks))[:, None] & km[None, :])
        last = tl.minimum(n_chunks - c0, CB) - 1  # the block's last chunk: its end is the next block's start
        s = tl.sum(tl.where((cc == last)[:, None], ends, 0.0), 0)
    tl.store(lp, s.to(layer_ptr.dtype.element_ty), mask=km)


@jit
def _c_rows(C_ptr, b64, sbb, sbt, t, T, g, N, n):
    """C at steps t of row b, group g: (len(t), NP), zero past T and N."""
    return tl.load(C_ptr + b64 * sbb + t[:, None] * sbt + g * N + n[None, :], mask=(t < T)[:, None] & (n < N)[None, :],
                   other=0.0)


@jit
def _cb_block(Ct, B_ptr, b64, sbb, sbt, s, T, g, N, n, BT: tl.constexpr, BS: tl.constexpr, F32: tl.constexpr):
    """C_t . B_s for the BT steps of Ct (from _c_rows) and the BS steps s: (BT, BS) float32."""
    Bs = tl.load(B_ptr + b64 * sbb + s[None, :] * sbt + g * N + n[:, None], mask=(s < T)[None, :] & (n < N)[:, None],
                 other=0.0)  # (NP, BS)
    return tensor_dot(Ct, Bs, tl.zeros([BT, BS], dtype=tl.float32), F32)


@jit
def _ssd_chunk_cb_kernel(
    B_ptr, C_ptr, sbb, sbt, cb_ptr, T, n_chunks,
    G: tl.constexpr, N: tl.constexpr, Q: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, NP: tl.constexpr,
    F32: tl.constexpr,
):
    # One program: row b, chunk c, group g, BT of the chunk's steps: C_t . B_s for the steps
    # s up to the diagonal block, into cb (B, chunks, G, Q, Q) float32, which every head of
    # the group reads in the chunk scan (SSDTiles.cb_once; the blocks above are never read).
    b64 = (tl.program_id(0) // n_chunks).to(tl.int64)
    c = tl.program_id(0) % n_chunks
    g = tl.program_id(1)
    qt = tl.program_id(2) * BT + tl.arange(0, BT)
    t = c * Q + qt
    n = tl.arange(0, NP)
    Ct = _c_rows(C_ptr, b64, sbb, sbt, t, T, g, N, n)
    out = cb_ptr + (((b64 * n_chunks + c) * G + g) * Q + qt[:, None]) * Q
    for k0 in range(0, (tl.program_id(2) + 1) * BT, BS):
        qs = k0 + tl.arange(0, BS)
        tl.store(out + qs[None, :], _cb_block(Ct, B_ptr, b64, sbb, sbt, c * Q + qs, T, g, N, n, BT, BS, F32))


@jit
def _ssd_chunk_scan_kernel(
    x_ptr, sxb, sxt, B_ptr, C_ptr, sbb, sbt, dt_ptr, cum_ptr, first_ptr, starts_ptr, D_ptr, y_ptr, cb_ptr, T, n_chunks,
    heads_per_group, H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, Q: tl.constexpr, BT: tl.constexpr,
    BS: tl.constexpr, BP: tl.constexpr, NP: tl.constexpr, F32: tl.constexpr, RESETS: tl.constexpr,
    CB_ONCE: tl.constexpr, G: tl.constexpr,
):
    # One program: row b, chunk c, head h, BT of the chunk's steps, all P channels:
    #   y_t = exp(cum_t) C_t . s_start + sum_{s <= t} exp(cum_t - cum_s) (C_t . B_s) dt_s x_s + D x_t
    # the first from the state the chunk starts from (starts, from the passing kernel),
    # the sum in blocks of BS steps up to the diagonal block. With RESETS a term reaches t
    # only from the steps since t's latest reset (s_start only if it lies before the chunk).
    b64 = (tl.program_id(0) // n_chunks).to(tl.int64)
    c = tl.program_id(0) % n_chunks
    h = tl.program_id(1)
    qt = tl.program_id(2) * BT + tl.arange(0, BT)
    g = h // heads_per_group
    t = c * Q + qt
    tm = t < T
    p = tl.arange(0, BP)
    n = tl.arange(0, NP)
    pm, nm = p < P, n < N
    cum_row = cum_ptr + (b64 * n_chunks + c) * Q * H + h
    cum_t = tl.load(cum_row + qt * H)
    Ct = _c_rows(C_ptr, b64, sbb, sbt, t, T, g, N, n)
    s0 = tl.load(starts_ptr + (((b64 * n_chunks + c) * H + h) * P + p[None, :]) * N + n[:, None],
                 mask=pm[None, :] & nm[:, None], other=0.0)  # (NP, BP): the start state, transposed
    from_start = tl.exp(cum_t)
    if RESETS:
        first_t = tl.load(first_ptr + b64 * T + t, mask=tm, other=-1)
        from_start = tl.where(first_t < c * Q, from_start, 0.0)
    acc = tensor_dot(Ct, s0.to(Ct.dtype), tl.zeros([BT, BP], dtype=tl.float32), F32) * from_start[:, None]
    for k0 in range(0, (tl.program_id(2) + 1) * BT, BS):
        qs = k0 + tl.arange(0, BS)
        s = c * Q + qs
        sm = s < T
        if CB_ONCE:  # the group's C B^T, from _ssd_chunk_cb_kernel
            cb = tl.load(cb_ptr + (((b64 * n_chunks + c) * G + g) * Q + qt[:, None]) * Q + qs[None, :])
        else:
            cb = _cb_block(Ct, B_ptr, b64, sbb, sbt, s, T, g, N, n, BT, BS, F32)
        decay = tl.exp(tl.minimum(cum_t[:, None] - tl.load(cum_row + qs * H)[None, :], 0.0))
        dts = tl.load(dt_ptr + (b64 * T + s) * H + h, mask=sm, other=0.0)
        reach = qs[None, :] <= qt[:, None]
        if RESETS:
            reach = reach & (tl.load(first_ptr + b64 * T + s, mask=sm, other=-2)[None, :] == first_t[:, None])
        m = tl.where(reach, cb * decay * dts[None, :], 0.0)
        xs = tl.load(x_ptr + b64 * sxb + s[:, None] * sxt + h * P + p[None, :], mask=sm[:, None] & pm[None, :], other=0.0)
        acc = tensor_dot(m.to(xs.dtype), xs, acc, F32)
    xt = tl.load(x_ptr + b64 * sxb + t[:, None] * sxt + h * P + p[None, :], mask=tm[:, None] & pm[None, :], other=0.0)
    y = acc + tl.load(D_ptr + h) * xt.to(tl.float32)
    tl.store(y_ptr + ((b64 * T + t[:, None]) * H + h) * P + p[None, :], y, mask=tm[:, None] & pm[None, :])


@dataclass(frozen=True)
class SSDTiles:
    """ssd_scan's launch settings (the chosen ones: engine/plan.py's SSD_TILES)."""

    chunk: int  # steps a chunk of the chunked SSD (whatever the caller's `chunk`: the same sum)
    bt: int  # the chunk scan's steps a program (and the C B^T kernel's)
    bs: int  # steps a block of the chunk scan's and the chunk state's sums over steps
    scan_warps: int  # the chunk scan's warps
    scan_stages: int  # and its loops' pipeline depth (num_stages)
    state_bp: int  # the chunk state's channels a program
    pass_bl: int  # the state passing's elements of a head's P x N state a program,
    pass_cb: int  # its chunks a load (the recurrence over them an associative scan),
    pass_warps: int  # and its warps
    sizes_bh: int  # heads a step-size program (all of a chunk's steps of each)
    cb_once: bool  # C B^T once a group and chunk, in a kernel of its own, for every head's chunk scan to read
    step_bp: int  # the decode step's channels of a head a program (all N states of each in registers),
    step_warps: int  # and its warps


def ssd_scan(x, dt, dt_bias, dt_limit, A, Bm, Cm, D, state, chunk: int, start=None, resets=None, *,
             tiles: SSDTiles) -> torch.Tensor:
    """Triton twin of `ssd_scan_ref` (the same arguments; x, dt, Bm, Cm may be views with
    their heads' and groups' channels contiguous, in float32 or 16-bit: float32 operands
    take the products in three TF32 passes). The chunks are tiles.chunk steps whatever
    `chunk` says: the result is the same sum. tiles: the kernels' launch settings."""
    Bsz, T, H, P = x.shape
    G, N = Bm.shape[2], Bm.shape[3]
    even = (x.stride(3) == 1 and x.stride(2) == P and Bm.stride(3) == 1 and Bm.stride(2) == N
            and Cm.stride() == Bm.stride() and dt.stride(2) == 1)
    # (a time axis of one step may carry any stride: torch ignores a size-1 axis's stride)
    rows_whole = T == 1 or not (x.stride(0) % x.stride(1) or Bm.stride(0) % Bm.stride(1))
    if not even or not rows_whole:
        return ssd_scan_ref(x, dt, dt_bias, dt_limit, A, Bm, Cm, D, state, chunk, start, resets)
    assert state.is_contiguous()
    if T == 1 and start is None and resets is None and dt.stride(-1) == 1:
        y = torch.empty(Bsz, 1, H, P, device=x.device, dtype=torch.float32)
        BP = min(tiles.step_bp, triton.next_power_of_2(P))
        _ssd_step_kernel[(triton.cdiv(P, BP), H, Bsz)](
            x, x.stride(0), Bm, Cm, Bm.stride(0), dt, dt.stride(0), dt_bias, A, D, state, y, H // G,
            float(dt_limit[0]), float(dt_limit[1]), H=H, P=P, N=N, BP=BP, NP=triton.next_power_of_2(N),
            num_warps=tiles.step_warps,
        )
        return y
    Q = tiles.chunk if T > tiles.chunk // 2 else max(16, triton.next_power_of_2(T))
    n_chunks = triton.cdiv(T, Q)
    steps = torch.empty(Bsz, T, H, device=x.device, dtype=torch.float32)  # the step sizes, after softplus
    cum = torch.empty(Bsz, n_chunks, Q, H, device=x.device, dtype=torch.float32)
    _ssd_step_sizes_kernel[(Bsz * n_chunks, triton.cdiv(H, tiles.sizes_bh))](
        dt, dt.stride(0), dt.stride(1), dt_bias, A, start if start is not None else dt_bias, steps, cum, T, n_chunks,
        float(dt_limit[0]), float(dt_limit[1]), H=H, Q=Q, BH=tiles.sizes_bh, START=start is not None, num_warps=4,
    )
    dt = steps
    states = torch.empty(Bsz, n_chunks, H, P, N, device=x.device, dtype=torch.float32)
    # the states the chunks start from, in the dtype the chunk scan's product rounds them to
    starts = torch.empty(Bsz, n_chunks, H, P, N, device=x.device, dtype=Cm.dtype)
    y = torch.empty(Bsz, T, H, P, device=x.device, dtype=torch.float32)
    f32 = x.dtype == torch.float32
    # each step's latest reset (B, T) int32 (unread without resets: any tensor stands in)
    first = segment_starts(resets, 0).to(torch.int32).contiguous() if resets is not None else cum
    BP, NP = max(16, triton.next_power_of_2(P)), max(16, triton.next_power_of_2(N))
    BS = min(tiles.bs, Q)
    common = dict(H=H, P=P, N=N, Q=Q, NP=NP, F32=f32, RESETS=resets is not None)
    _ssd_chunk_state_kernel[(Bsz * n_chunks, H, triton.cdiv(P, min(BP, tiles.state_bp)))](
        x, x.stride(0), x.stride(1), Bm, Bm.stride(0), Bm.stride(1), dt, cum, first, states, T, n_chunks, H // G,
        BS=BS, BP=min(BP, tiles.state_bp), **common, num_warps=4,
    )
    _ssd_state_passing_kernel[(triton.cdiv(P * N, tiles.pass_bl), H, Bsz)](
        states, starts, state, cum, first, T, n_chunks, H=H, PN=P * N, Q=Q, BL=tiles.pass_bl,
        CB=min(tiles.pass_cb, triton.next_power_of_2(n_chunks)), RESETS=resets is not None, num_warps=tiles.pass_warps,
    )
    BT = min(tiles.bt, Q)
    cb = states  # (unread unless tiles.cb_once)
    if tiles.cb_once:
        cb = torch.empty(Bsz, n_chunks, G, Q, Q, device=x.device, dtype=torch.float32)
        _ssd_chunk_cb_kernel[(Bsz * n_chunks, G, Q // BT)](
            Bm, Cm, Bm.stride(0), Bm.stride(1), cb, T, n_chunks, G=G, N=N, Q=Q, BT=BT, BS=BS, NP=NP, F32=f32,
            num_warps=4,
        )
    _ssd_chunk_scan_kernel[(Bsz * n_chunks, H, Q // BT)](
        x, x.stride(0), x.stride(1), Bm, Cm, Bm.stride(0), Bm.stride(1), dt, cum, first, starts, D, y, cb, T,
        n_chunks, H // G, BT=BT, BS=BS, BP=BP, **common, CB_ONCE=tiles.cb_once, G=G, num_warps=tiles.scan_warps,
        num_stages=tiles.scan_stages,
    )
    return y
