"""Triton when it is installed; otherwise a stand-in so that kernel files still import.

A CPU-only install runs only the `_ref` twins, so the kernels themselves are never called
there; the stand-in `jit` leaves each kernel as a plain (unused) Python function.
"""

try:
    import triton
    import triton.language as tl

    jit = triton.jit
    HAVE_TRITON = True
except ImportError:  # CPU-only install
    import types

    triton = None
    tl = types.SimpleNamespace(constexpr=None)
    HAVE_TRITON = False

    def jit(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)
