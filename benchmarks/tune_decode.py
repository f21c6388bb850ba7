"""Sweeps block sizes of the one-row (batch <= 8) decode kernels at the public shapes.

Times each kernel alone (triton.testing.do_bench, median) for a grid of configurations and
prints the best few per shape with the achieved weight bandwidth, to choose the one-row
step's settings (plan.one_row_blocks).  python -m benchmarks.tune_decode

With --fp8 (or --f32) the weights are FP8 (float32). With --in-graph it times whole graph-replayed batch-1 steps instead, changing the block
sizes of one kernel at a time (each variant a DecodePlan passed to the step): alone, a kernel sees its weights partly in L2 and no
neighbours, so its best blocks need not be the step's (--states: where the conv step and
x_proj run, and ssm_step's blocks; --out-proj, --in-proj: only those; --wide: 1.4b and
2.8b only; --only-2.8b). With --lm-head it sweeps lm_head's blocks (and 130m's in_proj) in whole
steps; with --early, which kernels let the next one launch before their own wait; with
--sum-last, where one-row in_proj sums over K (--f32: float32 weights); with --preload,
out_proj blocks of one tile a K split and in_proj's loop in shared-memory stages; with
--ablate, the step without one kind of kernel at a time (timing only); with
--lm-head-sum-last, lm_head summing after its loop in 256-wide K tiles against every tile;
with --mma, in_proj's and out_proj's products on the tensor cores (2.8b and Mamba-2 2.7b, FP8
then bf16).
"""

import itertools
import sys
from dataclasses import replace

import torch
import triton
from triton.testing import do_bench

from fastmamba.engine.plan import DecodePlan, one_row_blocks
from fastmamba.kernels import decode_step as ds

# the weights' dtype: bf16, or float32 (--f32), or FP8 (--fp8: e4m3 with a scale a row, a
# byte a weight, so a tile of K streams half the bytes of bf16's)
DT = torch.float32 if "--f32" in sys.argv else torch.float8_e4m3fn if "--fp8" in sys.argv else torch.bfloat16


def defaults(model, dtype=None):
    c = model.config
    return one_row_blocks(c.d_model, c.d_inner, c.vocab_size, dtype or DT, c.layer)


def step_ms(model, dtype=None, **changes) -> float:
    """A whole graph-replayed batch-1 step with the one-row step's settings changed."""
    from fastmamba.bench import time_graph_steps

    return time_graph_steps(model, 1, plan=DecodePlan("one-row", blocks=replace(defaults(model, dtype), **changes)))


def report(name, results, nbytes):
    results.sort()
    print(f"{name}: {nbytes / 1e6:.1f} MB of weights")
    for us, cfg in results[:4]:
        print(f"   {us:7.2f} us  {nbytes / us / 1e6:6.2f} TB/s  {cfg}")


def tune_rmsnorm_linear(n_out, d):
    w = torch.randn(n_out, d, device="cuda").to(DT)
    nw = torch.ones(d, device="cuda")
    h = torch.randn(1, d, device="cuda")
    dh = torch.zeros(1, d, device="cuda", dtype=torch.int64)
    out = torch.empty(1, n_out, device="cuda")
    scale = torch.ones(n_out, device="cuda")  # (FP8 weights' rows' scales)
    res = []
    for BN, BK, warps in itertools.product([4, 8, 16, 32], [256, 512, 1024], [2, 4, 8]):
        if BN * BK > 16384:
            continue

        def run():
            # (h, dh, the norm, the weight, its scales, bias; out; the conv's seven and best,
            # unused; the second matrix's four, unused)
            ds._rmsnorm_linear_kernel[(1, triton.cdiv(n_out, BN))](
                h, dh, nw, w, scale, scale, out, *(out,) * 8, w, scale, scale, out, 1, d, n_out, n_out, 0, 0, 0, 1e-5,
                W_SCALED=DT == torch.float8_e4m3fn, WX_SCALED=False, HAS_BIAS=False, CONV=False, ARGMAX=False, K=4,
                KP=4, HAS_CB=False, BN=BN, BK=BK, BJ=16, STAGES=1,
                SUM_LAST=DT != torch.float32 and n_out == 4 * d and d > BK, UNROLL=1, PDL=0, MMA=False, TWO=False,
                num_warps=warps,
            )

        res.append((do_bench(run, warmup=5, rep=30) * 1e3, dict(BN=BN, BK=BK, warps=warps)))
    report(f"rmsnorm_linear {n_out}x{d}", res, w.numel() * 2)


def tune_out_proj(d, E):
    w = torch.randn(d, E, device="cuda").to(DT)
    y = torch.randn(1, E, device="cuda")
    dh = torch.zeros(1, d, device="cuda", dtype=torch.int64)  # accumulates (fixed point); fine for timing
    dbc = torch.zeros(1, 16, device="cuda", dtype=torch.int64)
    res = []
    for BN, nsplit, BK, warps in itertools.product([8, 16, 32], [1, 2, 4, 8], [128, 256, 512], [4, 8]):
        kchunk = triton.cdiv(triton.cdiv(E, nsplit), BK) * BK
        ns = triton.cdiv(E, kchunk)
        nt = triton.cdiv(d, BN)

        def run():
            ds._out_proj_residual_kernel[(1, nt, ns)](
                y, w, w, w, dh, dbc, y, dh, 1, d, E, kchunk, W_SCALED=False, HAS_BIAS=False,
                BN=BN, BK=BK, BJ=16, PDL=0, MMA=False, ACT="none", GATED=False, BD=0, num_warps=warps,
            )

        res.append((do_bench(run, warmup=5, rep=30) * 1e3, dict(BN=BN, nsplit=ns, BK=BK, warps=warps)))
    report(f"out_proj {d}x{E}", res, w.numel() * 2)


def tune_in_graph(size, parts=("in_proj", "out_proj", "states")):
    from fastmamba.bench import random_model

    model = random_model(size, DT)
    print(f"{size} batch 1, default blocks: {step_ms(model):.4f} ms/step", flush=True)
    for blocks in [] if "in_proj" not in parts else [(8, 512, 4, 1), (8, 256, 4, 1), (8, 1024, 8, 1), (16, 256, 4, 1), (16, 1024, 8, 1), (4, 1024, 4, 1), (16, 512, 4, 2),
                                                     (16, 512, 4, 1), (16, 1024, 4, 1), (32, 512, 8, 1), (16, 2048, 8, 1)]:
        print(f"   in_proj BN, BK, warps, stages = {blocks}: {step_ms(model, in_proj=blocks):.4f} ms/step", flush=True)
    for blocks, programs in [] if "out_proj" not in parts else [((8, 512, 4), 1280), ((8, 512, 4), 960), ((8, 256, 4), 1280), ((16, 512, 8), 640), ((4, 1024, 4), 1280), ((8, 1024, 8), 640),
                                                                ((8, 1024, 4), 1280), ((16, 1024, 8), 1280), ((8, 2048, 8), 640)]:
        print(f"   out_proj BN, BK, warps = {blocks}, ~{programs} programs: {step_ms(model, out_proj=(*blocks, programs)):.4f} ms/step", flush=True)
    for in_in_proj, block in [] if "states" not in parts else [(True, 128), (False, 16), (False, 32), (False, 64), (False, 128)]:
        how = "in in_proj" if in_in_proj else f"own kernel, {block} channels a program"
        print(f"   conv step + x_proj {how}: {step_ms(model, conv_in_in_proj=in_in_proj, conv_block=block):.4f} ms/step", flush=True)
    for blocks in () if "states" not in parts else ((2, 1), (4, 1), (8, 1), (16, 1), (8, 2), (16, 4), (32, 4)):
        print(f"   ssm_step channels, warps = {blocks}: {step_ms(model, ssm_block=blocks):.4f} ms/step", flush=True)


def tune_early_launch(size):
    """Which kernels let the next one launch before their own wait (OneRowBlocks.early_launch)."""
    from fastmamba.bench import random_model

    model = random_model(size, DT)
    print(f"{size} early launch by default {sorted(defaults(model).early_launch)}: {step_ms(model):.4f} ms/step", flush=True)
    for early in [(), ("ssm_step",), ("ssm_step", "out_proj_residual"), ("rmsnorm_linear", "ssm_step", "out_proj_residual"),
                  ("rmsnorm_linear", "out_proj_residual"), ("rmsnorm_linear",),
                  ("conv_x_proj", "ssm_step", "out_proj_residual"), ("conv_x_proj",), ("conv_x_proj", "ssm_step")]:  # conv_x_proj: wide models only
        print(f"{size} early launch {early}: {step_ms(model, early_launch=frozenset(early)):.4f} ms/step", flush=True)


def tune_sum_last(size):
    """One-row in_proj summing over K in every K tile or once after the loop
    (OneRowBlocks.in_proj_sum_last), with K tiles of 256 or 512, whole steps, each twice."""
    from fastmamba.bench import random_model

    model = random_model(size, DT)
    BN, _, warps, stages = defaults(model).in_proj
    for _ in range(2):
        for sum_last, BK in ((True, 256), (False, 512), (True, 512), (False, 256)):
            how = "after the loop" if sum_last else "every K tile"
            ms = step_ms(model, in_proj_sum_last=sum_last, in_proj=(BN, BK, warps, stages))
            print(f"{size} in_proj summed {how}, K tiles of {BK}: {ms:.4f} ms/step", flush=True)


def tune_preload(size):
    """More weight bytes in flight: out_proj blocks whose K split is one tile, so that a
    program loads all its weights before its wait (which, launched early, it reaches
    while ssm_step runs), and in_proj's loop pipelined through shared memory (stages);
    whole steps, each setting twice."""
    from fastmamba.bench import random_model

    model = random_model(size, DT)
    base_in = defaults(model).in_proj
    outs = [None, (8, 1024, 4, 1600), (4, 1024, 4, 3200), (8, 1024, 8, 1600), (16, 1024, 8, 800), (8, 512, 4, 3200), (8, 2048, 8, 960)]
    ins = [(*base_in[:3], 2), (*base_in[:3], 3), (*base_in[:3], 4)]
    for _ in range(2):
        for blocks in outs:
            ms = step_ms(model, **({"out_proj": blocks} if blocks else {}))
            print(f"{size} out_proj BN, BK, warps, programs = {blocks or 'default'}: {ms:.4f} ms/step", flush=True)
        for blocks in ins:
            print(f"{size} in_proj BN, BK, warps, stages = {blocks}: {step_ms(model, in_proj=blocks):.4f} ms/step", flush=True)


def tune_ablate(size):
    """Where a batch-1 step's time goes, in the graph: the step without one kind of kernel
    at a time (wrong results: timing only; the difference is that kernel's cost there,
    overlaps included)."""
    from fastmamba.bench import random_model, time_graph_steps

    model = random_model(size, DT)
    print(f"{size} as is: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
    E = model.config.d_inner
    skip = {
        "in_proj": ("_rmsnorm_linear", lambda f: lambda self, nw, w, *a, **k: None if w.shape[0] == 2 * E else f(self, nw, w, *a, **k)),
        "conv_x_proj": ("in_proj", lambda f: lambda self, lw, cs: self._rmsnorm_linear(
            lw.norm_w, lw.in_proj_w, lw.in_proj_b, self.xz, self.in_proj_blocks, sum_last=self.sum_last)),
        "ssm_step": ("ssm_step", lambda f: lambda self, lw, s: None),
        "out_proj": ("out_proj_residual", lambda f: lambda self, lw: None),
        # (its first 16 outputs only: greedy sampling still needs a token)
        "lm_head": ("lm_head", lambda f: lambda self, argmax=False: self._rmsnorm_linear(
            self.model.weights.norm_f, self.model.weights.lm_head[:16], None, self.logits, self.lm_head_blocks, argmax=argmax)),
    }
    for name, (method, make) in skip.items():
        original = getattr(ds.DecodeStep, method)
        setattr(ds.DecodeStep, method, make(original))
        print(f"{size} without {name}: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
        setattr(ds.DecodeStep, method, original)


def tune_lm_head_sum_last(size, dtype):
    """lm_head summing after its loop in 256-wide K tiles (16-bit weights, the default)
    against summing every K tile in the in_proj-style tiles: whole steps, A B B A.
    (float32: the default is every tile; B is then 256-wide tiles, every tile.)"""
    from fastmamba.bench import random_model

    model = random_model(size, dtype)
    f32 = dtype == torch.float32
    BN, _, warps, stages = defaults(model, dtype).lm_head
    linear_bk = defaults(model, torch.float32).lm_head[1]  # the tiles lm_head takes where it sums every tile
    other = dict(lm_head_sum_last=False, lm_head=(BN, 256 if f32 else linear_bk, warps, stages))
    name = "every tile, K tiles of 256" if f32 else "every tile, linear K tiles"
    for variant in ("default", name, name, "default"):
        ms = step_ms(model, dtype, **({} if variant == "default" else other))
        print(f"{size} {str(dtype)[6:]} lm_head {variant}: {ms:.4f} ms/step", flush=True)


def tune_lm_head(size):
    """rmsnorm_linear's blocks for lm_head alone (n_out = vocab), in whole steps; and with
    --in-proj for in_proj at 130m, whose K (768) is not a multiple of 512."""
    from fastmamba.bench import random_model

    model = random_model(size, DT)
    print(f"{size} default blocks: {step_ms(model):.4f} ms/step", flush=True)
    for blocks in [(8, 256, 4, 1), (32, 256, 4, 1), (16, 512, 4, 1), (32, 128, 4, 1), (16, 256, 8, 1), (64, 128, 4, 1)]:
        print(f"   lm_head BN, BK, warps, stages = {blocks}: {step_ms(model, lm_head=blocks):.4f} ms/step", flush=True)
    print(f"{size} default blocks again: {step_ms(model):.4f} ms/step", flush=True)
    if size == "130m" and "--in-proj" in sys.argv:
        for blocks in [(16, 256, 4, 1), (8, 256, 4, 1), (32, 256, 4, 1), (16, 1024, 4, 1)]:
            print(f"   in_proj BN, BK, warps, stages = {blocks}: {step_ms(model, in_proj=blocks):.4f} ms/step", flush=True)


def tune_mma(size, dtype):
    """in_proj's and out_proj's products on the tensor cores (OneRowBlocks.in_proj_mma,
    out_proj_mma) against the float32 multiply-and-sum, in whole batch-1 steps (the default
    first and last), their tiles swept with them (wgmma takes 64 rows a program; fewer run as
    mma.sync)."""
    from fastmamba.bench import random_model

    model = random_model(size, dtype)
    name = f"{size} {str(dtype)[6:]}"
    print(f"{name} batch 1, default blocks: {step_ms(model, dtype):.4f} ms/step", flush=True)
    for blocks in [(64, 256, 4, 1), (64, 128, 4, 1), (64, 256, 4, 2), (64, 256, 8, 1), (32, 128, 4, 1), (16, 256, 4, 1)]:
        ms = step_ms(model, dtype, in_proj=blocks, in_proj_mma=True)
        print(f"   in_proj on the tensor cores, BN, BK, warps, stages = {blocks}: {ms:.4f} ms/step", flush=True)
    for blocks in [(64, 256, 4, 1280), (64, 128, 4, 1280), (16, 256, 4, 1280)]:
        ms = step_ms(model, dtype, out_proj=blocks, out_proj_mma=True)
        print(f"   out_proj on the tensor cores, BN, BK, warps, programs = {blocks}: {ms:.4f} ms/step", flush=True)
    ms = step_ms(model, dtype, in_proj=(64, 256, 4, 1), in_proj_mma=True, out_proj=(64, 256, 4, 1280), out_proj_mma=True)
    print(f"   both on the tensor cores, 64 x 256 tiles: {ms:.4f} ms/step", flush=True)
    print(f"{name} batch 1, default blocks again: {step_ms(model, dtype):.4f} ms/step", flush=True)


# Each sweep's flag, its function and the arguments it runs with, in turn.
BF16, F32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
SWEEPS = {
    "--lm-head": (tune_lm_head, [("130m",), ("2.8b",), ("1.4b",)]),
    "--preload": (tune_preload, [("2.8b",), ("1.4b",)]),
    "--lm-head-sum-last": (tune_lm_head_sum_last, [("130m", BF16), ("370m", BF16), ("1.4b", BF16), ("2.8b", BF16),
                                                   ("130m", F32), ("2.8b", F32)]),
    "--ablate": (tune_ablate, [("2.8b",), ("1.4b",), ("130m",)]),
    "--sum-last": (tune_sum_last, [("1.4b",), ("2.8b",)]),
    "--early": (tune_early_launch, [("130m",), ("370m",), ("1.4b",), ("2.8b",)]),
    "--mma": (tune_mma, [("2.8b", FP8), ("mamba2-2.7b", FP8), ("2.8b", BF16), ("mamba2-2.7b", BF16)]),
}


if __name__ == "__main__":
    print(torch.cuda.get_device_name())
    for flag, (sweep, runs) in SWEEPS.items():
        if flag in sys.argv:
            for args in runs:
                sweep(*args)
            sys.exit()
    if "--in-graph" in sys.argv:  # --in-proj / --out-proj / --states: those kernels' blocks only
        parts = [p for p in ("in_proj", "states", "out_proj") if f"--{p.replace('_', '-')}" in sys.argv] or ["in_proj", "out_proj", "states"]
        sizes = ("1.4b", "2.8b") if "--wide" in sys.argv else ("130m", "1.4b", "2.8b")
        for size in ("2.8b",) if "--only-2.8b" in sys.argv else sizes:
            tune_in_graph(size, parts)
        sys.exit()
    tune_rmsnorm_linear(10240, 2560)  # 2.8b in_proj
    tune_rmsnorm_linear(3072, 768)  # 130m in_proj
    tune_rmsnorm_linear(50280, 2560)  # 2.8b lm_head
    tune_out_proj(2560, 5120)
    tune_out_proj(768, 1536)
