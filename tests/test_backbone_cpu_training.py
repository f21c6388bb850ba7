"""The CPU's training scan (kernels/scan_grad.step_and_scan_train_ref, a Mamba-1 Backbone's
sequence pass off the GPU): its values and every gradient against autograd through the
reference's time loop (step_and_scan_ref) in float64, over several chunks and with resets at a
chunk's first step, inside one and at the last step; a gradcheck; and the Backbone taking it.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import outputs_and_grads

from fastmamba import Backbone, BackboneConfig
from fastmamba.engine import backbone_ops
from fastmamba.kernels.scan_grad import step_and_scan_train_ref as train_scan
from fastmamba.kernels.selective_scan import step_and_scan_ref

R = 3  # dt_rank
step_and_scan_train_ref = partial(train_scan, chunk_elements=1)  # the fewest steps a chunk: 4


def scan_inputs(B, E, N, T, seed):
    """x, dt_proj's input, weight and bias, A, B, C, D, z, state (float64)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return [r(B, E, T), r(B, T, R), r(E, R), 0.5 * r(E) - 1, -torch.rand(E, N, generator=g, dtype=torch.float64) - 0.2,
            r(B, N, T), r(B, N, T), r(E), r(B, E, T), r(B, E, N)]


def resets_at(B, T, steps: list[tuple[int, int]]) -> torch.Tensor:
    r = torch.zeros(B, T, dtype=torch.bool)
    for b, t in steps:
        r[b, t] = True
    return r


@pytest.mark.parametrize("with_resets", [False, True])
def test_values_and_gradients_equal_autograd_through_the_time_loop(with_resets):
    """T = 23 in chunks of 4 (the last one short): y, the final state and the gradients of a
    weighted sum of both, for every input and the start state."""
    B, E, N, T = 3, 5, 4, 23
    inputs = scan_inputs(B, E, N, T, seed=1)
    # a reset at step 0 (row 0), at a chunk's first step and inside a chunk (row 1), at the last (row 2)
    resets = resets_at(B, T, [(0, 0), (1, 8), (1, 10), (2, T - 1)]) if with_resets else None
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(B, E, T, generator=g, dtype=torch.float64),
               torch.randn(B, E, N, generator=g, dtype=torch.float64)]

    def scan(fn):
        def call(*args):
            s = args[-1].clone()
            return fn(*args[:-1], s, resets=resets), s
        return call

    (y, s), grads = outputs_and_grads(scan(step_and_scan_train_ref), inputs, weights)
    (y_ref, s_ref), grads_ref = outputs_and_grads(scan(step_and_scan_ref), inputs, weights)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip("x dt_r dt_w dt_b A B C D z state".split(), grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    if with_resets:  # a reset at row 0's first step: nothing reaches its start state
        assert not grads[-1][0].any() and grads[-1][1].abs().sum() > 0


def test_gradcheck():
    inputs = [t.requires_grad_() for t in scan_inputs(2, 3, 2, 9, seed=3)]
    resets = resets_at(2, 9, [(1, 4)])

    def scan(*args):
        s = args[-1].clone()
        return step_and_scan_train_ref(*args[:-1], s, resets=resets), s

    assert torch.autograd.gradcheck(scan, inputs)


def test_the_backbone_trains_on_the_cpu_through_it():
    """A Mamba-1 Backbone's sequence pass on the CPU takes it; its gradients are those of the
    reference ops' (autograd through the time loop)."""
    from fastmamba.core.ops import REFERENCE_OPS

    torch.manual_seed(0)
    bb = Backbone(BackboneConfig(input_dim=6, d_model=16, n_layer=2, d_state=8))
    x = torch.randn(3, 70, 6)
    resets = torch.zeros(3, 70, dtype=torch.bool)
    resets[1, 33] = True
    state = bb.new_state(3)
    assert bb._kernel_ops(x.requires_grad_(), state).scan.func is train_scan
    found = []
    for ops in (backbone_ops.CPU_SEQUENCE_OPS, REFERENCE_OPS):
        bb._kernel_ops = lambda x, s, ops=ops: ops
        bb.zero_grad()
        y, new = bb(x, state, resets)
        (y.square().mean() + new.ssm.sum()).backward()
        found.append([y.detach()] + [p.grad.clone() for p in bb.parameters()])
    for a, b in zip(*found):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_gradient_of_a_gradient_is_the_time_loops():
    """A gradient penalty (the input's gradient, differentiated again): create_graph takes
    the reference's time loop under autograd, so the second derivatives are its own."""
    inputs = scan_inputs(2, 3, 2, 9, seed=4)
    resets = resets_at(2, 9, [(0, 3)])
    found = []
    for fn in (step_and_scan_train_ref, step_and_scan_ref):
        leaves = [t.clone().requires_grad_() for t in inputs]
        s = leaves[-1].clone()
        y = fn(*leaves[:-1], s, resets=resets)
        (gx,) = torch.autograd.grad((y.square().sum() + s.sum()), leaves[0], create_graph=True)
        gx.square().sum().backward()
        found.append([gx.detach()] + [t.grad for t in leaves])
    for a, b in zip(*found):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_gradient_penalty_through_the_backbone_from_a_zero_state():
    """create_graph through the Backbone's pass with no state given (nothing of the start
    state needs a gradient): the input's gradient, then its square's gradients."""
    torch.manual_seed(0)
    bb = Backbone(BackboneConfig(input_dim=4, d_model=8, n_layer=1, d_state=4))
    x = torch.randn(2, 6, 4, requires_grad=True)
    y, _ = bb(x)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    gx.square().sum().backward()
    assert torch.isfinite(gx).all() and gx.abs().sum() > 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in bb.parameters())
    assert bb.layers[0].mixer.A_log.grad.abs().sum() > 0  # (through the scan's second derivatives)
