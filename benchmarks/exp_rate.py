"""The GPU's rate of float32 exp2 (the special-function unit behind the scan's decays),
measured with many independent exp2 chains a thread, against which the chunked scan's
passes are compared: each runs one exp2 per state and step.

    python benchmarks/exp_rate.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench  # noqa: E402


@triton.jit
def _exp_chains_kernel(out_ptr, ITERS: tl.constexpr, BE: tl.constexpr, NP: tl.constexpr):
    # BE x NP independent chains v -> exp2(v * -0.75) (values stay in (0, 1]); as the scan's
    # pass 1 holds 4 channels x 16 states a thread at BE = 128 with one warp.
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    v = (e[:, None] + tl.arange(0, NP)[None, :]).to(tl.float32) * 1e-6
    for _ in range(ITERS):
        v = tl.exp2(v * -0.75)
    tl.store(out_ptr + e[:, None] * NP + tl.arange(0, NP)[None, :], v)


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    ITERS, BE, NP = 1024, 128, 16
    for programs in (props.multi_processor_count * 8, props.multi_processor_count * 32):
        out = torch.empty(programs * BE * NP, device="cuda")
        ms = do_bench(lambda: _exp_chains_kernel[(programs,)](out, ITERS=ITERS, BE=BE, NP=NP, num_warps=1), warmup=5, rep=50)
        n = programs * BE * NP * ITERS
        print(f"{programs} one-warp programs, {BE * NP // 32} chains a thread: {n / ms / 1e9:.2f} T exp2/s "
              f"({n / ms / 1e9 / props.multi_processor_count * 1e3:.1f} G/s an SM)", flush=True)


if __name__ == "__main__":
    main()
