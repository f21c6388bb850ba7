"""Workarounds for Triton's interpreter (TRITON_INTERPRET=1), which the CPU suite runs the
kernels in: faster folds, products that round a row alike wherever it sits in a tile, and
bfloat16 casts that round as the GPU's do.
Installed by conftest.py before any test runs. Written against the interpreter of the
Triton versions in TESTED; on another version each patch applies only where the
interpreter has the same shape (feature checks), and a warning says so.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import numpy as np

TESTED = ("3.6", "3.9")  # major.minor of the Triton versions these patches were checked on


# The interpreter runs a tl.associative_scan or tl.reduce with a custom combine element by
# element, a Python call each: most of the CPU suite's time went there (the one-pass
# selective scan, the sampler's reductions). These replacements make the same combines in
# the same order (each position onto the result before it, along the axis), one slice
# across the axis at a time, the slice's other elements side by side in numpy.


def _fold_slices(op, input, axis):
    """Yields the result at each position along `axis`: the slices combined in order."""
    arrays = [arg.handle.data for arg in input]
    acc = None
    for k in range(arrays[0].shape[axis]):
        here = tuple(op.to_tensor(np.take(a, k, axis=axis), arg.dtype) for a, arg in zip(arrays, input))
        if acc is None:
            acc = here
        else:
            combined = op.combine_fn.fn(*acc, *here)
            acc = combined if isinstance(combined, tuple) else (combined,)
        yield acc


def _scan_slices(self, input):
    outs = [np.empty_like(arg.handle.data) for arg in input]
    for k, acc in enumerate(_fold_slices(self, input, self.axis)):
        for out, v in zip(outs, acc):
            view = np.moveaxis(out, self.axis, 0)[k]
            view[...] = np.reshape(v.handle.data, view.shape)
    return [self.to_tensor(out, arg.dtype) for out, arg in zip(outs, input)]


def _reduce_slices(self, input):
    input, axis = self.unravel(input, self.axis)
    *_, acc = _fold_slices(self, input, axis)  # the last position's result
    ret = []
    for v, arg in zip(acc, input):
        a = arg.handle.data
        data = np.reshape(v.handle.data, a.shape[:axis] + a.shape[axis + 1 :]).astype(a.dtype)
        if self.keep_dims:  # as the interpreter's own reduction shapes its results
            data = np.expand_dims(data, axis) if self.axis is not None else np.reshape(data, (1,) * a.ndim)
        elif self.axis is None:
            data = data.item()
        ret.append(self.to_tensor(data, arg.dtype))
    return ret


# The interpreter also patches triton.language anew (every builtin of the modules it finds in
# the function's globals, through inspect.getmembers) at each call of a @jit helper inside a
# kernel, though the launch patched those modules already: ~40% of the sampler tests. These
# wrappers patch each module once a launch: inside a launch, a helper whose language modules
# are patched already gets an empty scope, and one that sees another module (the standard
# library's helpers use triton.language.core) patches as before. Outside a launch nothing
# changes.


def _patch_lang_once(interpreter):
    patch, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    languages = (interpreter.tl, interpreter.tl.core)
    patched = []  # while a launch runs: the ids of the language modules patched for it

    def patch_lang(fn):
        mods = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in languages}
        if patched and mods <= patched[-1]:
            return interpreter._LangPatchScope()
        scope = patch(fn)
        if patched:
            patched[-1].update(mods)
        return scope

    def run_launch(self, *args, **kwargs):
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = run_launch


def _round_to_bfloat16(data: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bits (uint16, as the interpreter holds bfloat16),
    rounded to nearest even."""
    import torch

    values = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def install() -> None:
    """Patches the interpreter in place (call before the first kernel runs)."""
    try:
        import triton
        from triton.runtime import interpreter
    except ImportError:
        return
    if ".".join(triton.__version__.split(".")[:2]) not in TESTED:
        warnings.warn(f"tests/triton_interpreter.py was written for Triton {', '.join(TESTED)}, "
                      f"not {triton.__version__}: its patches apply only where the interpreter matches")
    # (an interpreter laid out otherwise keeps its own)
    if hasattr(getattr(interpreter, "ScanOps", None), "generic_scan"):
        interpreter.ScanOps.generic_scan = _scan_slices
    if hasattr(getattr(interpreter, "ReduceOps", None), "generic_reduce"):
        interpreter.ReduceOps.generic_reduce = _reduce_slices
    if all(hasattr(interpreter, a) for a in ("_patch_lang", "_LangPatchScope", "GridExecutor", "tl")):
        _patch_lang_once(interpreter)
    # It checks every 32-bit integer add, subtract and multiply for overflow (each operand
    # cast to 64 bits, the result compared and asserted): ~25% of the scan tests' time. No
    # index of these tests' tiny shapes comes near 2^31, and the compiled kernels never check.
    # Its tl.dot is numpy's float32 matmul, whose rounding of a row can depend on the row's
    # place in the tile (BLAS handles edge rows with other kernels), while the compiled
    # kernels sum every row in one order: the batch-invariance tests compare a row at two
    # places. Products summed in float64 (each one exact) and rounded once are a row's own.
    builder_class = type(getattr(interpreter, "interpreter_builder", None))
    if hasattr(builder_class, "create_dot"):
        float_dot = builder_class.create_dot

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            if not a.data.dtype == b.data.dtype == d.data.dtype == np.float32:
                return float_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
            exact = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)) + d.data
            return interpreter.TensorHandle(exact.astype(np.float32), d.dtype.scalar)

        builder_class.create_dot = create_dot
    # Its float32 -> bfloat16 cast cuts the low bits off, where the compiled kernels round to
    # nearest even: a one-way error twice as large, which the accuracy tests would charge to
    # the kernels. torch's cast rounds as the GPU does.
    if hasattr(builder_class, "cast_impl"):
        cast = builder_class.cast_impl

        def cast_impl(self, src, dst_type):
            if src.dtype.scalar == interpreter.tl.float32 and dst_type.scalar == interpreter.tl.bfloat16:
                return interpreter.TensorHandle(_round_to_bfloat16(src.data), dst_type.scalar)
            return cast(self, src, dst_type)

        builder_class.cast_impl = cast_impl
    options = getattr(getattr(interpreter, "interpreter_builder", None), "options", None)
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow"):
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)
