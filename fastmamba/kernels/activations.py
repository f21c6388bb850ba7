"""Element-wise functions that several Triton kernels share."""

from ._triton import jit, tl


@jit
def softplus(v):
    """log(1 + exp(v)), and v itself above 20, where they agree in float32 (as torch's
    F.softplus with its default threshold): the step size of every SSM kernel."""
    return tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(v)))


@jit
def exp2_fma(x):
    """2^x for x <= 0 on the float32 pipes, none of it on the special-function unit (MUFU),
    whose exp2 rate (16 a clock an SM) bounds the scan: a kernel that runs some of its exps
    here and the rest there gets more of them a clock. x = i + f with i an integer and f in
    [-1/2, 1/2]: 2^f from a polynomial, 2^i added to its exponent bits. Below -125 (2^-125
    ~ 2e-38, where the exponent bits would underflow) it returns 2^-125."""
    x = tl.maximum(x, -125.0)
    j = x + 12582912.0  # 1.5 * 2^23: the sum rounds x to an integer, held in j's low bits
    f = x - (j - 12582912.0)
    # 2^f, degree 5, fitted for relative error: 2.4e-7 at most in float32 (MUFU.EX2's ~1.7e-7)
    p = 0.0013276570243760943 * f + 0.009675542823970318
    p = p * f + 0.05550713092088699
    p = p * f + 0.24022120237350464
    p = p * f + 0.6931469440460205
    p = p * f + 1.0000001192092896
    # j's bits are 0x4B400000 + i: shifted by the 23 mantissa bits, the constant's part
    # leaves the 32 bits and i << 23 remains
    return (p.to(tl.int32, bitcast=True) + (j.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)
