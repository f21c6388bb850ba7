"""Experiment (dropped; kept in the history only): at batch 128, in_proj as two cuBLAS
products, its x rows and its z rows, with the z rows on a second stream of the graph, so
that they run beside the chain of small kernels that needs only x (conv step, x_proj,
dbc_rows, dt_proj); ssm_update joins the two. Modes: 0 the step as it is
(decode_gemm.GemmDecodeStep); 3 the two products one after the other on one stream (what
splitting in_proj costs by itself); 1 the z product on the second stream after the x
product; 2 the z product on the second stream from the start, beside the x product.

Result (benchmarks/RESULTS.md, twenty-sixth session), 2.8b bf16, ms a step: 5.876 as is,
6.158 split on one stream, 6.167 (mode 1), 6.109 (mode 2): the split costs 0.28 ms and the
second stream wins back at most 0.05 of it.

    python benchmarks/b128_two_streams.py 2.8b
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from fastmamba.kernels._triton import jit, tl, triton  # noqa: E402
from fastmamba.kernels.activations import silu, softplus  # noqa: E402
from fastmamba.kernels.pdl import wait_for_prior_kernel  # noqa: E402
from fastmamba.kernels.split16 import load_sum, store_split  # noqa: E402
from fastmamba.kernels import decode_gemm as dg  # noqa: E402
from fastmamba.kernels.rmsnorm import residual_rmsnorm  # noqa: E402


@jit
def _conv_step2(x_ptr, XS, cs_ptr, cw_ptr, cb_ptr, xc_ptr, xc16_ptr, B, E,
    K: tl.constexpr, KP: tl.constexpr, HAS_CB: tl.constexpr, XZ_PARTS: tl.constexpr, SPLIT: tl.constexpr, BE: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior_kernel(PDL)
    row = tl.program_id(1).to(tl.int64)
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    em = e < E
    kk = tl.arange(0, KP)
    win = cs_ptr + row * E * K + e[:, None] * K + kk[None, :]
    old = tl.load(win + 1, mask=em[:, None] & (kk < K - 1)[None, :], other=0.0)
    x = load_sum(x_ptr, row * XS + e, B * XS, em, XZ_PARTS)
    new = tl.where((kk == K - 1)[None, :], x[:, None], old)
    w = tl.load(cw_ptr + e[:, None] * K + kk[None, :], mask=em[:, None] & (kk < K)[None, :], other=0.0)
    conv = tl.sum(new * w, 1)
    if HAS_CB:
        conv += tl.load(cb_ptr + e, mask=em, other=0.0)
    tl.debug_barrier()
    tl.store(win, new, mask=em[:, None] & (kk < K)[None, :])
    xc = silu(conv)
    tl.store(xc_ptr + row * E + e, xc, mask=em)
    store_split(xc16_ptr, row * E + e, xc, B * E, em, SPLIT)


@jit
def _ssm_update2(dt_ptr, dbc_ptr, xc_ptr, z_ptr, ZS, ss_ptr, dtb_ptr, A_ptr, D_ptr, y_ptr, B, E, R, J,
    N: tl.constexpr, NP: tl.constexpr, DT_PARTS: tl.constexpr, XZ_PARTS: tl.constexpr, Y_HALVES: tl.constexpr, BE: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(1).to(tl.int64)
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    em = e < E
    n = tl.arange(0, NP)
    nm = n < N
    A = tl.load(A_ptr + e[:, None] * N + n[None, :], mask=em[:, None] & nm[None, :], other=0.0)
    sp = ss_ptr + row * E * N + e[:, None] * N + n[None, :]
    sm = em[:, None] & nm[None, :]
    s = tl.load(sp, mask=sm, other=0.0)
    wait_for_prior_kernel(PDL)
    dt = load_sum(dt_ptr, row * E + e, B * E, em, DT_PARTS) + tl.load(dtb_ptr + e, mask=em, other=0.0)
    dt = softplus(dt)
    Bv = tl.load(dbc_ptr + row * J + R + n, mask=nm, other=0.0)
    Cv = tl.load(dbc_ptr + row * J + R + N + n, mask=nm, other=0.0)
    x = tl.load(xc_ptr + row * E + e, mask=em, other=0.0)
    z = load_sum(z_ptr, row * ZS + e, B * ZS, em, XZ_PARTS)
    s = s * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * Bv[None, :]
    tl.debug_barrier()
    tl.store(sp, s, mask=sm)
    y = tl.sum(s * Cv[None, :], 1) + tl.load(D_ptr + e, mask=em, other=0.0) * x
    y = y * silu(z)
    store_split(y_ptr, row * E + e, y, B * E, em, Y_HALVES)


class TwoStream(dg.GemmDecodeStep):
    def __init__(self, model, batch, mode):
        super().__init__(model, batch, triton_products=True, cublas_in_proj=True)
        c = model.config
        E = c.d_inner
        P = self.xz.shape[0]
        self.mode = mode
        if mode:
            self.xbuf = torch.zeros(P, E, device="cuda")
            self.zbuf = torch.zeros(P, E, device="cuda")
            self.side = torch.cuda.Stream()
            self.wx = [lw.in_proj_w[:E] for lw in model.weights.layers]
            self.wz = [lw.in_proj_w[E:] for lw in model.weights.layers]

    def __call__(self, tokens, state):
        if not self.mode:
            return super().__call__(tokens, state)
        c, w = self.model.config, self.model.weights
        R, eps, B, split, parts, pdl = c.dt_rank, c.norm_eps, self.B, self.split, self.parts, self.pdl
        E = c.d_inner
        torch.index_select(w.embedding, 0, tokens, out=self.u[:B])
        self.h.copy_(self.u[:B])
        main = torch.cuda.current_stream()
        for i, lw in enumerate(w.layers):
            residual_rmsnorm(self.h, self.o if i else None, None, lw.norm_w, eps, self.u, o_parts=parts["out_proj"], u_halves=split, pdl=pdl)
            if self.mode == 2:  # z beside x and the chain
                self.side.wait_stream(main)
                with torch.cuda.stream(self.side):
                    dg.gemm(self.u, self.wz[i], self.zbuf)
            dg.gemm(self.u, self.wx[i], self.xbuf)
            if self.mode == 1:  # z after x, beside the chain
                self.side.wait_stream(main)
                with torch.cuda.stream(self.side):
                    dg.gemm(self.u, self.wz[i], self.zbuf)
            if self.mode == 3:  # both on one stream (the split's own cost)
                dg.gemm(self.u, self.wz[i], self.zbuf)
            BE, warps = dg.CONV_STEP_BLOCK
            _conv_step2[(triton.cdiv(E, BE), B)](self.xbuf, E, state.conv[i], lw.conv_w, lw.conv_b if lw.conv_b is not None else lw.conv_w,
                self.xc, self.xc16, B, E, K=c.d_conv, KP=triton.next_power_of_2(c.d_conv), HAS_CB=lw.conv_b is not None,
                XZ_PARTS=2, SPLIT=split, BE=BE, num_warps=warps, **pdl)
            self.product("x_proj", self.xc16, lw.x_proj_w, self.dbc_raw)
            dg.dbc_rows(self.dbc_raw, self.dbc, self.dtr16, split, parts["x_proj"], pdl)
            self.product("dt_proj", self.dtr16, lw.dt_proj_w, self.dt)
            if self.mode in (1, 2):
                main.wait_stream(self.side)
            BE, warps = dg.SSM_UPDATE_BLOCK
            _ssm_update2[(triton.cdiv(E, BE), B)](self.dt, self.dbc, self.xc, self.zbuf, E, state.ssm[i], lw.dt_bias, lw.A, lw.D, self.y16,
                B, E, R, self.dbc.shape[1], N=c.d_state, NP=triton.next_power_of_2(c.d_state), DT_PARTS=parts["dt_proj"], XZ_PARTS=2,
                Y_HALVES=self.split_out, BE=BE, num_warps=warps, **pdl)
            self.product("out_proj", self.y16, lw.out_proj_w, self.o)
        residual_rmsnorm(self.h, self.o, None, w.norm_f, eps, self.u, o_parts=parts["out_proj"], u_halves=split, pdl=pdl)
        self.product("lm_head", self.u, w.lm_head, self.logits_raw)
        torch.add(self.logits_raw[:B], self.logits_raw[B:], out=self.logits)
        return self.logits


def graph_ms(step, state, tok, reps=200):
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


if __name__ == "__main__":
    from fastmamba.bench import random_model
    for size in sys.argv[1].split(","):
        model = random_model(size, torch.bfloat16)
        B = 128
        tok = torch.randint(0, 50280, (B,), device="cuda")
        base = model.new_state(B)
        base.ssm.normal_()
        base.conv.normal_()
        runs, ref = {}, None
        for mode in (0, 3, 1, 2):
            try:
                step = TwoStream(model, B, mode)
                st = model.new_state(B)
                st.ssm.copy_(base.ssm)
                st.conv.copy_(base.conv)
                out = [step(tok, st).clone() for _ in range(2)]
                if ref is None:
                    ref = out
                print(size, mode, "err", " ".join(f"{e(o, r):.1e}" for o, r in zip(out, ref)), flush=True)
                runs[mode] = graph_ms(step, model.new_state(B), tok, reps=50)
            except Exception as ex:
                print(size, mode, type(ex).__name__, str(ex)[:300], flush=True)
        names = list(runs)
        res = {k: [] for k in names}
        for order in (names, names[::-1], names, names[::-1]):
            for k in order:
                res[k].append(runs[k]())
        for k, v in res.items():
            print(f"{size} b128 mode {k}: {statistics.mean(v):.4f} ms ({' '.join(f'{x:.4f}' for x in v)})", flush=True)
        del model, runs, res
        torch.cuda.empty_cache()
