"""The training kernels (kernels/scan_grad.py, kernels/conv_grad.py): forward and backward
against autograd through the reference ops in float64, a gradcheck of each Function, and the
whole Backbone's gradients through them against the CPU's.

Without CUDA the kernels run in Triton's interpreter (conftest), at tiny shapes.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import backbone_sequence, outputs_and_grads

from fastmamba import Backbone, BackboneConfig
from fastmamba.kernels.causal_conv1d import causal_conv1d_ref
from fastmamba.kernels.selective_scan import step_and_scan_ref

pytest.importorskip("triton")
from fastmamba.engine.plan import CONV_GRAD_TILES, KERNEL_TILES, TRAIN_SCAN_TILES  # noqa: E402
from fastmamba.kernels.conv_grad import causal_conv1d_train  # noqa: E402
from fastmamba.kernels.scan_grad import step_and_scan_train  # noqa: E402

TRAIN_BT = TRAIN_SCAN_TILES.bt  # the chunks the training scan saves its states at

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# compiled, the kernels' exp, log and reciprocal are the hardware's approximations
TOL = 1e-4 if DEVICE == "cuda" else 1e-5


def rel_err(a, b) -> float:
    assert torch.isfinite(a).all()
    return ((a.double().cpu() - b.cpu()).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def reset_flags(B: int, T: int, where: str) -> torch.Tensor | None:
    """Resets at the first step (row 0), inside a chunk and at a chunk's first step (row 1),
    at the last step (row 2)."""
    if where == "none":
        return None
    r = torch.zeros(B, T, dtype=torch.bool)
    r[0, 0] = True
    r[1 % B, min(T - 1, 5)] = True
    r[1 % B, min(T - 1, TRAIN_BT)] = True
    r[2 % B, T - 1] = True
    return r.to(DEVICE)


# (B, E, N, T): one chunk; several, T not a multiple of the chunk; E past one program's
# channels, N not a power of two
SCAN_SHAPES = [(2, 4, 4, 9), (3, 10, 5, 2 * TRAIN_BT + 7), (1, 3, 2, TRAIN_BT)]
R = 3  # dt_rank


@pytest.mark.parametrize("B,E,N,T", SCAN_SHAPES)
@pytest.mark.parametrize("resets", ["none", "first, inside, last"])
def test_scan_forward_and_backward_match_the_float64_oracle(B, E, N, T, resets):
    g = torch.Generator().manual_seed(B * 100 + T)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    flags = reset_flags(B, T, resets)
    # x, dt_proj's input, weight and bias, A, B, C, D, z, state
    inputs = [r(B, E, T), r(B, T, R), r(E, R), 0.5 * r(E) - 1, -torch.rand(E, N, generator=g) - 0.2, r(B, N, T),
              r(B, N, T), r(E), r(B, E, T), r(B, E, N)]
    weights = [r(B, E, T), r(B, E, N)]  # on y and on the state after the last step

    def scan(fn):
        def call(x, dt_r, dt_w, dt_b, A, Bm, Cm, D, z, s):
            s = s.clone()
            return fn(x, dt_r, dt_w, dt_b, A, Bm, Cm, D, z, s, resets=flags), s
        return call

    ours, oracle = scan(partial(step_and_scan_train, tiles=TRAIN_SCAN_TILES)), scan(step_and_scan_ref)

    (y, s), grads = outputs_and_grads(ours, [t.to(DEVICE) for t in inputs], weights)
    (y64, s64), grads64 = outputs_and_grads(oracle, [t.double().to(DEVICE) for t in inputs], weights)
    assert rel_err(y, y64) < TOL and rel_err(s, s64) < TOL
    for name, a, b in zip("x dt_r dt_w dt_b A B C D z state".split(), grads, grads64):
        assert a.shape == b.shape and rel_err(a, b) < TOL, (name, rel_err(a, b))
    if flags is not None and bool(flags[0, 0]):  # a reset at step 0: nothing reaches the old state
        assert not grads[-1][0].any()


@pytest.mark.parametrize("K,T,bias", [(4, 2 * 32 + 5, True), (3, 2, False), (2, 1, True)])
@pytest.mark.parametrize("resets", ["none", "first, inside, last"])
def test_conv_forward_and_backward_match_the_float64_oracle(K, T, bias, resets):
    B, E = 3, 70  # E past one program's channels
    g = torch.Generator().manual_seed(K * 10 + T)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    flags = reset_flags(B, T, resets)
    inputs = [r(B, E, T), r(E, K), r(E), r(B, E, K)]  # x, weight, bias, state
    weights = [r(B, E, T), r(B, E, K)]

    def run(fn):
        def call(x, w, b, s):
            s = s.clone()
            return fn(x, w, b if bias else None, s, resets=flags), s
        return call

    (y, s), grads = outputs_and_grads(run(partial(causal_conv1d_train, tiles=CONV_GRAD_TILES)), [t.to(DEVICE) for t in inputs], weights)
    (y64, s64), grads64 = outputs_and_grads(run(causal_conv1d_ref), [t.double().to(DEVICE) for t in inputs], weights)
    assert rel_err(y, y64) < TOL and rel_err(s, s64) < TOL
    for name, a, b in zip(["x", "weight", "bias", "state"], grads, grads64):
        if name == "bias" and not bias:
            assert a is None and b is None
            continue
        assert a.shape == b.shape and rel_err(a, b) < TOL, (name, rel_err(a, b))


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")
def test_gradcheck_of_both_functions():
    """torch.autograd.gradcheck of each Function on its own forward. The kernels compute in
    float32, so in float32 with finite differences to match (eps 1e-3); the float64 oracle
    tests above hold them to 1e-5 (1e-4 compiled)."""
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE).requires_grad_(True)  # noqa: E731
    B, E, N, T = 1, 2, 2, 5
    flags = torch.tensor([[False, False, True, False, False]], device=DEVICE)

    def scan(x, dt_r, dt_w, dt_b, A, Bm, Cm, D, z, s):
        s = s.clone()
        return step_and_scan_train(x, dt_r, dt_w, dt_b, A, Bm, Cm, D, z, s, resets=flags, tiles=TRAIN_SCAN_TILES), s

    A = (-torch.tensor([[0.5, 1.0], [0.7, 0.3]], device=DEVICE)).requires_grad_(True)
    tol = dict(eps=1e-3, atol=2e-3, rtol=2e-2, nondet_tol=1e-6)
    assert torch.autograd.gradcheck(scan, (r(B, E, T), r(B, T, 1), r(E, 1), r(E), A, r(B, N, T), r(B, N, T), r(E),
                                           r(B, E, T), r(B, E, N)), **tol)

    def conv(x, w, b, s):
        s = s.clone()
        return causal_conv1d_train(x, w, b, s, resets=flags, tiles=CONV_GRAD_TILES), s

    assert torch.autograd.gradcheck(conv, (r(B, E, T), r(E, 3), r(E), r(B, E, 3)), **tol)


def test_the_backbone_trains_through_the_kernels_as_through_the_reference():
    """The whole Backbone's sequence pass with the training ops (as on CUDA under autograd)
    against the reference ops on the CPU: outputs and every gradient."""
    from fastmamba.core.ops import training_ops

    torch.manual_seed(0)
    cfg = BackboneConfig(input_dim=6, d_model=16, n_layer=2, d_state=8, d_conv=3)
    ref = Backbone(cfg)
    ours = Backbone(cfg, device=DEVICE)
    ours.load_state_dict(ref.state_dict())
    if DEVICE == "cpu":  # (on CUDA the backbone picks them itself: checked here)
        ours._kernel_ops = lambda x, state: training_ops(KERNEL_TILES)
    B, T = 3, 40
    x, resets, w = backbone_sequence(B, T)
    found = []
    for bb in (ref, ours):
        dev = bb.device
        state = bb.new_state(B)
        state.ssm.copy_(torch.randn(state.ssm.shape, generator=torch.Generator().manual_seed(3)))
        state.conv.copy_(torch.randn(state.conv.shape, generator=torch.Generator().manual_seed(4)))
        state.ssm.requires_grad_(True)
        state.conv.requires_grad_(True)
        xx = x.clone().to(dev).requires_grad_(True)  # (a leaf of its own on either device)
        if bb is ours and DEVICE == "cuda":
            assert bb._kernel_ops(xx, state).conv.func is causal_conv1d_train
        y, new = bb(xx, state, resets.to(dev))
        ((y * w.to(dev)).sum() + new.ssm.sum() + new.conv.square().sum()).backward()
        found.append({"y": y.detach(), "x": xx.grad, "ssm": state.ssm.grad, "conv": state.conv.grad,
                      **{k: p.grad for k, p in bb.named_parameters()}})
    assert [k for k, v in found[1].items() if v is None] == []
    for name, theirs in found[0].items():
        assert rel_err(found[1][name].float(), theirs.double()) < 1e-4, name
