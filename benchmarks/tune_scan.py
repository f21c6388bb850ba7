"""Times the prefill scan alone at public shapes for several launch configurations
(one-pass associative scan vs the chunked two-pass scan, its thread layouts and chunks), to
choose ScanTiles (engine/plan.py's SCAN_TILES) and the rule of chunked_launch in
kernels/selective_scan.py.

    python -m benchmarks.tune_scan             # the sweep
    python -m benchmarks.tune_scan --passes    # each pass's time at the defaults
    python -m benchmarks.tune_scan --lengths   # chunk lengths near the defaults
    python -m benchmarks.tune_scan --lengths --long   # the same for 16384-token chunks
    python -m benchmarks.tune_scan --layouts   # channels a thread x chunks, prefill shapes
    python -m benchmarks.tune_scan --layouts --short   # short prompts, and the one-pass scan
"""

import itertools
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

from fastmamba.engine.plan import SCAN_TILES
from fastmamba.kernels import selective_scan as ss


def inputs(B, T, E, N=16, R=160):
    """The scan's inputs as a bf16 model's prefill makes them: x (the conv's output) and z
    (in_proj's) in bf16, views into (B, T, *) buffers."""
    g = torch.Generator(device="cuda").manual_seed(0)
    xz = torch.randn(B, T, 2 * E, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(B, T, E, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
    z = xz[..., E:].transpose(1, 2)
    delta = torch.nn.functional.softplus(torch.randn(B, T, E, device="cuda", generator=g) - 4).transpose(1, 2)
    dbc = torch.randn(B, T, R + 2 * N, device="cuda", generator=g)
    A = -torch.arange(1, N + 1, device="cuda").float().repeat(E, 1)
    D = torch.ones(E, device="cuda")
    Bm, Cm = dbc[..., R : R + N].transpose(1, 2), dbc[..., R + N :].transpose(1, 2)
    return x, delta, A, Bm, Cm, D, z, torch.zeros(B, E, N, device="cuda")


def reference(args):
    """The one-pass scan's y from a zero state (each call updates the state it is given)."""
    args[-1].zero_()
    ref = ss.selective_scan(*args, chunked=False, tiles=SCAN_TILES).clone()
    args[-1].zero_()
    return ref


def time_chunked(args, ref, launch=None, rep=20, graph=False):
    """µs a call of the chunked scan with `launch` (default: chunked_launch's), and its
    largest difference from ref, both runs' checks from a zero state. graph: timed as
    CUDA-graph replays (the GPU's time alone, as prefill runs short prompts; the host's
    launches outlast small scans)."""
    bench = (lambda f: do_bench_cudagraph(f, rep=rep)) if graph else (lambda f: do_bench(f, warmup=3, rep=rep))
    us = bench(lambda: ss.selective_scan(*args, chunked=True, launch=launch, tiles=SCAN_TILES)) * 1e3
    args[-1].zero_()  # do_bench left the state after its runs
    err = (ss.selective_scan(*args, chunked=True, launch=launch, tiles=SCAN_TILES) - ref).abs().max().item()
    args[-1].zero_()
    return us, err


def main() -> None:
    for B, T, E in ((1, 4096, 5120), (8, 2048, 5120), (1, 4096, 1536)):
        args = inputs(B, T, E)
        ms = do_bench(lambda: ss.selective_scan(*args, chunked=False, tiles=SCAN_TILES), warmup=3, rep=20)
        print(f"B={B} T={T} E={E}: one-pass {ms * 1e3:8.1f} us", flush=True)
        ref = reference(args)
        res = []
        # 4 channels a thread, one warp a program (other layouts: --layouts)
        for L, stages, unroll in itertools.product((32, 64, 128), (3, 4), (1, 2, 4)):
            run = ss.ScanLaunch(L, 128, 4, 1, stages, unroll)
            us, err = time_chunked(args, ref, run)
            res.append((us, L, stages, unroll, err))
        for us, L, stages, unroll, err in sorted(res)[:8]:
            print(f"   chunked L={L:3d} stages={stages} unroll={unroll}: {us:8.1f} us  (max diff {err:.1e})", flush=True)


def layouts() -> None:
    """Both thread layouts of the chunked scan (4 channels a thread, one warp a program, the
    chunk rule of the defaults; or CPL = 1-2 channels a thread, 2-4 warps a program, 1 to
    T / 64 chunks) at the prefill shapes of the public widths (E = 2 d_model): the launch
    rule in selective_scan.chunked_launch comes from here."""
    shapes = [(B, T, 5120) for B, T in ((1, 1024), (1, 2048), (1, 8192), (1, 16384), (2, 8192), (4, 4096), (8, 2048), (16, 1024))]
    shapes += [(B, T, 1536) for B, T in ((1, 2048), (1, 16384), (8, 2048), (16, 1024))]
    shapes += [(1, 8192, 4096), (8, 2048, 4096)]
    if "--short" in sys.argv:  # prompts under SCAN_TILES.chunked_from steps (the one-pass scan's), and small ones above
        shapes = [(B, T, E) for E in (1536, 5120) for B, T in ((1, 128), (1, 512), (4, 256), (16, 256), (64, 64), (2, 1024), (1, 4096))]
        shapes += [(4, 2048, 1536), (2, 2048, 4096), (1, 2048, 2048)]
    for B, T, E in shapes:
        args = inputs(B, T, E)
        ref = reference(args)
        if T < SCAN_TILES.chunked_from:
            us = do_bench_cudagraph(lambda: ss.selective_scan(*args, chunked=False, tiles=SCAN_TILES), rep=20) * 1e3
            print(f"B={B} T={T} E={E}: the one-pass scan {us:8.1f} us", flush=True)
        runs = {ss.chunked_launch(B, E, T, SCAN_TILES)}
        runs |= {ss.ScanLaunch(L, 128, 4, 1, SCAN_TILES.stages, SCAN_TILES.unroll) for L in (64, 128, T)}
        for BE, CPL, warps in ((32, 1, 1), (64, 1, 2), (128, 1, 4), (128, 2, 2)):
            for L in {T, T // 2, T // 4, T // 8, 256, 128, 64}:
                if L >= min(T, 64):
                    runs.add(ss.ScanLaunch(L, BE, CPL, warps, SCAN_TILES.lane_stages, SCAN_TILES.lane_unroll))
        res = []
        for run in runs:
            us, err = time_chunked(args, ref, run, graph=True)
            res.append((us, run, err))
        base = next(us for us, run, _ in res if run == ss.chunked_launch(B, E, T, SCAN_TILES))
        print(f"B={B} T={T} E={E}: the default {base:8.1f} us", flush=True)
        for us, run, err in sorted(res, key=lambda r: r[0])[:6]:
            print(f"   {us:8.1f} us  L={run.L:5d} BE={run.BE:3d} CPL={run.CPL} warps={run.warps} stages={run.stages} "
                  f"unroll={run.unroll}  max diff {err:.1e}", flush=True)


def lengths() -> None:
    """The chunked scan, 4 channels a thread, for chunk lengths around the defaults: the
    number of programs against the GPU's resident slots (whole waves or a ragged last one)."""
    shapes = ((1, 4096, 5120, (56, 60, 64, 68, 72, 76, 80, 84, 88, 96, 104, 112)),
              (8, 2048, 5120, (96, 104, 112, 120, 128, 136, 144, 160)))
    if "--long" in sys.argv:  # the one-chunk prompts of Mamba.chunk_tokens: 2.8b and 130m widths
        shapes = ((1, 8192, 5120, (48, 64, 80, 96, 112, 128, 160, 192, 256)),
                  (1, 16384, 1536, (64, 96, 128, 192, 256, 384, 512)))
    for B, T, E, Ls in shapes:
        args = inputs(B, T, E)
        ref = reference(args)
        print(f"B={B} T={T} E={E}:", flush=True)
        for L in Ls:
            run = ss.ScanLaunch(L, SCAN_TILES.be, 4, SCAN_TILES.warps, SCAN_TILES.stages, SCAN_TILES.unroll)
            us, err = time_chunked(args, ref, run, rep=30)
            nc = -(-T // L)
            print(f"   L={L:3d} chunks={nc:3d} programs {B * (E // SCAN_TILES.be) * nc:5d}: {us:8.1f} us  max diff {err:.1e}",
                  flush=True)


def passes() -> None:
    """Each pass's GPU time at the defaults (torch.profiler), 2.8b widths."""
    for B, T in ((1, 4096), (8, 2048)):
        print(f"B={B} T={T} E=5120:", flush=True)
        profile_passes(inputs(B, T, 5120))


def profile_passes(args) -> None:
    ss.selective_scan(*args, chunked=True, tiles=SCAN_TILES)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            ss.selective_scan(*args, chunked=True, tiles=SCAN_TILES)
        torch.cuda.synchronize()
    for ev in prof.key_averages():
        if "scan" in ev.key:
            print(f"   {ev.key}: {ev.device_time_total / ev.count:8.1f} us a call", flush=True)


if __name__ == "__main__":
    if "--passes" in sys.argv:
        passes()
    elif "--lengths" in sys.argv:
        lengths()
    elif "--layouts" in sys.argv:
        layouts()
    else:
        main()
