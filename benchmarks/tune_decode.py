"""Sweeps block sizes of the one-row (batch <= 8) decode kernels at the public shapes.

Times each kernel alone (triton.testing.do_bench, median) for a grid of configurations and
prints the best few per shape with the achieved weight bandwidth, to choose DecodeStep's
defaults.  python benchmarks/tune_decode.py

With --in-graph it times whole graph-replayed batch-1 steps instead, changing the block
sizes of one kernel at a time: alone, a kernel sees its weights partly in L2 and no
neighbours, so its best blocks need not be the step's (--states: where the conv step and
x_proj run, and ssm_step's blocks; --out-proj, --in-proj: only those; --wide: 1.4b and
2.8b only). With --lm-head it sweeps lm_head's blocks (and 130m's in_proj) in whole
steps; with --early, which kernels let the next one launch before their own wait; with
--sum-last, where one-row in_proj sums over K (--f32: float32 weights); with --preload,
out_proj blocks of one tile a K split and in_proj's loop in shared-memory stages; with
--ablate, the step without one kind of kernel at a time (timing only); with
--lm-head-sum-last, lm_head summing after its loop in 256-wide K tiles against every tile.
"""

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from fastmamba.kernels import decode_step as ds  # noqa: E402

DT = torch.float32 if "--f32" in sys.argv else torch.bfloat16


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
    res = []
    for BN, BK, warps in itertools.product([4, 8, 16, 32], [256, 512, 1024], [2, 4, 8]):
        if BN * BK > 16384:
            continue

        def run():
            ds._rmsnorm_linear_kernel[(1, triton.cdiv(n_out, BN))](
                h, dh, nw, w, w, out, *(out,) * 7, 1, d, n_out, 0, 0, 1e-5, HAS_BIAS=False,
                CONV=False, ARGMAX=False, K=4, KP=4, HAS_CB=False, BN=BN, BK=BK, BJ=16, STAGES=1,
                SUM_LAST=DT in ds.DecodeStep.SUM_LAST and n_out == 4 * d and d > BK, UNROLL=1, PDL=0, num_warps=warps,
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
                y, w, w, dh, dbc, 1, d, E, kchunk, HAS_BIAS=False,
                BN=BN, BK=BK, BJ=16, PDL=0, num_warps=warps,
            )

        res.append((do_bench(run, warmup=5, rep=30) * 1e3, dict(BN=BN, nsplit=ns, BK=BK, warps=warps)))
    report(f"out_proj {d}x{E}", res, w.numel() * 2)


def tune_in_graph(size, parts=("in_proj", "out_proj", "states")):
    from fastmamba.bench import random_model, time_graph_steps

    model = random_model(size, DT)
    default_linear = ds.DecodeStep.__dict__["linear_blocks"]  # the staticmethod itself
    default_out = ds.DecodeStep.__dict__["out_blocks"]
    vocab = model.config.vocab_size
    print(f"{size} batch 1, default blocks: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
    for blocks in [] if "in_proj" not in parts else [(8, 512, 4, 1), (8, 256, 4, 1), (8, 1024, 8, 1), (16, 256, 4, 1), (16, 1024, 8, 1), (4, 1024, 4, 1), (16, 512, 4, 2)]:
        ds.DecodeStep.linear_blocks = staticmethod(lambda n, d, b=blocks: b if n != vocab else default_linear.__func__(n, d))
        print(f"   in_proj BN, BK, warps, stages = {blocks}: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
    ds.DecodeStep.linear_blocks = default_linear
    for blocks, programs in [] if "out_proj" not in parts else [((8, 512, 4), 1280), ((8, 512, 4), 960), ((8, 256, 4), 1280), ((16, 512, 8), 640), ((4, 1024, 4), 1280), ((8, 1024, 8), 640)]:
        ds.DecodeStep.out_blocks = staticmethod(lambda d, b=(*blocks, programs): b)
        print(f"   out_proj BN, BK, warps = {blocks}, ~{programs} programs: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
    ds.DecodeStep.out_blocks = default_out
    default_fused, default_conv, default_ssm = ds.DecodeStep.FUSED_CONV_UP_TO, ds.DecodeStep.CONV_BLOCK, ds.DecodeStep.__dict__["ssm_blocks"]
    for fused_up_to, block in [] if "states" not in parts else [(1 << 20, default_conv), (0, 16), (0, 32), (0, 64), (0, 128), (0, 32), (0, 64), (0, 128)]:
        ds.DecodeStep.FUSED_CONV_UP_TO, ds.DecodeStep.CONV_BLOCK = fused_up_to, block
        how = "in in_proj" if fused_up_to else f"own kernel, {block} channels a program"
        print(f"   conv step + x_proj {how}: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
    ds.DecodeStep.FUSED_CONV_UP_TO, ds.DecodeStep.CONV_BLOCK = default_fused, default_conv
    for blocks in () if "states" not in parts else ((2, 1), (4, 1), (8, 1), (16, 1), (8, 2), (16, 4), (32, 4)):
        ds.DecodeStep.ssm_blocks = staticmethod(lambda d, b=blocks: b)
        print(f"   ssm_step channels, warps = {blocks}: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
    ds.DecodeStep.ssm_blocks = default_ssm


def tune_early_launch(size):
    """Which kernels let the next one launch before their own wait (DecodeStep.EARLY_LAUNCH)."""
    from fastmamba.bench import random_model, time_graph_steps

    model = random_model(size, DT)
    default = ds.DecodeStep.EARLY_LAUNCH
    print(f"{size} early launch by default {sorted(default)}: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
    for early in [(), ("ssm_step",), ("ssm_step", "out_proj_residual"), ("rmsnorm_linear", "ssm_step", "out_proj_residual"),
                  ("rmsnorm_linear", "out_proj_residual"), ("rmsnorm_linear",),
                  ("conv_x_proj", "ssm_step", "out_proj_residual"), ("conv_x_proj",), ("conv_x_proj", "ssm_step")]:  # conv_x_proj: wide models only
        ds.DecodeStep.EARLY_LAUNCH = frozenset(early)
        print(f"{size} early launch {early}: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
    ds.DecodeStep.EARLY_LAUNCH = default


def tune_sum_last(size):
    """One-row in_proj summing over K in every K tile or once after the loop
    (DecodeStep.SUM_LAST), with K tiles of 256 or 512, whole steps, each twice."""
    from fastmamba.bench import random_model, time_graph_steps

    model = random_model(size, DT)
    default, default_linear = ds.DecodeStep.SUM_LAST, ds.DecodeStep.__dict__["linear_blocks"]
    vocab = model.config.vocab_size
    for _ in range(2):
        for sum_last, BK in ((True, 256), (False, 512), (True, 512), (False, 256)):
            ds.DecodeStep.SUM_LAST = frozenset({DT} if sum_last else ())
            ds.DecodeStep.linear_blocks = staticmethod(
                lambda n, d, BK=BK: (lambda b: b if n == vocab else (b[0], BK, *b[2:]))(default_linear.__func__(n, d)))
            how = "after the loop" if sum_last else "every K tile"
            print(f"{size} in_proj summed {how}, K tiles of {BK}: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
    ds.DecodeStep.SUM_LAST, ds.DecodeStep.linear_blocks = default, default_linear


def tune_preload(size):
    """More weight bytes in flight: out_proj blocks whose K split is one tile, so that a
    program loads all its weights before its wait (which, launched early, it reaches
    while ssm_step runs), and in_proj's loop pipelined through shared memory (stages);
    whole steps, each setting twice."""
    from fastmamba.bench import random_model, time_graph_steps

    model = random_model(size, DT)
    default_linear, default_out = ds.DecodeStep.__dict__["linear_blocks"], ds.DecodeStep.__dict__["out_blocks"]
    vocab = model.config.vocab_size
    base_in = default_linear.__func__(4 * model.config.d_model, model.config.d_model)
    outs = [None, (8, 1024, 4, 1600), (4, 1024, 4, 3200), (8, 1024, 8, 1600), (16, 1024, 8, 800), (8, 512, 4, 3200), (8, 2048, 8, 960)]
    ins = [(*base_in[:3], 2), (*base_in[:3], 3), (*base_in[:3], 4)]
    for _ in range(2):
        for blocks in outs:
            ds.DecodeStep.out_blocks = staticmethod(lambda d, b=blocks: b) if blocks else default_out
            print(f"{size} out_proj BN, BK, warps, programs = {blocks or 'default'}: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
        ds.DecodeStep.out_blocks = default_out
        for blocks in ins:
            ds.DecodeStep.linear_blocks = staticmethod(lambda n, d, b=blocks: b if n != vocab else default_linear.__func__(n, d))
            print(f"{size} in_proj BN, BK, warps, stages = {blocks}: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
        ds.DecodeStep.linear_blocks = default_linear


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
        "conv_x_proj": ("in_proj", lambda f: lambda self, lw, cs: self._rmsnorm_linear(lw.norm_w, lw.in_proj_w, lw.in_proj_b, self.xz, sum_last=self.sum_last)),
        "ssm_step": ("ssm_step", lambda f: lambda self, lw, s: None),
        "out_proj": ("out_proj_residual", lambda f: lambda self, lw: None),
        # (its first 16 outputs only: greedy sampling still needs a token)
        "lm_head": ("lm_head", lambda f: lambda self, argmax=False: self._rmsnorm_linear(
            self.model.weights.norm_f, self.model.weights.lm_head[:16], None, self.logits, argmax=argmax)),
    }
    for name, (method, make) in skip.items():
        original = getattr(ds.DecodeStep, method)
        setattr(ds.DecodeStep, method, make(original))
        print(f"{size} without {name}: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
        setattr(ds.DecodeStep, method, original)


def tune_lm_head_sum_last(size, dtype):
    """lm_head summing after its loop in LM_HEAD_K_TILE-wide K tiles (16-bit weights, the
    default) against summing every K tile in linear_blocks' tiles: whole steps, A B B A.
    (float32: the default is every tile; B is then LM_HEAD_K_TILE-wide tiles, every tile.)"""
    from fastmamba.bench import random_model, time_graph_steps

    model = random_model(size, dtype)
    lm_head = ds.DecodeStep.lm_head
    f32 = dtype == torch.float32

    def other(self, argmax=False):
        w = self.model.weights
        k_tile = self.LM_HEAD_K_TILE if f32 else None
        self._rmsnorm_linear(w.norm_f, w.lm_head, None, self.logits, argmax=argmax, k_tile=k_tile)

    name = "every tile, K tiles of 256" if f32 else "every tile, linear_blocks' K tiles"
    for variant in ("default", name, name, "default"):
        ds.DecodeStep.lm_head = lm_head if variant == "default" else other
        print(f"{size} {str(dtype)[6:]} lm_head {variant}: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
    ds.DecodeStep.lm_head = lm_head


def tune_lm_head(size):
    """rmsnorm_linear's blocks for lm_head alone (n_out = vocab), in whole steps; and with
    --in-proj for in_proj at 130m, whose K (768) is not a multiple of 512."""
    from fastmamba.bench import random_model, time_graph_steps

    model = random_model(size, DT)
    default_linear, default_tile = ds.DecodeStep.__dict__["linear_blocks"], ds.DecodeStep.LM_HEAD_K_TILE
    vocab = model.config.vocab_size
    print(f"{size} default blocks: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
    # (16-bit weights: lm_head's K tile is LM_HEAD_K_TILE, set to the BK here)
    for blocks in [(8, 256, 4, 1), (32, 256, 4, 1), (16, 512, 4, 1), (32, 128, 4, 1), (16, 256, 8, 1), (64, 128, 4, 1)]:
        ds.DecodeStep.linear_blocks = staticmethod(lambda n, d, b=blocks: b if n == vocab else default_linear.__func__(n, d))
        ds.DecodeStep.LM_HEAD_K_TILE = blocks[1]
        print(f"   lm_head BN, BK, warps, stages = {blocks}: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
    ds.DecodeStep.linear_blocks, ds.DecodeStep.LM_HEAD_K_TILE = default_linear, default_tile
    print(f"{size} default blocks again: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
    if size == "130m" and "--in-proj" in sys.argv:
        for blocks in [(16, 256, 4, 1), (8, 256, 4, 1), (32, 256, 4, 1), (16, 1024, 4, 1)]:
            ds.DecodeStep.linear_blocks = staticmethod(lambda n, d, b=blocks: b if n != vocab else default_linear.__func__(n, d))
            print(f"   in_proj BN, BK, warps, stages = {blocks}: {time_graph_steps(model, 1):.4f} ms/step", flush=True)
    ds.DecodeStep.linear_blocks = default_linear


# Each sweep's flag, its function and the arguments it runs with, in turn.
BF16, F32 = torch.bfloat16, torch.float32
SWEEPS = {
    "--lm-head": (tune_lm_head, [("130m",), ("2.8b",), ("1.4b",)]),
    "--preload": (tune_preload, [("2.8b",), ("1.4b",)]),
    "--lm-head-sum-last": (tune_lm_head_sum_last, [("130m", BF16), ("370m", BF16), ("1.4b", BF16), ("2.8b", BF16),
                                                   ("130m", F32), ("2.8b", F32)]),
    "--ablate": (tune_ablate, [("2.8b",), ("1.4b",), ("130m",)]),
    "--sum-last": (tune_sum_last, [("1.4b",), ("2.8b",)]),
    "--early": (tune_early_launch, [("130m",), ("370m",), ("1.4b",), ("2.8b",)]),
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
        for size in ("1.4b", "2.8b") if "--wide" in sys.argv else ("130m", "1.4b", "2.8b"):
            tune_in_graph(size, parts)
        sys.exit()
    tune_rmsnorm_linear(10240, 2560)  # 2.8b in_proj
    tune_rmsnorm_linear(3072, 768)  # 130m in_proj
    tune_rmsnorm_linear(50280, 2560)  # 2.8b lm_head
    tune_out_proj(2560, 5120)
    tune_out_proj(768, 1536)
