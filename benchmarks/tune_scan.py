"""Times the prefill scan alone at public shapes for several launch configurations
(one-pass associative scan vs the chunked two-pass scan), to choose SCAN_CHUNK, SCAN_BE,
SCAN_WARPS, SCAN_STAGES and SCAN_UNROLL in kernels/selective_scan.py.

    python benchmarks/tune_scan.py             # the sweep
    python benchmarks/tune_scan.py --passes    # each pass's time at the defaults
    python benchmarks/tune_scan.py --split     # chunks a row x channels a program
    python benchmarks/tune_scan.py --lengths   # chunk lengths near the defaults
    python benchmarks/tune_scan.py --lengths --long   # the same for 16384-token chunks
    python benchmarks/tune_scan.py --depth     # batch 8: few chunks, deep load pipelines
"""

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from fastmamba.kernels import selective_scan as ss  # noqa: E402


def inputs(B, T, E, N=16, R=160):
    g = torch.Generator(device="cuda").manual_seed(0)
    xz = torch.randn(B, T, 2 * E, device="cuda", generator=g)
    x, z = torch.randn(B, T, E, device="cuda", generator=g).transpose(1, 2), xz[..., E:].transpose(1, 2)
    delta = torch.nn.functional.softplus(torch.randn(B, T, E, device="cuda", generator=g) - 4).transpose(1, 2)
    dbc = torch.randn(B, T, R + 2 * N, device="cuda", generator=g)
    A = -torch.arange(1, N + 1, device="cuda").float().repeat(E, 1)
    D = torch.ones(E, device="cuda")
    Bm, Cm = dbc[..., R : R + N].transpose(1, 2), dbc[..., R + N :].transpose(1, 2)
    return x, delta, A, Bm, Cm, D, z, torch.zeros(B, E, N, device="cuda")


def reference(args):
    """The one-pass scan's y from a zero state (each call updates the state it is given)."""
    args[-1].zero_()
    ref = ss.selective_scan(*args, chunked=False).clone()
    args[-1].zero_()
    return ref


def time_chunked(args, ref, rep=20):
    """µs a call of the chunked scan at the module's current settings, and its largest
    difference from ref, both runs' checks from a zero state."""
    us = do_bench(lambda: ss.selective_scan(*args, chunked=True), warmup=3, rep=rep) * 1e3
    args[-1].zero_()  # do_bench left the state after its runs
    err = (ss.selective_scan(*args, chunked=True) - ref).abs().max().item()
    args[-1].zero_()
    return us, err


def main() -> None:
    for B, T, E in ((1, 4096, 5120), (8, 2048, 5120), (1, 4096, 1536)):
        args = inputs(B, T, E)
        ms = do_bench(lambda: ss.selective_scan(*args, chunked=False), warmup=3, rep=20)
        print(f"B={B} T={T} E={E}: one-pass {ms * 1e3:8.1f} us", flush=True)
        ref = reference(args)
        res = []
        ss.SCAN_FEW_PROGRAMS = 0  # L as given
        # (BE 64 and 2 warps a program lost at every shape in earlier sweeps; RESULTS.md)
        for L, BE, warps, stages, unroll in itertools.product((32, 64, 128), (128,), (1,), (3, 4), (1, 2, 4)):
            ss.SCAN_CHUNK, ss.SCAN_BE, ss.SCAN_WARPS, ss.SCAN_STAGES, ss.SCAN_UNROLL = L, BE, warps, stages, unroll
            us, err = time_chunked(args, ref)
            res.append((us, L, BE, warps, stages, unroll, err))
        for us, L, BE, warps, stages, unroll, err in sorted(res)[:8]:
            print(f"   chunked L={L:3d} BE={BE:3d} warps={warps} stages={stages} unroll={unroll}: {us:8.1f} us  (max diff {err:.1e})",
                  flush=True)


def split() -> None:
    """The chunked scan at each number of chunks a row (1 = pass 2 alone, no summaries) and
    channels a program: fewer chunks mean fewer exps (pass 1 walks all chunks but the last),
    more channels a thread fewer loads a state; both mean fewer warps to hide latency."""
    ss.SCAN_FEW_PROGRAMS = 0  # L as given
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B, T, E in ((1, 4096, 5120), (8, 2048, 5120)):
        args = inputs(B, T, E)
        ref = reference(args)
        res = []
        for BE, warps, unroll in ((32, 1, 2), (32, 1, 4), (64, 2, 2), (64, 1, 2), (128, 1, 2), (128, 4, 2)):
            for nc in (1, 2, 4, 8, 16, 32, 64):
                ss.SCAN_CHUNK, ss.SCAN_BE, ss.SCAN_WARPS, ss.SCAN_UNROLL = T // nc, BE, warps, unroll
                try:
                    us, err = time_chunked(args, ref)
                except triton.runtime.errors.OutOfResources as e:
                    print(f"   BE={BE} warps={warps} unroll={unroll} nc={nc}: {e}", flush=True)
                    continue
                res.append((us, BE, warps, unroll, nc, B * E // BE * nc * warps / sms, err))
        print(f"B={B} T={T} E={E}:", flush=True)
        for us, BE, warps, unroll, nc, wps, err in sorted(res)[:16]:
            print(f"   {us:8.1f} us  BE={BE:3d} warps={warps} unroll={unroll} chunks={nc:2d} ({wps:5.1f} warps an SM)"
                  f"  max diff {err:.1e}", flush=True)


def depth() -> None:
    """Few chunks at batch 8 (rows give parallelism: one chunk means no summary pass, half
    the exps), where a program's walk is long: channels a program, chunks a row and the
    depth of each step's load pipeline (tl.range num_stages)."""
    ss.SCAN_FEW_PROGRAMS = 0  # L as given
    B, T, E = 8, 2048, 5120
    args = inputs(B, T, E)
    ref = reference(args)
    res = []
    for BE, nc, stages in itertools.product((32, 64, 128), (1, 2, 4, 16), (4, 8, 12)):
        ss.SCAN_CHUNK, ss.SCAN_BE, ss.SCAN_WARPS, ss.SCAN_STAGES, ss.SCAN_UNROLL = T // nc, BE, 1, stages, 2
        try:
            us, err = time_chunked(args, ref)
        except triton.runtime.errors.OutOfResources as e:
            print(f"   BE={BE} chunks={nc} stages={stages}: {e}", flush=True)
            continue
        res.append((us, BE, nc, stages, err))
        print(f"   {us:8.1f} us  BE={BE:3d} chunks={nc:2d} stages={stages:2d}  max diff {err:.1e}", flush=True)
    print(f"B={B} T={T} E={E}, best:", flush=True)
    for us, BE, nc, stages, err in sorted(res)[:8]:
        print(f"   {us:8.1f} us  BE={BE:3d} chunks={nc:2d} stages={stages:2d}", flush=True)


def lengths() -> None:
    """The chunked scan at its default blocks for chunk lengths around the defaults: the
    number of programs against the GPU's resident slots (whole waves or a ragged last one)."""
    ss.SCAN_FEW_PROGRAMS = 0  # L as given
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
            ss.SCAN_CHUNK = L
            us, err = time_chunked(args, ref, rep=30)
            nc = -(-T // L)
            print(f"   L={L:3d} chunks={nc:3d} programs {B * (E // ss.SCAN_BE) * nc:5d}: {us:8.1f} us  max diff {err:.1e}",
                  flush=True)


def passes() -> None:
    """Each pass's GPU time at the defaults (torch.profiler), 2.8b widths."""
    for B, T in ((1, 4096), (8, 2048)):
        print(f"B={B} T={T} E=5120:", flush=True)
        profile_passes(inputs(B, T, 5120))


def profile_passes(args) -> None:
    ss.selective_scan(*args, chunked=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            ss.selective_scan(*args, chunked=True)
        torch.cuda.synchronize()
    for ev in prof.key_averages():
        if "scan" in ev.key:
            print(f"   {ev.key}: {ev.device_time_total / ev.count:8.1f} us a call", flush=True)


if __name__ == "__main__":
    if "--passes" in sys.argv:
        passes()
    elif "--split" in sys.argv:
        split()
    elif "--lengths" in sys.argv:
        lengths()
    elif "--depth" in sys.argv:
        depth()
    else:
        main()
