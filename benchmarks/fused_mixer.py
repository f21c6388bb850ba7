"""Experiment (dropped; kept in the history only): in_proj, the conv step, x_proj and the
state update as ONE kernel a layer at batch 1, so that the layer's chain of small kernels
runs while in_proj still streams its z rows.

Each program computes its BN channels' x rows of in_proj, their conv step and x_proj share
(fixed-point atomic adds into dbc, optionally padded to a cache line each or summed first
by groups of GROUP programs), bumps a counter (release), then computes the same channels'
z rows; by then every program's x_proj share is likely in, so after a spin on the counter
(acquire) it runs the state update for its channels and writes y. Programs wait for each
other, so all of them must be resident at once: `capacity` checks the compiled kernel's
registers against the GPU before the first launch. out_proj then folds the previous
layer's share of the residual into h (dh double buffered, since no later kernel of the
layer can) and adds its own. Under TRITON_INTERPRET=1 the kernel runs as two launches
(PHASES 1 and 2), since the interpreter runs programs one after another.

Result (benchmarks/RESULTS.md, twenty-sixth session): logits within 2e-6 of DecodeStep's,
but 2.8b bf16 batch 1 took 2.00-2.94 ms a step against 1.70: two phases a program halve
the bytes in flight (320 programs fit, 640 do not), the x_proj atomics, the spin and the
state update's loads at the programs' ends each cost about as much as the kernel
boundaries they replace.

    python benchmarks/fused_mixer.py 2.8b,1.4b
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastmamba.kernels._triton import jit, tl, triton, INTERPRET  # noqa: E402
from fastmamba.kernels.activations import silu, softplus  # noqa: E402
from fastmamba.kernels import decode_step as ds  # noqa: E402
from fastmamba.kernels.decode_step import (  # noqa: E402
    _add_fixed, _conv_inputs, _conv_step, _embed_kernel, _from_fixed, _mm, _mm_terms, _mm_total,
    _prefetch_to_l2, _residual_tile, _x_proj_columns,
)
from fastmamba.kernels.pdl import let_next_kernel_launch, wait_for_prior_kernel  # noqa: E402


@jit
def _mixer_kernel(
    h_ptr, dh_ptr, nw_ptr, w_ptr, b_ptr, cs_ptr, cw_ptr, cb_ptr, wx_ptr, dtw_ptr, dtb_ptr, A_ptr, D_ptr, ss_ptr,
    xz_ptr, xc_ptr, dbc_ptr, cnt_ptr, y_ptr, part_ptr, gcnt_ptr,
    B, D, E, J, R, eps, TOTAL,
    HAS_BIAS: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_CB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    BJ: tl.constexpr, BR: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, PAD: tl.constexpr,
    SUM_LAST: tl.constexpr, UNROLL: tl.constexpr, PHASES: tl.constexpr, PDL: tl.constexpr, LATE: tl.constexpr = True, GROUP: tl.constexpr = 0, ABLATE: tl.constexpr = 0,
):
    let_next_kernel_launch(PDL)
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_b + tl.arange(0, 1)
    rmask = rows < B
    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < E
    m = rmask[:, None] & nmask[None, :]
    k = tl.arange(0, BK)
    # before the wait: what no earlier kernel writes
    w = tl.load(w_ptr + n[:, None] * D + k[None, :], mask=nmask[:, None] & (k < D)[None, :], other=0.0)
    r = tl.arange(0, BR)
    nn = tl.arange(0, NP)
    nm = nn < N
    sp = ss_ptr + rows[:, None, None] * (E * N) + n[None, :, None] * N + nn[None, None, :]
    sm = m[:, :, None] & nm[None, None, :]
    j = tl.minimum(tl.arange(0, BJ), J - 1)
    _prefetch_to_l2(wx_ptr + j[:, None] * E + pid_n * BN + tl.arange(0, 2)[None, :] * (BN - 1))
    if LATE:  # the rest into L2 now, into registers where it is used
        q = tl.arange(0, 4)
        _prefetch_to_l2(cs_ptr + pid_b * (E * K) + n[:, None] * K + q[None, :] * 0)
        _prefetch_to_l2(dtw_ptr + n[:, None] * R + tl.minimum(q * 64, R - 1)[None, :])
        _prefetch_to_l2(ss_ptr + pid_b * (E * N) + n[:, None] * N + q[None, :] * 0)
        _prefetch_to_l2(A_ptr + n[:, None] * N + q[None, :] * 0)
    else:
        cw, cw_new, cb, window = _conv_inputs(rows, rmask, n, cs_ptr, cw_ptr, cb_ptr, E, K, KP, HAS_CB, BN)
        dtw = tl.load(dtw_ptr + n[:, None] * R + r[None, :], mask=nmask[:, None] & (r < R)[None, :], other=0.0)
        A = tl.load(A_ptr + n[:, None] * N + nn[None, :], mask=nmask[:, None] & nm[None, :], other=0.0)
        dtb = tl.load(dtb_ptr + n, mask=nmask, other=0.0)
        Dv = tl.load(D_ptr + n, mask=nmask, other=0.0)
        s = tl.load(sp, mask=sm, other=0.0)
    wait_for_prior_kernel(PDL)
    if PHASES != 2:
        # x rows
        hk = _residual_tile(h_ptr, dh_ptr, rows[:, None] * D + k[None, :], rmask[:, None] & (k < D)[None, :])
        nw = tl.load(nw_ptr + k, mask=k < D, other=0.0)
        sq = hk * hk
        acc = _mm_terms(hk * nw[None, :], w, SUM_LAST)
        for k0 in tl.range(BK, D, BK, loop_unroll_factor=UNROLL):
            kk = k0 + tl.arange(0, BK)
            km = kk < D
            hk = _residual_tile(h_ptr, dh_ptr, rows[:, None] * D + kk[None, :], rmask[:, None] & km[None, :])
            nw = tl.load(nw_ptr + kk, mask=km, other=0.0)
            wk = tl.load(w_ptr + n[:, None] * D + kk[None, :], mask=nmask[:, None] & km[None, :], other=0.0)
            sq += hk * hk
            acc += _mm_terms(hk * nw[None, :], wk, SUM_LAST)
        rstd = 1.0 / tl.sqrt(tl.sum(sq, 1) / D + eps)
        x = _mm_total(acc, SUM_LAST) * rstd[:, None]
        if HAS_BIAS:
            x += tl.load(b_ptr + n, mask=nmask, other=0.0)[None, :]
        nz = E + n
        w = tl.load(w_ptr + nz[:, None] * D + k[None, :], mask=nmask[:, None] & (k < D)[None, :], other=0.0)
        if LATE and ABLATE < 3:
            cw, cw_new, cb, window = _conv_inputs(rows, rmask, n, cs_ptr, cw_ptr, cb_ptr, E, K, KP, HAS_CB, BN)
        if ABLATE == 3:
            xc = x
            tl.store(xc_ptr + rows[:, None] * E + n[None, :], x, mask=m)
        else:
            xc = _conv_step(x, cw, cw_new, cb, window, rows, rmask, n, cs_ptr, xc_ptr, E, K, KP)
        jj = tl.arange(0, BJ)
        if ABLATE < 3:
            wx = _x_proj_columns(wx_ptr, n, E, J, BJ)
            share = _mm(xc, wx)
            jm = rmask[:, None] & (jj < J)[None, :]
            if GROUP == 0:
                if ABLATE == 0:
                    _add_fixed(dbc_ptr + rows[:, None] * (BJ * PAD) + jj[None, :] * PAD, share, jm)
                if PHASES == 0:
                    tl.debug_barrier()
                    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
            else:
                # this program's share apart; the group's last to arrive adds the group's up
                T = tl.num_programs(1)
                tl.store(part_ptr + (pid_b * T + pid_n) * BJ + jj[None, :], share, mask=jm)
                if PHASES == 0:
                    g = pid_b * (T // GROUP) + pid_n // GROUP
                    tl.debug_barrier()
                    prev = tl.atomic_add(gcnt_ptr + g, 1, sem="acq_rel", scope="gpu")
                    if prev == GROUP - 1:
                        first = pid_b * T + (pid_n // GROUP) * GROUP
                        tot = tl.zeros([1, BJ], dtype=tl.float32)
                        for p in range(GROUP):
                            tot += tl.load(part_ptr + (first + p) * BJ + jj[None, :], mask=jm, other=0.0, cache_modifier=".cg")
                        _add_fixed(dbc_ptr + rows[:, None] * (BJ * PAD) + jj[None, :] * PAD, tot, jm)
                        tl.debug_barrier()
                        tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
        # z rows
        hk = _residual_tile(h_ptr, dh_ptr, rows[:, None] * D + k[None, :], rmask[:, None] & (k < D)[None, :])
        nw = tl.load(nw_ptr + k, mask=k < D, other=0.0)
        acc = _mm_terms(hk * nw[None, :], w, SUM_LAST)
        for k0 in tl.range(BK, D, BK, loop_unroll_factor=UNROLL):
            kk = k0 + tl.arange(0, BK)
            km = kk < D
            hk = _residual_tile(h_ptr, dh_ptr, rows[:, None] * D + kk[None, :], rmask[:, None] & km[None, :])
            nw = tl.load(nw_ptr + kk, mask=km, other=0.0)
            wk = tl.load(w_ptr + nz[:, None] * D + kk[None, :], mask=nmask[:, None] & km[None, :], other=0.0)
            acc += _mm_terms(hk * nw[None, :], wk, SUM_LAST)
        z = _mm_total(acc, SUM_LAST) * rstd[:, None]
        if HAS_BIAS:
            z += tl.load(b_ptr + nz, mask=nmask, other=0.0)[None, :]
        if PHASES == 1:
            tl.store(xz_ptr + rows[:, None] * (2 * E) + E + n[None, :], z, mask=m)
    if PHASES == 2:
        z = tl.load(xz_ptr + rows[:, None] * (2 * E) + E + n[None, :], mask=m, other=0.0)
        xc = tl.load(xc_ptr + rows[:, None] * E + n[None, :], mask=m, other=0.0)
    if ABLATE == 3:
        tl.store(y_ptr + rows[:, None] * E + n[None, :], z * xc, mask=m)
    if PHASES != 1 and ABLATE < 3:
        if LATE:
            dtw = tl.load(dtw_ptr + n[:, None] * R + r[None, :], mask=nmask[:, None] & (r < R)[None, :], other=0.0)
            A = tl.load(A_ptr + n[:, None] * N + nn[None, :], mask=nmask[:, None] & nm[None, :], other=0.0)
            dtb = tl.load(dtb_ptr + n, mask=nmask, other=0.0)
            Dv = tl.load(D_ptr + n, mask=nmask, other=0.0)
            s = tl.load(sp, mask=sm, other=0.0)
        if PHASES == 0 and ABLATE < 2:
            c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
            polls = 0
            while (c < TOTAL) & (polls < 1 << 20):  # bounded: a wrong result, never a hung GPU
                c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
                polls += 1
        row_dbc = dbc_ptr + rows[:, None] * (BJ * PAD)
        dtr = _from_fixed(tl.load(row_dbc + r[None, :] * PAD, mask=rmask[:, None] & (r < R)[None, :], other=0, cache_modifier=".cg"))
        Bv = _from_fixed(tl.load(row_dbc + (R + nn[None, :]) * PAD, mask=rmask[:, None] & nm[None, :], other=0, cache_modifier=".cg"))
        Cv = _from_fixed(tl.load(row_dbc + (R + N + nn[None, :]) * PAD, mask=rmask[:, None] & nm[None, :], other=0, cache_modifier=".cg"))
        dt = softplus(_mm(dtr, dtw) + dtb[None, :])
        s = s * tl.exp(dt[:, :, None] * A[None, :, :]) + (dt * xc)[:, :, None] * Bv[:, None, :]
        tl.store(sp, s, mask=sm)
        y = tl.sum(s * Cv[:, None, :], 2) + Dv[None, :] * xc
        y = y * silu(z)
        tl.store(y_ptr + rows[:, None] * E + n[None, :], y, mask=m)


@jit
def _out_proj_fold_kernel(
    y_ptr, w_ptr, b_ptr, h_ptr, dh_ptr, dhp_ptr, dbc_ptr, cnt_ptr, gcnt_ptr, NG, B, D, E, KCHUNK,
    NGP: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BJ: tl.constexpr, PAD: tl.constexpr, PDL: tl.constexpr,
):
    let_next_kernel_launch(PDL)
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_b + tl.arange(0, 1)
    rmask = rows < B
    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < D
    k_end = tl.minimum((pid_s + 1) * KCHUNK, E)
    k = pid_s * KCHUNK + tl.arange(0, BK)
    w = tl.load(w_ptr + n[:, None] * E + k[None, :], mask=nmask[:, None] & (k < k_end)[None, :], other=0.0)
    wait_for_prior_kernel(PDL)
    jj = tl.arange(0, BJ)
    first = jj[None, :] >= (pid_n + pid_s) * BJ
    tl.store(dbc_ptr + rows[:, None] * (BJ * PAD) + jj[None, :] * PAD, tl.zeros([1, BJ], dtype=tl.int64), mask=rmask[:, None] & first)
    if pid_b + pid_n + pid_s == 0:
        tl.store(cnt_ptr, 0)
        gg = tl.arange(0, NGP)
        tl.store(gcnt_ptr + gg, tl.zeros([NGP], dtype=tl.int32), mask=gg < NG)
    if pid_s == 0:  # the previous layer's share, read by the mixer that just finished, into h
        offs = rows[:, None] * D + n[None, :]
        hm = rmask[:, None] & nmask[None, :]
        tl.store(h_ptr + offs, _residual_tile(h_ptr, dhp_ptr, offs, hm), mask=hm)
        tl.store(dhp_ptr + offs, tl.zeros([1, BN], dtype=tl.int64), mask=hm)
    acc = tl.zeros([1, BN], dtype=tl.float32)
    for k0 in range(pid_s * KCHUNK, k_end, BK):
        k = k0 + tl.arange(0, BK)
        yk = tl.load(y_ptr + rows[:, None] * E + k[None, :], mask=rmask[:, None] & (k < k_end)[None, :], other=0.0)
        w_now = w
        k = k + BK
        w = tl.load(w_ptr + n[:, None] * E + k[None, :], mask=nmask[:, None] & (k < k_end)[None, :], other=0.0)
        acc += _mm(yk, w_now)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask & (n >= pid_s * D), other=0.0)[None, :]
    _add_fixed(dh_ptr + rows[:, None] * D + n[None, :], acc, rmask[:, None] & nmask[None, :])


def capacity(kernel, sms: int) -> int:
    """How many programs of a compiled kernel the GPU holds at once (registers and warps)."""
    warps = kernel.metadata.num_warps
    per_warp = -(-kernel.n_regs * 32 // 256) * 256
    return sms * min(65536 // (per_warp * warps), 64 // warps, 32)


class MixerStep(ds.DecodeStep):
    def __init__(self, model, batch, BN=16, BK=256, unroll=2, warps=4, pad=1, early=True, late=True, **extra):
        super().__init__(model, batch)
        c = model.config
        dev = model.weights.embedding.device
        self.BN_mix, self.BK_mix, self.unroll_mix, self.warps_mix, self.pad, self.early = BN, BK, unroll, warps, pad, early
        self.dh2 = torch.zeros(2, batch, c.d_model, device=dev, dtype=torch.int64)
        self.dbcp = torch.zeros(batch, self.BJ * pad, device=dev, dtype=torch.int64)
        self.cnt = torch.zeros(c.n_layer, device=dev, dtype=torch.int32)
        self.checked = False
        self.late, self.extra = late, extra
        T = triton.cdiv(c.d_inner, BN)
        self.part = torch.zeros(batch * T, self.BJ, device=dev)
        self.gcnt = torch.zeros(c.n_layer, max(1, batch * T // max(1, extra.get("GROUP", 0) or 1)), device=dev, dtype=torch.int32)

    def mixer(self, i, lw, conv_state, ssm_state, phases):
        c = self.model.config
        T = triton.cdiv(c.d_inner, self.BN_mix)
        pdl = dict(self.pdl, PDL=2) if (self.pdl["PDL"] and self.early) else self.pdl
        if phases:
            pdl = dict(PDL=0)
        cb = lw.conv_b if lw.conv_b is not None else lw.conv_w
        args = (
            self.h, self.dh2[(i - 1) % 2], lw.norm_w, lw.in_proj_w, lw.in_proj_b if lw.in_proj_b is not None else lw.in_proj_w,
            conv_state, lw.conv_w, cb, lw.x_proj_w, lw.dt_proj_w, lw.dt_bias, lw.A, lw.D, ssm_state,
            self.xz, self.xc, self.dbcp, self.cnt[i:], self.y, self.part, self.gcnt[i],
            self.B, c.d_model, c.d_inner, self.J, c.dt_rank, c.norm_eps, self.B * T // (self.extra.get('GROUP', 0) or 1),
        )
        kw = dict(
            HAS_BIAS=lw.in_proj_b is not None, K=c.d_conv, KP=triton.next_power_of_2(c.d_conv), HAS_CB=lw.conv_b is not None,
            BN=self.BN_mix, BK=self.BK_mix, BJ=self.BJ, BR=self.BR, N=c.d_state, NP=self.NP, PAD=self.pad,
            SUM_LAST=self.sum_last and c.d_model > self.BK_mix, UNROLL=self.unroll_mix, PHASES=phases, LATE=self.late,
            num_warps=self.warps_mix, **pdl, **self.extra,
        )
        if not self.checked and not phases:  # every program must fit on the GPU at once (they wait for each other)
            k = _mixer_kernel.warmup(*args, grid=(self.B, T), **kw)
            k._init_handles()  # loads the module: n_regs is known from then on
            sms = torch.cuda.get_device_properties(self.h.device).multi_processor_count
            cap = capacity(k, sms)
            print(f"mixer: {self.B * T} programs, {k.n_regs} registers, {k.n_spills} spills, room for {cap}", flush=True)
            if self.B * T > cap:
                raise RuntimeError("does not fit")
            self.checked = True
        _mixer_kernel[(self.B, T)](*args, **kw)

    def out_proj_fold(self, i, lw):
        c = self.model.config
        _out_proj_fold_kernel[(self.B, self.nt_d, self.nsplit_out)](
            self.y, lw.out_proj_w, lw.out_proj_b if lw.out_proj_b is not None else lw.out_proj_w,
            self.h, self.dh2[i % 2], self.dh2[(i - 1) % 2], self.dbcp, self.cnt[i:], self.gcnt[i], self.gcnt.shape[1],
            self.B, c.d_model, c.d_inner, self.kchunk_out,
            NGP=triton.next_power_of_2(self.gcnt.shape[1]), HAS_BIAS=lw.out_proj_b is not None, BN=self.BN_out, BK=self.BK_out, BJ=self.BJ, PAD=self.pad,
            num_warps=self.warps_out, **self.pdl_for("out_proj_residual"),
        )

    def __call__(self, tokens, state, argmax=False):
        w = self.model.weights
        L = len(w.layers)
        emb = w.embedding
        _embed_kernel[(self.B, self.nt_d)](tokens, emb, self.h, self.dh2[(L - 1) % 2], self.B, emb.shape[1], BN=self.BN_out, **self.pdl)
        for i, lw in enumerate(w.layers):
            if INTERPRET:
                self.mixer(i, lw, state.conv[i], state.ssm[i], 1)
                self.mixer(i, lw, state.conv[i], state.ssm[i], 2)
            else:
                self.mixer(i, lw, state.conv[i], state.ssm[i], 0)
            self.out_proj_fold(i, lw)
        self.dh = self.dh2[(L - 1) % 2]
        self.lm_head(argmax)
        return self.logits[: self.B]


def graph_ms(step, state, tok, reps=200):
    """A function timing `reps` replays of one graph-captured step (ms a step)."""
    from fastmamba.engine import capture_graph

    g, _ = capture_graph(lambda: step(tok, state))
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run():
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / reps

    run.keep = (step, state)  # the graph writes into their buffers: they must outlive it
    return run


def e(x, y):
    return ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()


def main(sizes):
    from fastmamba.bench import random_model

    b = dict(BN=16, BK=256, unroll=2, pad=16)
    configs = {
        "2.8b": [b, dict(b, GROUP=16), dict(b, GROUP=8), dict(b, GROUP=32), dict(b, ABLATE=1), dict(b, ABLATE=2), dict(b, ABLATE=3),
                 dict(BN=8, BK=256, unroll=2, pad=16, GROUP=16)],
        "1.4b": [b, dict(b, GROUP=16), dict(b, ABLATE=2), dict(b, ABLATE=3), dict(BN=8, BK=256, unroll=2, pad=16, GROUP=16)],
    }
    for size in sizes:
        model = random_model(size, torch.bfloat16)
        B = 1
        tok = torch.randint(0, 50280, (B,), device="cuda")
        base = model.new_state(B)
        base.ssm.normal_()
        base.conv.normal_()
        # correctness: 3 eager steps from the same state
        ref_step = ds.DecodeStep(model, B)
        runs = {}
        st0 = model.new_state(B)
        st0.ssm.copy_(base.ssm)
        st0.conv.copy_(base.conv)
        refl = [ref_step(tok, st0).clone() for _ in range(3)]
        runs["plain"] = graph_ms(ref_step, model.new_state(B), tok)
        for cfg in configs[size]:
            name = ",".join(f"{k}={v}" for k, v in cfg.items())
            try:
                step = MixerStep(model, B, **cfg)
                st = model.new_state(B)
                st.ssm.copy_(base.ssm)
                st.conv.copy_(base.conv)
                t0 = time.time()
                out = [step(tok, st).clone() for _ in range(3)]
                torch.cuda.synchronize()
                print(f"{size} {name}: eager 3 steps {time.time()-t0:.1f}s, logits err " + " ".join(f"{e(o, r):.1e}" for o, r in zip(out, refl))
                      + f" ssm {e(st.ssm, st0.ssm):.1e} conv {e(st.conv, st0.conv):.1e}", flush=True)
                runs[name] = graph_ms(step, model.new_state(B), tok)
            except Exception as ex:
                print(f"{size} {name}: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
        names = list(runs)
        res = {k: [] for k in names}
        for order in (names, names[::-1], names, names[::-1]):
            for k in order:
                res[k].append(runs[k]())
        for k, v in res.items():
            print(f"{size} {k:45s} {statistics.mean(v):.4f} ms  ({' '.join(f'{x:.4f}' for x in v)})", flush=True)
        del model, runs, res
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["2.8b"])
