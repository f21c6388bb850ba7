"""Where one layer's prefill time goes, operation by operation: each of the mixer's
operations timed alone (triton.testing.do_bench) at a public shape, with its bytes and
FLOPs and the rate they imply, and the sum over all layers against a whole prefill.

    python benchmarks/prefill_parts.py --model 2.8b --batch 1 --tokens 4096
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from fastmamba.bench import random_model  # noqa: E402
from fastmamba.kernels.causal_conv1d import causal_conv1d  # noqa: E402
from fastmamba.kernels.rmsnorm import add_norm  # noqa: E402
from fastmamba.kernels.selective_scan import selective_scan, step_and_scan  # noqa: E402
from fastmamba.kernels.step_size import step_size  # noqa: E402
from fastmamba.kernels.products import linear_storage  # noqa: E402
from fastmamba.core.model import Mamba  # noqa: E402
from fastmamba.core.mamba1 import in_proj_dtype  # noqa: E402
from fastmamba.core.ops import triton_ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="2.8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    base = random_model(args.model, torch.bfloat16)
    c, lw = base.config, base.weights.layers[0]
    B, T, d, E, N, R = args.batch, args.tokens, c.d_model, c.d_inner, c.d_state, c.dt_rank
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(B, T, d, device="cuda", generator=g)
    o = torch.randn(B, T, d, device="cuda", generator=g)
    conv_state = torch.zeros(B, E, c.d_conv, device="cuda")
    ssm_state = torch.zeros(B, E, N, device="cuda")

    # the mixer's operations in order (model.mixer), each input made by the one before
    _, u = add_norm(h, o, lw.norm_w, c.norm_eps, torch.bfloat16)
    xz_dtype = in_proj_dtype(lw.in_proj_w.dtype)  # (bf16: x and z in 2 bytes)
    xz = linear_storage(u, lw.in_proj_w, None, xz_dtype)
    x, z = xz.transpose(1, 2).split([E, E], dim=1)
    xc = causal_conv1d(x, lw.conv_w, lw.conv_b, conv_state, None, torch.bfloat16)
    dbc = linear_storage(xc.transpose(1, 2), lw.x_proj_w)
    dt_r, Bm, Cm = dbc.split([R, N, N], dim=-1)
    delta = step_size(dt_r, lw.dt_proj_w, lw.dt_bias)
    y = selective_scan(xc, delta.transpose(1, 2), lw.A, Bm.transpose(1, 2), Cm.transpose(1, 2), lw.D, z, ssm_state,
                       out_dtype=torch.bfloat16)
    M = B * T
    parts = [  # name, operation, bytes moved, FLOPs
        ("add + rmsnorm", lambda: add_norm(h, o, lw.norm_w, c.norm_eps, torch.bfloat16), M * d * (4 * 3 + 2), 0),
        ("in_proj (cuBLAS, bf16 out)", lambda: linear_storage(u, lw.in_proj_w, None, xz_dtype), M * (d * 2 + 2 * E * 2) + 2 * E * d * 2, 2 * M * d * 2 * E),
        ("  (f32 out)", lambda: linear_storage(u, lw.in_proj_w), M * (d * 2 + 2 * E * 4) + 2 * E * d * 2, 2 * M * d * 2 * E),
        ("conv", lambda: causal_conv1d(x, lw.conv_w, lw.conv_b, conv_state, None, torch.bfloat16), M * E * (2 + 2), 0),
        ("x_proj (cuBLAS)", lambda: linear_storage(xc.transpose(1, 2), lw.x_proj_w), M * (E * 2 + (R + 2 * N) * 4), 2 * M * E * (R + 2 * N)),
        ("step sizes + scan (step_and_scan)", lambda: step_and_scan(xc, dt_r, lw.dt_proj_w, lw.dt_bias, lw.A, Bm.transpose(1, 2),
                                                                     Cm.transpose(1, 2), lw.D, z, ssm_state, out_dtype=torch.bfloat16),
         M * E * (2 + 4 + 2 + 2), 0),
        ("  (step sizes, Triton)", lambda: step_size(dt_r, lw.dt_proj_w, lw.dt_bias), M * (R * 4 + E * 4), 2 * M * R * E),
        ("  (cuBLAS dt_proj alone)", lambda: linear_storage(dt_r, lw.dt_proj_w), M * (R * 4 + E * 4), 2 * M * R * E),
        ("  (scan from those step sizes)", lambda: selective_scan(xc, delta.transpose(1, 2), lw.A, Bm.transpose(1, 2),
                                                                 Cm.transpose(1, 2), lw.D, z, ssm_state, out_dtype=torch.bfloat16),
         M * E * (2 + 4 + 2 + 2), 0),
        ("out_proj (cuBLAS)", lambda: linear_storage(y.transpose(1, 2), lw.out_proj_w), M * (E * 2 + d * 4) + E * d * 2, 2 * M * E * d),
    ]
    print(f"{args.model} {B}x{T} bf16, one layer of {c.n_layer}:")
    total = 0.0
    for name, fn, nbytes, flops in parts:
        us = do_bench(fn, warmup=5, rep=50) * 1e3
        if not name.startswith("  "):  # alternatives, for comparison
            total += us
        rate = f"{nbytes / us / 1e6:6.2f} TB/s" + (f"  {flops / us / 1e6:6.1f} TFLOP/s" if flops else "")
        print(f"  {name:28s} {us:8.1f} us  {rate}", flush=True)
    print(f"  sum {total:.1f} us a layer, x {c.n_layer} layers = {total * c.n_layer / 1e3:.1f} ms")
    model = Mamba(c, base.weights, triton_ops())
    ids = torch.randint(0, c.vocab_size, (B, T), device="cuda")
    ms = do_bench(lambda: model.prefill(ids, model.new_state(B), last_only=True), warmup=1, rep=5)
    print(f"  whole prefill {ms:.1f} ms")


if __name__ == "__main__":
    main()
