"""The Backbone's fused step (kernels/backbone_step.py, one kernel a Mamba-1 layer; Triton's
interpreter without CUDA) against the CPU step's math and the decode kernels' step (KernelStep),
over several steps with resets between; the plan's choice of step; on CUDA, the graph step
at the issue's sizes.

Tolerances: float32 weights and state 1e-5 relative to the CPU step. 16-bit weights or a
bf16 state: the error against a float32 oracle (the same weights' values in float32, a
float32 state) within 1.5x the decode kernels' own."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fastmamba import Backbone, BackboneConfig
from fastmamba.engine.plan import BACKBONE_STEP, backbone_step_tiles

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a, b) -> float:
    assert torch.isfinite(a).all()
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def make(d_model=32, n_layer=2, input_dim=6, seed=0, device="cpu", **kw) -> Backbone:
    torch.manual_seed(seed)
    bb = Backbone(BackboneConfig(input_dim=input_dim, d_model=d_model, n_layer=n_layer, d_state=16, **kw), device=device)
    with torch.no_grad():  # spread the constants (norms 1, D 1) so that a misread would show
        for name, p in bb.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D")):
                p.add_(0.3 * torch.randn_like(p))
    return bb


def copy_of(bb: Backbone, device=DEVICE, dtype="float32", state_dtype="float32") -> Backbone:
    out = Backbone(bb.config, device=device, dtype=dtype, state_dtype=state_dtype)
    out.load_state_dict(bb.state_dict())
    out._step_plan = BACKBONE_STEP  # (the fused step's range, which the Backbone does not step by yet)
    return out


def run_steps(steps, x, resets):
    """Each (step, state) pair through the inputs x (T, B, I), state.reset(resets[t]) before
    step t (where given); returns each pair's outputs (T, B, d), each state after."""
    outs = [[] for _ in steps]
    with torch.no_grad():
        for t in range(x.shape[0]):
            for i, (step, state) in enumerate(steps):
                if resets[t] is not None:
                    state.reset(resets[t].to(state.conv.device))
                outs[i].append(step(x[t].to(state.conv.device), state).clone().cpu())
    return [torch.stack(o) for o in outs]


def inputs(T, B, dim, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, dim, generator=g)
    resets = [None] * T
    for t in (2, 4):
        resets[t] = torch.rand(B, generator=g) < 0.4  # some rows start afresh
    resets[4][0] = True
    return x, resets


def fused(bb: Backbone, batch: int):
    from fastmamba.engine.backbone_step import FusedStep, make_step

    step = make_step(bb, batch)
    assert isinstance(step, FusedStep), "the plan keeps the decode kernels here"
    return step


@pytest.mark.parametrize("d_model,n_layer,proj_bias,input_dim", [(32, 2, True, 6), (64, 3, False, 64)])
@pytest.mark.parametrize("batch", [1, 3, 37])
def test_float32_fused_step_equals_the_cpu_step(d_model, n_layer, proj_bias, input_dim, batch):
    """Float32 weights and state: the fused step's outputs and states are the CPU step's
    (the reference ops' math) within 1e-5, step after step, resets between; and the
    kernel's `_ref` twin is the CPU step's math."""
    from fastmamba.kernels.backbone_step import backbone_step_ref

    ref = make(d_model, n_layer, input_dim, proj_bias=proj_bias)
    bb = copy_of(ref)
    x, resets = inputs(5, batch, input_dim)
    s_fused, s_ref, s_twin = bb.new_state(batch), ref.new_state(batch), ref.new_state(batch)
    p = ref.input_proj

    def twin(x, state):
        return backbone_step_ref(x, p.weight if p else None, p.bias if p else None, ref._layer_weights(),
                                 ref.norm_f.weight, ref.config.norm_eps, state.conv, state.ssm)

    y_fused, y_ref, y_twin = run_steps([(fused(bb, batch), s_fused), (ref._step_eager, s_ref), (twin, s_twin)],
                                       x, resets)
    # (the twin walks the reference ops' sequence path at one step: the same math, its sums
    # in another order)
    assert rel_err(y_twin, y_ref) < 1e-6 and rel_err(s_twin.ssm, s_ref.ssm) < 1e-6
    assert rel_err(s_twin.conv, s_ref.conv) < 1e-6
    for t in range(x.shape[0]):
        assert rel_err(y_fused[t], y_ref[t]) < 1e-5, t
    assert rel_err(s_fused.ssm.cpu(), s_ref.ssm) < 1e-5 and rel_err(s_fused.conv.cpu(), s_ref.conv) < 1e-5


@pytest.mark.parametrize("dtype,state_dtype", [("bfloat16", "float32"), ("float32", "bfloat16"),
                                               ("bfloat16", "bfloat16"), ("float16", "float32")])
@pytest.mark.parametrize("batch", [17])  # (a whole tile of 16 rows and one row alone in the next)
def test_16bit_fused_step_within_the_decode_kernels_error(dtype, state_dtype, batch):
    """16-bit weights or a bf16 state: against a float32 oracle holding the same weights'
    values, the fused step's error is within 1.5x the decode kernels' (KernelStep's)."""
    from fastmamba.engine.backbone_step import KernelStep

    base = make(64, 3, 24)
    bb = copy_of(base, dtype=dtype, state_dtype=state_dtype)
    oracle = copy_of(bb, device="cpu")  # (the 16-bit values, now float32)
    x, resets = inputs(5, batch, 24)
    states = bb.new_state(batch), bb.new_state(batch), oracle.new_state(batch)
    y_fused, y_kernels, y_oracle = run_steps(
        [(fused(bb, batch), states[0]), (KernelStep(bb, batch), states[1]), (oracle._step_eager, states[2])], x, resets)
    for t in range(x.shape[0]):
        e_fused, e_kernels = rel_err(y_fused[t], y_oracle[t]), rel_err(y_kernels[t], y_oracle[t])
        assert e_fused <= 1.5 * e_kernels + 1e-6 and e_fused < 2e-2, (t, e_fused, e_kernels)
    for part in ("ssm", "conv"):
        e_fused = rel_err(getattr(states[0], part).cpu(), getattr(states[2], part))
        e_kernels = rel_err(getattr(states[1], part).cpu(), getattr(states[2], part))
        assert e_fused <= 1.5 * e_kernels + 1e-6 and e_fused < 2e-2, (part, e_fused, e_kernels)


def test_fused_step_follows_an_optimizers_update_of_A_log():
    """A is derived from A_log: sync() makes it anew after an in-place update."""
    ref = make(32, 2)
    bb = copy_of(ref)
    step = fused(bb, 3)
    x = torch.randn(3, 6).to(DEVICE)
    s, s_ref = bb.new_state(3), ref.new_state(3)
    with torch.no_grad():
        step(x, s)
        ref._step_eager(x.cpu(), s_ref)
        for m in (bb, ref):
            m.layers[1].mixer.A_log.add_(0.5)
        step.sync()
        assert rel_err(step(x, s).cpu(), ref._step_eager(x.cpu(), s_ref)) < 1e-5


def test_the_plan_chooses_the_fused_step_at_small_widths_only():
    """Mamba-1 up to d_model 256 and d_inner 512, every batch size, float32 and 16-bit weights;
    the decode kernels for the deterministic mode, wider models, Mamba-2, or no plan entry."""
    from fastmamba.engine.backbone_step import FusedStep, KernelStep, make_step

    def cfg(d, **kw):
        return BackboneConfig(input_dim=64, d_model=d, n_layer=3, **kw)

    for b in (1, 16, 256, 4096):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            t = backbone_step_tiles(cfg(128), dtype, b)
            assert t is not None and t.bm >= 16 and t.be >= 16, (b, dtype)
            assert backbone_step_tiles(cfg(256), dtype, b) is not None
            assert backbone_step_tiles(cfg(128), dtype, b, deterministic=True) is None
        for d, kw in ((512, {}), (288, {}), (256, dict(expand=4)), (128, dict(layer="mamba2"))):
            assert backbone_step_tiles(cfg(d, **kw), torch.bfloat16, b) is None, (d, kw)
        assert backbone_step_tiles(cfg(128), torch.bfloat16, b, plan=None) is None
    narrow = dataclasses.replace(BACKBONE_STEP, batches=(1, 16))
    assert backbone_step_tiles(cfg(128), torch.float32, 16, plan=narrow) is not None
    assert backbone_step_tiles(cfg(128), torch.float32, 17, plan=narrow) is None
    assert BACKBONE_STEP.reason
    # and make_step builds what the plan says, on the module's own settings: the decode kernels
    # by default (plan.BACKBONE_STEP_IN_USE), the fused step in BACKBONE_STEP's range
    assert isinstance(make_step(Backbone(make(32, 2).config, device=DEVICE), 3), KernelStep)
    bb = copy_of(make(32, 2))
    assert isinstance(make_step(bb, 3), FusedStep)
    bb._step_plan = None
    assert isinstance(make_step(bb, 3), KernelStep)
    bb._step_plan = BACKBONE_STEP
    bb.deterministic = True
    assert isinstance(make_step(bb, 3), KernelStep)


# -- on CUDA: the graph step at the sizes ---------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 256, 4096])
def test_gpu_fused_graph_step_at_128x3(dtype, batch):
    """d_model 128 x 3 layers: Backbone.step (the fused step's graph) bitwise the fused step
    run eagerly, within float32 tolerance of the CPU step (16-bit: within 1.5x the decode
    kernels' error against the float32 oracle), resets between steps, float32 and bf16 states."""
    from fastmamba.engine.backbone_step import FusedStep, KernelStep

    base = make(128, 3, 64)
    for state_dtype in ("float32", "bfloat16"):
        gpu = copy_of(base, "cuda", dtype, state_dtype)
        oracle = copy_of(gpu, device="cpu")
        eager, kernels = fused(gpu, batch), KernelStep(gpu, batch)
        x, resets = inputs(5, batch, 64)  # (resets before steps 2 and 4)
        states = [gpu.new_state(batch) for _ in range(3)] + [oracle.new_state(batch)]
        y_graph, y_eager, y_kernels, y_oracle = run_steps(
            [(gpu.step, states[0]), (eager, states[1]), (kernels, states[2]), (oracle._step_eager, states[3])], x, resets)
        assert isinstance(gpu._last_graph.kernels, FusedStep)
        assert torch.equal(y_graph, y_eager) and torch.equal(states[0].ssm, states[1].ssm)
        for t in range(x.shape[0]):
            e_fused, e_kernels = rel_err(y_graph[t], y_oracle[t]), rel_err(y_kernels[t], y_oracle[t])
            if dtype == state_dtype == "float32":
                assert e_fused < 1e-4, (t, e_fused)  # (TF32x3 products: ~2^-22 a product)
            else:
                assert e_fused <= 1.5 * e_kernels + 1e-6 and e_fused < 2e-2, (t, e_fused, e_kernels)
        assert rel_err(states[0].ssm.cpu(), states[3].ssm) <= max(1e-4, 1.5 * rel_err(states[2].ssm.cpu(), states[3].ssm))
