"""Triton when it is installed; otherwise a stand-in so that kernel files still import.

A CPU-only install runs only the `_ref` twins, so the kernels themselves are never called
there; the stand-in `jit` leaves each kernel as a plain (unused) Python function.
"""

import os

# Under TRITON_INTERPRET=1 (kernels run on the CPU, as in CI) tl.dot of 16-bit operands
# returns garbage in the interpreter, so kernels take this flag and upcast the (already
# rounded) operands there: the same products, exact in float32.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

try:
    import triton
    import triton.language as tl

    jit = triton.jit
    HAVE_TRITON = True
    INTERPRET = tl.constexpr(_INTERPRET)  # a global that jit code may read must be constexpr
except ImportError:  # CPU-only install
    import types

    triton = None
    tl = types.SimpleNamespace(constexpr=lambda value=None: value)  # module constants stay plain values
    HAVE_TRITON = False
    INTERPRET = _INTERPRET

    def jit(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)
