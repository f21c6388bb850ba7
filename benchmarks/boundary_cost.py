"""What a kernel boundary costs in a CUDA graph, and what a counter instead of PDL's wait saves.

A chain of LAUNCHES GEMV-like kernels, each on its own (D, D) bf16 matrix (together far
more than L2, as in a decode step), each kernel reading the vector the one before wrote:
out_k = W_k @ out_(k-1). Three ways for kernel k to wait for kernel k-1:

- plain:  no programmatic dependent launch (the graph orders the kernels);
- pdl:    the next kernel launches as this one's programs start, loads its first weight
          tile, then waits for the whole earlier grid (griddepcontrol.wait) - the engine's way;
- spin:   launched the same way, but instead of griddepcontrol.wait each program polls a
          counter that every program of the earlier kernel bumps (release) once its
          output is stored: it may go on as soon as the last one lands, before that grid
          has finished exiting and flushing.

Reported: µs a launch and the bytes' rate; the gap to a bare read's rate is the boundary.
First, the sustained read rate: the same kernel once over a 4 GiB matrix (no boundaries).

    python benchmarks/boundary_cost.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastmamba.bench import time_graph_launches  # noqa: E402

LAUNCHES = 48
MODES = {"plain": 0, "pdl": 1, "spin": 2}


@triton.jit
def _spin_until(cnt_ptr, target):
    """Polls *cnt_ptr (acquire) until it reaches target."""
    c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    while c < target:
        c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _chain_kernel(w_ptr, x_ptr, out_ptr, cnt_in, cnt_out, D, P_prev, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr):
    if MODE > 0:
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    w = tl.load(w_ptr + n[:, None] * D + k[None, :])
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
    if MODE == 2:
        _spin_until(cnt_in, P_prev)
    x = tl.load(x_ptr + k, cache_modifier=".cg")
    acc = tl.sum(w.to(tl.float32) * x[None, :], 1)
    for k0 in range(BK, D, BK):
        k = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + n[:, None] * D + k[None, :])
        x = tl.load(x_ptr + k, cache_modifier=".cg")
        acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
    tl.store(out_ptr + n, acc * 1e-3)
    if MODE == 2:
        tl.debug_barrier()  # every thread's store before the bump
        tl.atomic_add(cnt_out, 1, sem="release", scope="gpu")


def main() -> None:
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    BN, BK = 16, 256
    D = 5120
    rows = 4 * 2**30 // (2 * D) // BN * BN
    w = torch.randn(rows, D, device="cuda").to(torch.bfloat16)
    x, out = torch.randn(D, device="cuda"), torch.empty(rows, device="cuda")
    us = time_graph_launches([lambda w=w: _chain_kernel[(rows // BN,)](w, x, out, out, out, D, 0, BN=BN, BK=BK, MODE=0)], reps=5)
    print(f"sustained read: {w.numel() * 2 / 2**30:.1f} GiB in {us:.0f} us, {w.numel() * 2 / us / 1e6:.2f} TB/s", flush=True)
    del w
    for D in (5120, 3584, 2048, 1024, 512):
        ws = [torch.randn(D, D, device="cuda").to(torch.bfloat16) for _ in range(LAUNCHES)]
        vecs = torch.randn(LAUNCHES + 1, D, device="cuda")
        cnt = torch.zeros(LAUNCHES + 1, device="cuda", dtype=torch.int32)
        P = D // BN
        line = []
        for name, mode in MODES.items():
            kw = dict(launch_pdl=True) if mode else {}

            def launch(i, mode=mode, kw=kw, ws=ws):  # (bound now: ws is deleted after the loop)
                _chain_kernel[(P,)](ws[i], vecs[i], vecs[i + 1], cnt[i], cnt[i + 1], D, P if i else 0,
                                    BN=BN, BK=BK, MODE=mode, num_warps=4, **kw)

            launches = [lambda: cnt.zero_()] + [lambda i=i: launch(i) for i in range(LAUNCHES)]
            us = time_graph_launches(launches) * len(launches) / LAUNCHES
            line.append(f"{name} {us:6.2f} us ({D * D * 2 / us / 1e6:5.2f} TB/s)")
        print(f"D {D:5d} ({D * D * 2 / 1e6:5.1f} MB, {P} programs): " + "  ".join(line), flush=True)
        del ws


if __name__ == "__main__":
    main()
