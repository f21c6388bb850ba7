"""tl.associative_scan and tl.reduce with custom combines, as the kernels use them (the
one-pass selective scan's recurrence, the samplers' reductions): on the CPU they run
conftest.py's slice-at-a-time replacements of the interpreter's fallbacks, which must
give what the plain loops give."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from fastmamba.kernels._triton import jit, tl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@jit
def _then(a_left, b_left, a_right, b_right):
    # s -> a s + b, the left step first
    return a_left * a_right, b_left * a_right + b_right


@jit
def _larger_then_lower(v_left, i_left, v_right, i_right):
    right = (v_right > v_left) | ((v_right == v_left) & (i_right < i_left))
    return tl.where(right, v_right, v_left), tl.where(right, i_right, i_left)


@jit
def _folds_kernel(a_ptr, b_ptr, s_ptr, v_ptr, i_ptr, T: tl.constexpr, E: tl.constexpr):
    offs = tl.arange(0, T)[:, None] * E + tl.arange(0, E)[None, :]
    a, b = tl.load(a_ptr + offs), tl.load(b_ptr + offs)
    s = tl.associative_scan((a, b), 0, _then)[1]  # the recurrence from s = 0, down the rows
    tl.store(s_ptr + offs, s)
    cols = tl.broadcast_to(tl.arange(0, E)[None, :], (T, E))
    v, i = tl.reduce((b, cols), 1, _larger_then_lower)  # each row's largest, ties to the lower column
    tl.store(v_ptr + tl.arange(0, T), v)
    tl.store(i_ptr + tl.arange(0, T), i)


def test_custom_scan_and_reduce_equal_their_loops():
    T, E = 16, 8
    g = torch.Generator().manual_seed(0)
    a = torch.rand(T, E, generator=g)
    b = torch.randint(-3, 4, (T, E), generator=g).float()  # small integers: ties in every row
    s, v, i = torch.empty(T, E), torch.empty(T), torch.empty(T, dtype=torch.int32)
    out = [x.to(DEVICE) for x in (s, v, i)]
    _folds_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), *out, T=T, E=E)
    s, v, i = (x.cpu() for x in out)

    state, expected = torch.zeros(E), []
    for t in range(T):
        state = a[t] * state + b[t]
        expected.append(state)
    assert torch.allclose(s, torch.stack(expected), rtol=1e-5, atol=1e-6)
    assert torch.equal(v, b.max(1).values)
    assert torch.equal(i.long(), (b == b.max(1, keepdim=True).values).float().argmax(1))  # the first of the ties
