"""Element-wise functions that several Triton kernels share."""

from ._triton import jit, tl


@jit
def softplus(v):
    """log(1 + exp(v)), and v itself above 20, where they agree in float32 (as torch's
    F.softplus with its default threshold): the step size of every SSM kernel."""
    return tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(v)))
