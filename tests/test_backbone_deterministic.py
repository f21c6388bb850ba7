"""fastmamba.Backbone's deterministic mode (Backbone(deterministic=True): a row's outputs the
same bits at any batch size, the backward the same bits run to run) and mixed precision
(training under torch.autocast with float32 parameters).

On the CPU the training kernels' partial-sum paths (no atomics) and the deterministic ops run
in Triton's interpreter (conftest) at tiny shapes; the gpu-marked tests check the bits on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from conftest import backbone_sequence, outputs_and_grads

from fastmamba import Backbone, BackboneConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# compiled, the kernels' exp, log and reciprocal are the hardware's approximations
TOL = 1e-4 if DEVICE == "cuda" else 1e-5


def rel_err(a, b) -> float:
    assert torch.isfinite(a).all()
    return ((a.double().cpu() - b.double().cpu()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def config(layer: str, **kw) -> BackboneConfig:
    sizes = dict(head_dim=8, d_state=8, chunk_size=16) if layer == "mamba2" else dict(d_state=4)
    return BackboneConfig(**{"input_dim": 6, "d_model": 16, "n_layer": 2, "layer": layer, **sizes, **kw})


def _grads(fn, inputs, weights):
    """fn's outputs, then each input's gradient (conftest.outputs_and_grads), in one list."""
    outs, grads = outputs_and_grads(fn, inputs, weights)
    return outs + grads


# -- the training kernels' partial sums (no atomics), in the interpreter or on a GPU ---------


def some_resets(B: int, T: int, middle: int) -> torch.Tensor:
    """Resets on DEVICE: row 0 at its first step, row 1 at `middle`, row 2 at its last."""
    flags = torch.zeros(B, T, dtype=torch.bool)
    flags[0, 0] = flags[1, middle] = flags[2, T - 1] = True
    return flags.to(DEVICE)


def assert_partial_sums_match_the_atomics(call, inputs, weights, names, none=()):
    """call(deterministic) -> the kernel's function of `inputs`: its outputs and gradients (to
    `weights`' weighted sum) with the partial sums within TOL of the atomics', and the same
    bits over three runs; the gradients named in `none` are None on both paths."""
    on = [t.to(DEVICE) for t in inputs]
    atomics = _grads(call(False), on, weights)
    runs = [_grads(call(True), on, weights) for _ in range(3)]
    for name, a, b in zip(names, runs[0], atomics):
        if name in none:
            assert a is None and b is None, name
            continue
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))
    for run in runs[1:]:
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(run, runs[0]))


@pytest.mark.parametrize("resets", [False, True])
def test_scan_partial_sums_match_the_atomics_and_repeat_bitwise(resets):
    pytest.importorskip("triton")
    from fastmamba.engine.plan import TRAIN_SCAN_TILES
    from fastmamba.kernels.scan_grad import step_and_scan_train

    B, E, N, T, R = 3, 2 * TRAIN_SCAN_TILES.be + 3, 5, 2 * TRAIN_SCAN_TILES.bt + 5, 3  # several programs' channels
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    inputs = [r(B, E, T), r(B, T, R), r(E, R), 0.5 * r(E) - 1, -torch.rand(E, N, generator=g) - 0.2, r(B, N, T),
              r(B, N, T), r(E), r(B, E, T), r(B, E, N)]
    weights = [r(B, E, T), r(B, E, N)]
    flags = some_resets(B, T, 7) if resets else None

    def scan(deterministic):
        def call(x, dt_r, dt_w, dt_b, A, Bm, Cm, D, z, s):
            s = s.clone()
            y = step_and_scan_train(x, dt_r, dt_w, dt_b, A, Bm, Cm, D, z, s, resets=flags, tiles=TRAIN_SCAN_TILES,
                                    deterministic=deterministic)
            return y, s
        return call

    assert_partial_sums_match_the_atomics(scan, inputs, weights, "y state x dt_r dt_w dt_b A B C D z state0".split())


@pytest.mark.parametrize("bias,resets", [(True, False), (True, True), (False, True)])
def test_conv_partial_sums_match_the_atomics_and_repeat_bitwise(bias, resets):
    pytest.importorskip("triton")
    from fastmamba.engine.plan import CONV_GRAD_TILES
    from fastmamba.kernels.conv_grad import causal_conv1d_train

    B, E, K, T = 3, CONV_GRAD_TILES.be + 6, 4, 2 * CONV_GRAD_TILES.bt + 5  # several programs each way
    g = torch.Generator().manual_seed(6)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    inputs = [r(B, E, T), r(E, K), r(E), r(B, E, K)]
    weights = [r(B, E, T), r(B, E, K)]
    flags = some_resets(B, T, 2) if resets else None

    def conv(deterministic):
        def call(x, w, b, s):
            s = s.clone()
            y = causal_conv1d_train(x, w, b if bias else None, s, resets=flags, tiles=CONV_GRAD_TILES,
                                    deterministic=deterministic)
            return y, s
        return call

    assert_partial_sums_match_the_atomics(conv, inputs, weights, "y state x weight bias state0".split(),
                                          none=() if bias else ("bias",))


# -- the deterministic ops under a whole Backbone (as on CUDA), in the interpreter -----------


@pytest.mark.parametrize("layer", ["mamba1", "mamba2"])
def test_deterministic_ops_train_as_the_reference_and_repeat_bitwise(layer):
    """The sequence pass on backbone_ops.deterministic_ops (what deterministic mode runs on
    CUDA): outputs and every gradient within float32 tolerance of the reference ops', the
    same bits over three runs, and a row's outputs the same bits alone as in its batch."""
    pytest.importorskip("triton")
    from fastmamba.engine.backbone_ops import deterministic_ops

    torch.manual_seed(0)
    cfg = config(layer)
    ref = Backbone(cfg)
    ours = Backbone(cfg, device=DEVICE, deterministic=True)
    ours.load_state_dict(ref.state_dict())
    ops = deterministic_ops(layer)
    if DEVICE == "cpu":  # (on CUDA the backbone picks them itself)
        ours._kernel_ops = lambda x, state: ops
    B, T = 3, 20
    x, resets, w = backbone_sequence(B, T)

    def run(bb, rows=B):
        dev = bb.device
        bb.zero_grad()
        y, new = bb(x[:rows].to(dev), None, resets[:rows].to(dev))
        ((y * w[:rows].to(dev)).sum() + new.ssm.sum()).backward()
        return y.detach(), new.ssm.detach(), {k: p.grad.clone() for k, p in bb.named_parameters()}

    y_ref, s_ref, g_ref = run(ref)
    runs = [run(ours) for _ in range(3)]
    y, s, grads = runs[0]
    assert rel_err(y, y_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4
    for name, theirs in g_ref.items():
        assert rel_err(grads[name], theirs) < 1e-4, name
    for y2, s2, g2 in runs[1:]:
        assert torch.equal(y2, y) and torch.equal(s2, s) and all(torch.equal(g2[k], grads[k]) for k in grads)
    alone = run(ours, 1)
    assert torch.equal(alone[0], y[:1]) and torch.equal(alone[1], s[:, :1])


def test_deterministic_argument_errors():
    cfg = config("mamba1")
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="deterministic must be true or false"):
            Backbone(cfg, deterministic=bad)
    bb = Backbone(cfg)
    assert bb.deterministic is False
    with pytest.raises(ValueError, match="deterministic must be true or false"):
        bb.deterministic = "on"
    bb.deterministic = True
    assert bb.deterministic is True


def test_load_takes_deterministic(tmp_path):
    Backbone(config("mamba2")).save(tmp_path)
    assert Backbone.load(tmp_path, deterministic=True).deterministic is True
    assert Backbone.load(tmp_path).deterministic is False
    with pytest.raises(ValueError, match="deterministic must be true or false"):
        Backbone.load(tmp_path, deterministic="yes")


@pytest.mark.parametrize("layer", ["mamba1", "mamba2"])
def test_cpu_runs_repeat_bitwise(layer):
    """On the CPU (the mode changes nothing there) the sequence pass, its backward and the
    step are the same bits run to run."""
    torch.manual_seed(0)
    bb = Backbone(config(layer), deterministic=True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 12, 6, generator=g)
    resets = torch.rand(4, 12, generator=g) < 0.2
    found = []
    for _ in range(3):
        bb.zero_grad()
        y, new = bb(x, None, resets)
        (y.square().mean() + new.ssm.sum()).backward()
        state = bb.new_state(4)
        steps = [bb.step(x[:, t], state) for t in range(3)]
        found.append([y.detach(), *(p.grad.clone() for p in bb.parameters()), *steps, state.ssm, state.conv])
    for run in found[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, found[0]))


# -- mixed precision: training under autocast -----------------------------------------------


def _train_step(bb, x, resets, target, autocast: bool, device_type: str):
    """One training step's loss, gradients and the loss after an SGD step."""
    opt = torch.optim.SGD(bb.parameters(), lr=0.1)
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        y, new = bb(x, None, resets)
        loss = (y - target).square().mean() + 1e-3 * new.ssm.square().mean()
    assert y.dtype == torch.float32 and new.ssm.dtype == torch.float32
    loss.backward()
    grads = {k: p.grad.clone() for k, p in bb.named_parameters()}
    opt.step()
    with torch.no_grad(), torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        after = (bb(x, None, resets)[0] - target).square().mean()
    return loss.item(), grads, after.item()


def _check_autocast_step(layer: str, device: str, deterministic: bool = False):
    """bfloat16 autocast against float32: products with bfloat16 operands (each rounded to 8
    bits, ~0.4% relative) make outputs ~1% off; the loss, a mean over them, within 1%, and
    each parameter's gradient within 1% of the float32 one's direction (cosine > 0.99)."""
    torch.manual_seed(0)
    cfg = config(layer, input_dim=12, d_model=32, **({"head_dim": 16, "d_state": 16} if layer == "mamba2" else {}))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 24, 12, generator=g).to(device)
    resets = (torch.rand(4, 24, generator=g) < 0.1).to(device)
    target = torch.randn(4, 24, 32, generator=g).to(device)
    base = Backbone(cfg)
    found = {}
    for autocast in (False, True):
        bb = Backbone(cfg, device=device, deterministic=deterministic)
        bb.load_state_dict(base.state_dict())
        found[autocast] = _train_step(bb, x, resets, target, autocast, device)
    (loss32, g32, after32), (loss16, g16, after16) = found[False], found[True]
    assert abs(loss16 - loss32) < 1e-2 * loss32 and abs(after16 - after32) < 1e-2 * after32
    for name, ref in g32.items():
        ours = g16[name]
        assert ours.dtype == torch.float32 and torch.isfinite(ours).all(), name
        cos = torch.nn.functional.cosine_similarity(ours.flatten().double(), ref.flatten().double(), 0)
        assert cos > 0.99, (name, cos.item())


@pytest.mark.parametrize("layer", ["mamba1", "mamba2"])
def test_cpu_autocast_training_step_matches_float32(layer):
    _check_autocast_step(layer, "cpu")


def test_cpu_step_and_a_pass_without_autograd_ignore_autocast():
    """autocast applies where autograd needs the pass: the step and a no-grad pass keep the
    Backbone's own dtypes, so their bits are those without autocast."""
    for layer in ("mamba1", "mamba2"):
        torch.manual_seed(0)
        bb = Backbone(config(layer))
        x = torch.randn(3, 5, 6)
        plain, state = bb.new_state(3), bb.new_state(3)
        with torch.no_grad():
            y = bb(x)[0]
        ys = [bb.step(x[:, t], plain) for t in range(2)]
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            assert torch.equal(bb(x)[0], y)
            assert all(torch.equal(bb.step(x[:, t], state), ys[t]) for t in range(2))
        assert torch.equal(state.ssm, plain.ssm)


# -- on a GPU --------------------------------------------------------------------------------

BATCHES = (1, 5, 64, 256)


def _gpu_backbone(layer: str, dtype, deterministic=True):
    torch.manual_seed(0)
    cfg = BackboneConfig(input_dim=24, d_model=64, n_layer=2, layer=layer,
                         **({"head_dim": 32, "d_state": 32, "chunk_size": 64} if layer == "mamba2" else {}))
    return Backbone(cfg, device="cuda", dtype=dtype, deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", ["mamba1", "mamba2"])
def test_gpu_a_rows_outputs_are_the_same_bits_at_every_batch_size(layer, dtype):
    """Row 0 alone and inside batches of 5, 64 and 256 (the other rows random): the sequence
    pass's outputs and new state (with and without autograd, with resets) and three steps'
    outputs and state, bitwise."""
    bb = _gpu_backbone(layer, dtype)
    g = torch.Generator().manual_seed(3)
    T = 70  # (more than one chunk of the SSD's and the scans')
    x = torch.randn(max(BATCHES), T, 24, generator=g).cuda()
    resets = (torch.rand(max(BATCHES), T, generator=g) < 0.05).cuda()
    found = {}
    for B in BATCHES:
        with torch.no_grad():
            y, new = bb(x[:B], None, resets[:B])
        xg = x[:B].clone().requires_grad_(True)
        yg, newg = bb(xg, None, resets[:B])
        state = bb.new_state(B)
        steps = [bb.step(x[:B, t], state) for t in range(3)]
        found[B] = [y[:1], new.ssm[:, :1], new.conv[:, :1], yg[:1].detach(), newg.ssm[:, :1].detach(),
                    *(s[:1] for s in steps), state.ssm[:, :1], state.conv[:, :1]]
    for B in BATCHES[1:]:
        for i, (a, b) in enumerate(zip(found[B], found[1])):
            assert torch.equal(a, b), (B, i, (a.float() - b.float()).abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", ["mamba1", "mamba2"])
def test_gpu_backward_is_the_same_bits_run_to_run(layer, dtype):
    bb = _gpu_backbone(layer, dtype)
    g = torch.Generator().manual_seed(4)
    B, T = 64, 130
    x = torch.randn(B, T, 24, generator=g).cuda()
    resets = (torch.rand(B, T, generator=g) < 0.05).cuda()
    target = torch.randn(B, T, 64, generator=g).cuda()
    runs = []
    for _ in range(3):
        bb.zero_grad()
        state = bb.new_state(B)
        state.ssm.requires_grad_(True)
        xg = x.clone().requires_grad_(True)
        y, new = bb(xg, state, resets)
        ((y - target).square().mean() + new.ssm.square().mean()).backward()
        runs.append([y.detach(), xg.grad, state.ssm.grad, *(p.grad.clone() for p in bb.parameters())])
    for run in runs[1:]:
        for i, (a, b) in enumerate(zip(run, runs[0])):
            assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["mamba1", "mamba2"])
def test_gpu_deterministic_mode_trains_as_the_default(layer):
    """The deterministic path's outputs and gradients within float32 tolerance of the default
    path's (TF32x3 products against cuBLAS's float32 ones, other sums' orders): within 1e-3,
    or within twice the default path's own distance from the CPU's (the same parameters) where
    that is larger. (A gradient that sums many terms to near zero, as Mamba-2's per-head A, D
    and dt bias at 4 heads, carries either path's rounding as a large relative error: 1.2e-3
    between the two on an H100.)"""
    default, det = _gpu_backbone(layer, torch.float32, False), _gpu_backbone(layer, torch.float32, True)
    cpu = Backbone(default.config)
    cpu.load_state_dict({k: v.cpu() for k, v in default.state_dict().items()})
    found = []
    for bb in (default, det, cpu):
        device = next(bb.parameters()).device
        g = torch.Generator().manual_seed(5)
        x = torch.randn(8, 70, 24, generator=g).to(device)
        resets = (torch.rand(8, 70, generator=g) < 0.05).to(device)
        y, new = bb(x, None, resets)
        (y.square().mean() + new.ssm.sum()).backward()
        found.append([y.detach().cpu(), *(p.grad.cpu() for p in bb.parameters())])
    for on_default, on_det, on_cpu in zip(*found):
        assert rel_err(on_det, on_default) < max(1e-3, 2 * rel_err(on_default, on_cpu))


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("layer", ["mamba1", "mamba2"])
def test_gpu_autocast_training_step_matches_float32(layer, deterministic):
    _check_autocast_step(layer, "cuda", deterministic)


@pytest.mark.gpu
def test_gpu_step_ignores_autocast():
    for layer in ("mamba1", "mamba2"):
        bb = _gpu_backbone(layer, torch.float32, deterministic=False)
        x = torch.randn(4, 24, device="cuda")
        plain, state = bb.new_state(4), bb.new_state(4)
        y = bb.step(x, plain)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.equal(bb.step(x, state), y)

