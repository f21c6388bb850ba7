"""The Backbone's lockstep step (kernels/lockstep_step.py): the whole step in one launch,
its programs in lockstep through grid barriers. Without CUDA the kernel runs in Triton's
interpreter with one program a group (nothing for a barrier to wait for); with CUDA the
same tests run compiled with several programs a group, and the `gpu` ones through
Backbone.step's graphs."""

from __future__ import annotations

import pytest
import torch
from conftest import relative_error as rel_err
from test_backbone import make

from fastmamba import Backbone, BackboneConfig
from fastmamba.engine import plan

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def backbone(seed=0, device=DEVICE, dtype="float32", state_dtype="float32", **kw) -> Backbone:
    """test_backbone's `make` (its constants spread), on `device` in these dtypes."""
    ref = make(seed, **kw)
    bb = Backbone(ref.config, device=device, dtype=dtype, state_dtype=state_dtype)
    bb.load_state_dict(ref.state_dict())
    return bb


def lockstep(bb: Backbone, batch: int, rows: int, programs: int):
    """LockstepKernels in the plan's shape of `rows` rows a group, with `programs` programs."""
    from dataclasses import replace

    from fastmamba.engine.backbone_step import LockstepKernels

    shape = next(s for s in plan.LOCKSTEP_SHAPES if s.rows == rows)
    return LockstepKernels(bb, batch, replace(shape, channels=bb.config.d_inner // programs))


@pytest.mark.parametrize("rows,programs,batch", [(1, 2, 3), (1, 4, 1), (16, 2, 5), (16, 2, 19)])
@pytest.mark.parametrize("dtype,state_dtype", [("float32", "float32"), ("bfloat16", "float32"), ("float32", "bfloat16")])
@pytest.mark.parametrize("proj_bias,input_dim", [(True, 6), (False, 16)])
def test_the_lockstep_step_equals_the_reference_step(rows, programs, batch, dtype, state_dtype, proj_bias, input_dim):
    """Three steps of the kernel against Backbone's own step (the reference ops on the CPU)
    and against lockstep_step_ref: outputs and both states. Rows a group 1 (multiply-and-sum)
    and 16 (the tensor cores, a group partly empty: 5 rows; two groups: 19); with an
    input_proj and proj biases, and without either (input_dim = d_model)."""
    from fastmamba.kernels.lockstep_step import lockstep_step_ref

    bb = backbone(dtype=dtype, state_dtype=state_dtype, proj_bias=proj_bias, input_dim=input_dim)
    step = lockstep(bb, batch, rows, programs)
    ours, theirs, twins = bb.new_state(batch), bb.new_state(batch), bb.new_state(batch)
    x = torch.randn(3, batch, input_dim, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    # float32 throughout: float32 rounding (the tensor cores' tf32x3 products: a little more);
    # 16-bit weights or state: their rounding
    tol = (1e-5 if rows == 1 else 1e-4) if dtype == state_dtype == "float32" else 2e-2
    with torch.no_grad():
        layers = bb._layer_weights()
        ip = bb.input_proj
        for t in range(3):
            y = step(x[t], ours).clone()
            assert rel_err(y, bb._step_eager(x[t], theirs)) < tol, t
            y_ref = lockstep_step_ref(x[t], twins.conv, twins.ssm, layers, bb.norm_f.weight, bb.config.norm_eps,
                                      ip.weight if ip is not None else None, ip.bias if ip is not None else None)
            assert rel_err(y, y_ref) < tol, t
    for a, b in ((ours.conv, theirs.conv), (ours.ssm, theirs.ssm), (ours.ssm, twins.ssm)):
        assert rel_err(a.float(), b.float()) < tol


def test_the_lockstep_step_reads_the_parameters_in_place():
    """The kernel reads the parameters through their addresses: an optimizer's in-place
    update (A_log among them, which the decode kernels' step must be told of) shows at the
    next step with no sync."""
    bb = backbone()
    step = lockstep(bb, 2, 1, 2)
    s1, s2 = bb.new_state(2), bb.new_state(2)
    x = torch.randn(2, 6, device=DEVICE)
    with torch.no_grad():
        step(x, s1)
        bb._step_eager(x, s2)
        bb.layers[1].mixer.A_log.add_(0.5)
        bb.layers[0].mixer.in_proj.weight.mul_(1.5)
        assert rel_err(step(x, s1), bb._step_eager(x, s2)) < 1e-5


def test_the_lockstep_shapes_route_small_widths_and_the_rest_goes_to_the_decode_kernels():
    def route(config, batch, deterministic=False, sms=132):
        return plan.lockstep_route(config, torch.float32, batch, deterministic, sms, plan.LOCKSTEP_SHAPES)

    c128 = BackboneConfig(input_dim=64, d_model=128, n_layer=3)
    r = route(c128, 1)
    assert (r.rows, c128.d_inner // r.channels) == (1, 16)
    r = route(c128, 256)
    assert (r.rows, -(-256 // r.rows) * (c128.d_inner // r.channels)) == (16, 128)  # 128 programs: within 132
    assert route(c128, 1024) is None  # 512 programs: not all at once
    assert route(c128, 256, sms=100) is None  # a GPU (or MIG slice) of fewer multiprocessors
    assert route(c128, 1, deterministic=True) is None  # deterministic: the decode kernels' step
    assert route(BackboneConfig(input_dim=64, d_model=512, n_layer=4), 1) is None
    assert route(BackboneConfig(input_dim=64, d_model=128, n_layer=3, layer="mamba2"), 1) is None
    # the plan's own routes: the shapes where a GPU run has shown the lockstep step winning
    shapes = {(r.rows, r.channels, r.warps) for r in plan.LOCKSTEP_SHAPES}
    assert {(r.rows, r.channels, r.warps) for r in plan.LOCKSTEP_ROUTES} <= shapes
    assert plan.lockstep_route(c128, torch.bfloat16, 8, False, 132).rows == 1  # bf16 weights, batch 8
    assert plan.lockstep_route(c128, torch.float32, 8, False, 132) is None  # float32's one-row step wins there
    assert plan.lockstep_route(c128, torch.float32, 128, False, 132).rows == 16


def test_the_lockstep_step_refuses_what_it_cannot_hold_by_name():
    from fastmamba.kernels.lockstep_step import unfit

    c = BackboneConfig(input_dim=64, d_model=128, n_layer=3)
    assert unfit(c, torch.float32, 1, 16) is None
    assert "d_model 512 > 256" in unfit(BackboneConfig(input_dim=64, d_model=512, n_layer=1), torch.float32, 1, 16)
    assert "of 16 or more" in unfit(c, torch.float32, 16, 32)  # 8 channels a program: too few for the tensor cores
    assert "power-of-two" in unfit(c, torch.float32, 1, 3)
    assert "float8" in unfit(c, torch.float8_e4m3fn, 1, 16)
    with pytest.raises(ValueError, match="does not take this Backbone: d_state 64 > 32"):
        lockstep(backbone(d_state=64), 1, 1, 2)


# -- on the GPU, through Backbone.step ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 8, 16, 100, 256])
def test_gpu_the_step_runs_lockstep_and_equals_the_decode_kernels_step(dtype, batch, monkeypatch):
    """At 128 x 3 the lockstep shapes run the lockstep step (16 programs a row at batch 1 to 8, groups
    of 16 rows of 8 programs above): graph replays over many steps (the barriers' counters
    carry over from launch to launch) against KernelStep's, and two states given the same
    inputs stay bitwise equal (the shares are summed in a fixed order)."""
    from fastmamba.engine.backbone_step import KernelStep, LockstepKernels

    monkeypatch.setattr(plan, "LOCKSTEP_ROUTES", plan.LOCKSTEP_SHAPES)
    bb = backbone(device="cuda", dtype=dtype, input_dim=64, d_model=128, n_layer=3, d_state=16)
    kernels = KernelStep(bb, batch)
    ours, again, theirs = bb.new_state(batch), bb.new_state(batch), bb.new_state(batch)
    tol = 1e-4 if dtype == "float32" else 2e-2
    g = torch.Generator(device="cuda").manual_seed(3)
    for t in range(40):
        x = torch.randn(batch, 64, device="cuda", generator=g)
        y = bb.step(x, ours)
        if t == 0:
            assert isinstance(bb._last_graph.kernels, LockstepKernels)
        assert torch.equal(bb.step(x, again), y)
        with torch.no_grad():
            assert rel_err(y, kernels(x, theirs)) < tol, t
    assert rel_err(ours.ssm, theirs.ssm) < tol
    assert torch.equal(ours.ssm, again.ssm) and torch.equal(ours.conv, again.conv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_row_of_the_lockstep_step_is_the_same_at_every_batch_size_of_its_kind(monkeypatch):
    """A row's outputs do not depend on the other rows: bitwise the same at batches 1 and 8
    (a row a group) and at 16, 100 and 256 (groups of 16 rows)."""
    monkeypatch.setattr(plan, "LOCKSTEP_ROUTES", plan.LOCKSTEP_SHAPES)
    bb = backbone(device="cuda", input_dim=64, d_model=128, n_layer=3, d_state=16)
    x = torch.randn(256, 64, device="cuda")
    out = {}
    for batch in (1, 8, 16, 100, 256):
        s = bb.new_state(batch)
        for _ in range(3):
            y = bb.step(x[:batch], s)
        out[batch] = y[0].clone()
    assert torch.equal(out[1], out[8])
    assert torch.equal(out[16], out[100]) and torch.equal(out[16], out[256])
