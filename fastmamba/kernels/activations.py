"""Element-wise functions that several Triton kernels share."""

from ._triton import INTERPRET, jit, tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@jit
def _log2_approx(w):
    """log2 of a float32 by the hardware's approximation (~1e-7 absolute error, two
    instructions), where tl.log and tl.log2 lower to libdevice's ~30-instruction polynomial."""
    if INTERPRET:  # (no PTX to run on the CPU)
        return tl.log2(w)
    else:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [w], dtype=tl.float32, is_pure=True, pack=1)


@jit
def _reciprocal_approx(w):
    """1 / w by the hardware's approximation (within 1 ulp), where a float32 division adds
    range checks and a rescaling for denominators past 2^126."""
    if INTERPRET:
        return 1.0 / w
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [w], dtype=tl.float32, is_pure=True, pack=1)


@jit
def silu(v):
    """v * sigmoid(v) = v / (1 + exp(-v)), the conv's activation and the SSM's gate. tl.sigmoid
    is the same reciprocal of the same exp, plus range checks whose cases (v below -87, where
    both give v times 0 to float32's precision) the gate never meets: pass 2 of the chunked
    scan runs 898 instructions a two-step iteration against 964, 1-1.5% faster, its outputs
    bitwise the same."""
    return v * _reciprocal_approx(1.0 + tl.exp2(v * -LOG2E))


@jit
def softplus(v):
    """log(1 + exp(v)), and v itself above 20, where they agree in float32 (as torch's
    F.softplus with its default threshold): the step size of every SSM kernel.

    log1p(u), u = exp(v), as log2(1 + u) ln 2 where u >= 1/32: there the result is >= 0.03
    and lg2.approx's absolute error stays within 5e-6 of it (measured on an H200). Below,
    where 1 + u would lose u's low bits, four terms of log1p's series: the next, u^5 / 5,
    is within 2e-7 of u."""
    u = tl.exp2(v * LOG2E)
    series = u * (1.0 - u * (0.5 - u * (0.3333333333333333 - u * 0.25)))
    log1p = tl.where(u >= 0.03125, _log2_approx(1.0 + u) * LN2, series)
    return tl.where(v > 20.0, v, log1p)


@jit
def activate(x, ACT: tl.constexpr):
    """An MLP's activation by name (constexpr): "silu", or "relu2", the squared ReLU
    (Nemotron-H's): the dense MLP's and the experts' kernels'."""
    if ACT == "silu":
        return silu(x)
    else:
        y = tl.maximum(x, 0.0)
        return y * y
