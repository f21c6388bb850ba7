"""fastmamba.Backbone with Mamba-2 layers (BackboneConfig(layer="mamba2")): its sequence pass
with resets against its step and transformers' Mamba2Model, the chunked SSD against the
sequential recurrence, gradients against a float64 oracle, its config's errors, state and
files; the GPU ops (Triton's interpreter without CUDA) against the CPU's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_backbone import assert_gradients_match_a_float64_oracle, graph_eager_and_cpu_steps

import fastmamba
from fastmamba import Backbone, BackboneConfig
from fastmamba.engine import backbone_mamba2
from fastmamba.kernels.ssd_grad import ssd_chunked, ssd_sequential_ref, step_sizes

TOL = 1e-5
SIZES = dict(input_dim=6, d_model=16, n_layer=2, layer="mamba2", head_dim=8, d_state=4, n_groups=2, chunk_size=4)


def rel_err(a, b) -> float:
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def make(seed=0, **kw) -> Backbone:
    torch.manual_seed(seed)
    bb = Backbone(BackboneConfig(**{**SIZES, **kw}))
    with torch.no_grad():  # spread the constants (norms 1, D 1) so a misread would show
        for name, p in bb.named_parameters():
            if name.endswith(("norm.weight", ".D")):
                p.add_(0.3 * torch.randn_like(p))
    return bb


def xs(B, T, dim=6, seed=1):
    return torch.randn(B, T, dim, generator=torch.Generator().manual_seed(seed))


def warm_state(bb: Backbone, B: int, seed=2):
    """A non-zero state before the sequence."""
    state = bb.new_state(B)
    g = torch.Generator().manual_seed(seed)
    return fastmamba.MambaState(*(torch.randn(t.shape, generator=g).to(t) for t in (state.conv, state.ssm)))


def steps(bb: Backbone, x, state, resets=None):
    """The sequence a step at a time, each reset by state.reset(mask) before its step."""
    ys = []
    for t in range(x.shape[1]):
        if resets is not None:
            state.reset(resets[:, t])
        ys.append(bb.step(x[:, t], state))
    return torch.stack(ys, 1)


def test_matches_transformers_mamba2_model():
    from transformers import Mamba2Config, Mamba2Model

    torch.manual_seed(0)
    hf = Mamba2Model(Mamba2Config(hidden_size=16, num_hidden_layers=2, state_size=4, num_heads=4, head_dim=8,
                                  n_groups=2, expand=2, conv_kernel=4, chunk_size=4, vocab_size=10,
                                  use_conv_bias=True, use_bias=True)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    bb = Backbone(BackboneConfig(**{**SIZES, "input_dim": 16}, proj_bias=True))
    bb.load_state_dict({k: v for k, v in hf.state_dict().items() if not k.startswith("embeddings.")})  # strictly
    x = xs(2, 11, 16)
    with torch.no_grad():
        ref = hf(inputs_embeds=x).last_hidden_state
    y, _ = bb(x)
    assert y.dtype == torch.float32 and rel_err(y, ref) < 1e-4


@pytest.mark.parametrize("chunk_size", [4, 64])  # chunks of 4 (and a part) over 11 steps, and one chunk
def test_steps_equal_the_sequence_with_resets_and_a_state(chunk_size):
    bb = make(chunk_size=chunk_size)
    x = xs(3, 11)
    resets = torch.zeros(3, 11, dtype=torch.bool)
    resets[0, 0] = True  # at the first step
    resets[1, 4] = resets[1, 6] = True  # at a chunk's first step, and inside one
    resets[2, 10] = True  # at the last
    with torch.no_grad():
        y, final = bb(x, warm_state(bb, 3), resets)
        state = warm_state(bb, 3)
        stepped = steps(bb, x, state, resets)
    assert rel_err(stepped, y) < TOL
    assert rel_err(state.ssm, final.ssm) < TOL and rel_err(state.conv, final.conv) < TOL
    with torch.no_grad():  # and in two passes, the second from the first's state
        y1, mid = bb(x[:, :5], warm_state(bb, 3), resets[:, :5])
        y2, end = bb(x[:, 5:], mid, resets[:, 5:])
    assert rel_err(torch.cat([y1, y2], 1), y) < TOL and rel_err(end.ssm, final.ssm) < TOL


@pytest.mark.parametrize("t0", [1, 2, 5, 8])  # inside the conv's window of the start, and past it
def test_a_reset_restarts_that_row_alone_from_zeros(t0):
    bb = make()
    x = xs(3, 11)
    resets = torch.zeros(3, 11, dtype=torch.bool)
    resets[1, t0] = True
    with torch.no_grad():
        y, final = bb(x, warm_state(bb, 3), resets)
        plain, plain_final = bb(x, warm_state(bb, 3))
        fresh, fresh_final = bb(x[1:2, t0:])  # row 1 from zeros at t0: a fresh env fed the same inputs
    assert rel_err(y[1, t0:], fresh[0]) < TOL
    assert rel_err(final.ssm[:, 1], fresh_final.ssm[:, 0]) < TOL and rel_err(final.conv[:, 1], fresh_final.conv[:, 0]) < TOL
    assert rel_err(y[1, :t0], plain[1, :t0]) < TOL  # before the reset, and the other rows: as without it
    assert rel_err(y[[0, 2]], plain[[0, 2]]) < TOL and rel_err(final.ssm[:, [0, 2]], plain_final.ssm[:, [0, 2]]) < TOL


def ssd_inputs(B=2, T=9, H=4, P=2, G=2, N=3, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return dict(x=r(B, T, H, P), dt=r(B, T, H), dt_bias=r(H), A=-torch.rand(H, generator=g, dtype=torch.float64) * 2,
                Bm=r(B, T, G, N), Cm=r(B, T, G, N), D=r(H), state=r(B, H, P, N))


def resets_of(B, T) -> torch.Tensor:
    resets = torch.zeros(B, T, dtype=torch.bool)
    resets[0, 0] = resets[0, 3] = True
    resets[1, 4] = resets[1, 5] = True
    return resets


def ssd_of(scan, chunk=None, resets=None):
    """The SSD from in_proj's raw step sizes through `scan` (chunked or sequential)."""
    def run(x, dt, dt_bias, A, Bm, Cm, D, state):
        dts = step_sizes(dt, dt_bias, (0.0, math.inf))
        args = (x, dts, A, Bm, Cm, D, state) + ((chunk,) if chunk is not None else ())
        return scan(*args, resets=resets)
    return run


@pytest.mark.parametrize("with_resets", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 4, 16])
def test_the_chunked_ssd_is_the_sequential_recurrence(chunk, with_resets):
    inp = ssd_inputs()
    resets = resets_of(2, 9) if with_resets else None
    y, s = ssd_of(ssd_chunked, chunk, resets)(*inp.values())
    y_ref, s_ref = ssd_of(ssd_sequential_ref, None, resets)(*inp.values())
    assert y.dtype == torch.float64 and rel_err(y, y_ref) < 1e-12 and rel_err(s, s_ref) < 1e-12
    # gradients: against autograd through the sequential recurrence
    leaves = [v.clone().requires_grad_(True) for v in inp.values()]
    leaves_ref = [v.clone().requires_grad_(True) for v in inp.values()]
    wy, ws = torch.randn_like(y), torch.randn_like(s)
    y, s = ssd_of(ssd_chunked, chunk, resets)(*leaves)
    ((y * wy).sum() + (s * ws).sum()).backward()
    y, s = ssd_of(ssd_sequential_ref, None, resets)(*leaves_ref)
    ((y * wy).sum() + (s * ws).sum()).backward()
    for name, ours, theirs in zip(inp, leaves, leaves_ref):
        assert rel_err(ours.grad, theirs.grad) < 1e-10, name


def test_the_chunked_ssd_passes_gradcheck():
    inp = ssd_inputs(B=2, T=6, H=2, P=2, G=1, N=2, seed=3)
    leaves = tuple(v.requires_grad_(True) for v in inp.values())
    assert torch.autograd.gradcheck(ssd_of(ssd_chunked, 4, resets_of(2, 6)), leaves)


def reference64(bb: Backbone, x, conv0, ssm0, resets):
    """The backbone's math written out plainly in float64, step by step (the oracle)."""
    c = bb.config
    p = {k: v.double() for k, v in bb.named_parameters()}
    h = x.double() @ p["input_proj.weight"].T + p["input_proj.bias"]
    B, T, _ = x.shape
    E, N, G, H, P = c.d_inner, c.d_state, c.n_groups, c.n_heads, c.head_dim

    def rms(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + c.norm_eps) * w

    for i in range(c.n_layer):
        q = lambda n: p[f"layers.{i}.mixer.{n}"]  # noqa: E731
        u = rms(h, p[f"layers.{i}.norm.weight"])
        zxbcdt = u @ q("in_proj.weight").T
        conv, s, outs = conv0[i].double(), ssm0[i].double().view(B, H, P, N), []
        A = -torch.exp(q("A_log"))
        for t in range(T):
            if resets is not None:
                keep = (~resets[:, t]).double()
                conv, s = conv * keep.view(B, 1, 1), s * keep.view(B, 1, 1, 1)
            z, xbc, dt = zxbcdt[:, t].split([E, E + 2 * G * N, H], -1)
            conv = torch.cat([conv[:, :, 1:], xbc[:, :, None]], -1)
            xbc = F.silu((conv * q("conv1d.weight")[:, 0]).sum(-1) + q("conv1d.bias"))
            xt, Bt, Ct = xbc.split([E, G * N, G * N], -1)
            xt = xt.view(B, H, P)
            Bt, Ct = (m.view(B, G, N).repeat_interleave(H // G, 1) for m in (Bt, Ct))
            dt = F.softplus(dt + q("dt_bias"))
            s = s * torch.exp(dt * A)[..., None, None] + (dt[..., None] * xt)[..., None] * Bt[:, :, None]
            y = ((s * Ct[:, :, None]).sum(-1) + q("D")[:, None] * xt).reshape(B, E) * F.silu(z)
            y = rms(y.view(B, G, E // G), 1.0).reshape(B, E) * q("norm.weight")
            outs.append(y)
        h = h + torch.stack(outs, 1) @ q("out_proj.weight").T
    return rms(h, p["norm_f.weight"])


@pytest.mark.parametrize("T", [9, 1])
def test_gradients_match_a_float64_oracle(T):
    bb = make(d_conv=3)
    assert_gradients_match_a_float64_oracle(bb, lambda: make(d_conv=3), reference64, xs(2, T), warm_state(bb, 2))


@pytest.mark.parametrize("kw,field", [
    (dict(layer="mamba3"), "BackboneConfig.layer"),
    (dict(head_dim=12), "BackboneConfig.head_dim 12 must divide d_inner"),  # d_inner 32
    (dict(n_groups=3), "BackboneConfig.n_groups 3 must divide the 4 heads"),
    (dict(head_dim=0), "BackboneConfig.head_dim must be a positive integer"),
    (dict(n_groups=True), "BackboneConfig.n_groups must be a positive integer"),
    (dict(chunk_size=0), "BackboneConfig.chunk_size must be a positive integer"),
    (dict(d_state=2.0), "BackboneConfig.d_state must be a positive integer"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        BackboneConfig(**{**SIZES, **kw})


def test_config_defaults_and_state_shapes():
    c = BackboneConfig(input_dim=6, d_model=128, n_layer=2, layer="mamba2")
    assert (c.d_state, c.head_dim, c.n_groups, c.chunk_size, c.n_heads) == (128, 64, 1, 256, 4)  # mamba_ssm's
    assert BackboneConfig(input_dim=6, d_model=16, n_layer=1).d_state == 16  # Mamba-1's stays
    assert BackboneConfig(input_dim=6, d_model=16, n_layer=1).layer == "mamba1"
    bb = make(d_conv=3)
    state = bb.new_state(5)
    # conv: x, B and C's last K inputs (E + 2GN); ssm: the H heads' (P, N) one after another (E = H x P)
    assert state.conv.shape == (2, 5, 32 + 2 * 2 * 4, 3) and state.ssm.shape == (2, 5, 32, 4)
    assert isinstance(state, fastmamba.MambaState) and state.conv.dtype == state.ssm.dtype == torch.float32
    with torch.no_grad():
        _, state = bb(xs(5, 4))
    before = (state.conv.clone(), state.ssm.clone())
    state.reset(torch.tensor([False, True, False, False, True]))
    assert not state.conv[:, [1, 4]].any() and not state.ssm[:, [1, 4]].any()
    assert torch.equal(state.ssm[:, [0, 2, 3]], before[1][:, [0, 2, 3]])
    with pytest.raises(ValueError, match=r"state has conv .* needs conv \(2, 5, 48, 3\) and ssm \(2, 5, 32, 4\)"):
        bb(xs(5, 2), make(d_conv=3, layer="mamba1", d_state=4).new_state(5))


def test_save_load_and_tensor_shapes(tmp_path):
    from fastmamba.engine.backbone import tensor_shapes

    bb = make(proj_bias=True, conv_bias=False)
    assert dict(tensor_shapes(bb.config)) == {k: tuple(v.shape) for k, v in bb.state_dict().items()}
    assert "layers.1.mixer.norm.weight" in bb.state_dict() and "layers.0.mixer.dt_bias" in bb.state_dict()
    bb.save(tmp_path / "bb")
    again = Backbone.load(tmp_path / "bb")
    assert again.config == bb.config and again.config.layer == "mamba2"
    x = xs(2, 5)
    with torch.no_grad():
        assert torch.equal(again(x)[0], bb(x)[0])


def test_fresh_parameters_follow_mamba_ssm_init():
    torch.manual_seed(0)
    bb = Backbone(BackboneConfig(input_dim=6, d_model=64, n_layer=4, layer="mamba2", head_dim=16, d_state=8))
    m = bb.layers[0].mixer
    dt = F.softplus(m.dt_bias)
    assert dt.shape == (8,) and 1e-3 * 0.99 <= dt.min() and dt.max() <= 0.1 * 1.01
    A = torch.exp(m.A_log)
    assert 1 <= A.min() and A.max() <= 16 and torch.equal(m.D, torch.ones(8))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_storage_close(dtype):
    bb = make()
    half = Backbone(bb.config, dtype=dtype)
    half.load_state_dict(bb.state_dict())
    assert half.layers[0].mixer.in_proj.weight.dtype == getattr(torch, dtype)
    assert half.layers[0].mixer.dt_bias.dtype == torch.float32
    x = xs(2, 7)
    with torch.no_grad():
        assert rel_err(half(x)[0], bb(x)[0]) < 3e-2


def test_the_cpu_step_follows_an_optimizers_updates():
    bb = make()
    x = xs(2, 3)
    opt = torch.optim.SGD(bb.parameters(), lr=0.5)
    with torch.no_grad():
        bb.step(x[:, 0], bb.new_state(2))  # (the step's weights, kept)
    bb(x)[0].square().sum().backward()
    opt.step()
    with torch.no_grad():
        state = bb.new_state(2)
        assert rel_err(steps(bb, x, state), bb(x)[0]) < TOL


def test_a_bfloat16_state_and_numpy_steps():
    """state_dtype bfloat16: the state stored in bf16, updated in float32 (rounded once on
    store), close to the float32 state's; numpy in gives numpy out."""
    import numpy as np

    bb = make()
    b16 = Backbone(bb.config, state_dtype="bfloat16")
    b16.load_state_dict(bb.state_dict())
    x = xs(3, 6)
    s32, s16 = bb.new_state(3), b16.new_state(3)
    assert s16.conv.dtype == s16.ssm.dtype == torch.bfloat16
    with torch.no_grad():
        ys32, ys16 = steps(bb, x, s32), steps(b16, x, s16)
        y16, new16 = b16(x)
    assert rel_err(ys16, ys32) < 2e-2 and rel_err(y16, ys32) < 2e-2 and new16.ssm.dtype == torch.bfloat16
    y = bb.step(x[:, 0].numpy(), bb.new_state(3))
    assert isinstance(y, np.ndarray) and y.shape == (3, 16) and y.dtype == np.float32


# -- the GPU ops (Triton's interpreter without CUDA) -------------------------------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_gpu_ops_equal_the_cpus():
    """The sequence pass on the prefill kernels (as on CUDA without autograd; kernels/ssd.py's
    chunked SSD takes the resets), the step on the GPU ops (ssd.py's step kernel), and the
    training ops under autograd, against the CPU's reference ops."""
    pytest.importorskip("triton")
    ref = make(d_model=32, head_dim=16)  # (heads of 16 channels: the kernels' smallest tile)
    bb = Backbone(ref.config, device=DEVICE)
    bb.load_state_dict(ref.state_dict())
    B, T = 2, 9
    x = xs(B, T)
    resets = resets_of(B, T)
    tol = 1e-4 if DEVICE == "cuda" else 1e-5

    def run(model, ops, x, state, resets):
        convs, ssms = list(state.conv.clone()), list(state.ssm.clone())
        y = model._layers(x.to(model.device), convs, ssms, None if resets is None else resets.to(model.device), ops)
        return y.cpu(), torch.stack(ssms).cpu()

    with torch.no_grad():
        y_ref, s_ref = run(ref, None, x, warm_state(ref, B), resets)
        y, s = run(bb, backbone_mamba2.gpu_ops(training=False), x, warm_state(bb, B), resets)
        assert rel_err(y, y_ref) < tol and rel_err(s, s_ref) < tol
        y1_ref, _ = run(ref, None, x[:, :1], warm_state(ref, B), None)  # one token: the step kernel
        y1, _ = run(bb, backbone_mamba2.step_ops(torch.device("cuda")), x[:, :1], warm_state(bb, B), None)
        assert rel_err(y1, y1_ref) < tol
    found = []
    w = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(5))  # (the norm makes sum(y^2) near constant)
    for model, ops in ((ref, None), (bb, backbone_mamba2.gpu_ops(training=True))):
        xx = x.clone().to(model.device).requires_grad_(True)
        state = warm_state(model, B)
        conv, ssm = (t.requires_grad_(True) for t in (state.conv, state.ssm))
        convs, ssms = [c.clone() for c in conv], [s.clone() for s in ssm]
        y = model._layers(xx, convs, ssms, resets.to(model.device), ops)
        ((y * w.to(model.device)).sum() + torch.stack(ssms).sum()).backward()
        found.append({"x": xx.grad, "conv": conv.grad, "ssm": ssm.grad,
                      **{k: p.grad for k, p in model.named_parameters()}})
    for name, g in found[0].items():
        assert rel_err(found[1][name].cpu(), g) < (1e-4 if DEVICE == "cuda" else 1e-5), name


@pytest.mark.parametrize("T,Q", [(40, 16), (33, 16), (7, 64)])  # chunks and a part; one short chunk
@pytest.mark.parametrize("with_resets", [False, True])
def test_the_triton_ssd_matches_autograd_of_the_chunked_ssd(T, Q, with_resets):
    """kernels/ssd_grad.ssd_scan_train_triton (the forward kernels of ssd.py, its own backward)
    against autograd through ssd_scan_train: y, the new state and every gradient."""
    pytest.importorskip("triton")
    from dataclasses import replace

    from fastmamba.engine.plan import SSD_GRAD_TILES, SSD_TILES
    from fastmamba.kernels.ssd_grad import ssd_scan_train, ssd_scan_train_triton

    B, H, P, G, N = 2, 4, 3, 2, 5
    g = torch.Generator().manual_seed(T)
    inp = [torch.randn(*shape, generator=g) for shape in ((B, T, H, P), (B, T, H), (H,))]
    inp += [-2 * torch.rand(H, generator=g)] + [torch.randn(*shape, generator=g)
                                                for shape in ((B, T, G, N), (B, T, G, N), (H,), (B, H, P, N))]
    resets = torch.rand(B, T, generator=g) < 0.15 if with_resets else None
    wy, ws = torch.randn(B, T, H, P, generator=g), torch.randn(B, H, P, N, generator=g)
    found = []
    for scan, kw in ((ssd_scan_train, {}), (ssd_scan_train_triton, dict(tiles=SSD_TILES,
                                                                           grad_tiles=replace(SSD_GRAD_TILES, chunk=Q)))):
        leaves = [v.clone().to(DEVICE).requires_grad_(True) for v in inp]
        x, dt, dt_bias, A, Bm, Cm, D, s0 = leaves
        state = s0.clone()
        y = scan(x, dt, dt_bias, (0.0, math.inf), A, Bm, Cm, D, state, Q, None,
                 None if resets is None else resets.to(DEVICE), **kw)
        ((y * wy.to(DEVICE)).sum() + (state * ws.to(DEVICE)).sum()).backward()
        found.append([y.detach().cpu(), state.detach().cpu()] + [v.grad.cpu() for v in leaves])
    tol = 1e-4 if DEVICE == "cuda" else 2e-5
    for name, ours, theirs in zip("y state x dt dt_bias A B C D state0".split(), found[1], found[0]):
        assert rel_err(ours, theirs) < tol, name


def test_the_ssd_backward_kernels_compile_for_hopper():
    """The training SSD's backward kernels compile for sm_90 at mamba_ssm's head sizes (no
    GPU needed: Triton ships ptxas; tools/compile_kernels.py's compile_kernel)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = """
import sys
sys.path.insert(0, sys.argv[1])
import compile_kernels as ck
from fastmamba.engine.plan import SSD_GRAD_TILES
from fastmamba.kernels import ssd_grad as sg
dims = dict(H=8, P=64, N=128, G=1, Q=SSD_GRAD_TILES.chunk, PP=64, NP=128, RESETS=True)
ck.compile_kernel(sg._ssd_bwd_chunk_kernel, ck.ptrs("x_ptr", "dy_ptr", "B_ptr", "C_ptr", "dt_ptr", "cum_ptr",
    "starts_ptr", "gend_ptr", "A_ptr", "D_ptr", "dx_ptr", "dB_ptr", "dC_ptr", "ddt_ptr", "dA_ptr", "dD_ptr",
    first_ptr="*i32"), dims, num_warps=SSD_GRAD_TILES.warps)
ck.compile_kernel(sg._ssd_bwd_dstart_kernel, ck.ptrs("dy_ptr", "C_ptr", "cum_ptr", "out_ptr", first_ptr="*i32"), dims,
                  num_warps=SSD_GRAD_TILES.warps)
print("compiled")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tools = Path(__file__).resolve().parents[1] / "tools"
    r = subprocess.run([sys.executable, "-c", script, str(tools)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("with_resets", [False, True])
def test_gpu_triton_ssd_at_mamba_ssm_sizes(with_resets):
    """The training SSD's Triton forward and backward at mamba_ssm's head sizes (P 64, N 128),
    over many chunks and a part, against autograd through the torch chunked SSD on the GPU."""
    from fastmamba.engine.plan import SSD_GRAD_TILES, SSD_TILES
    from fastmamba.kernels.ssd_grad import ssd_scan_train, ssd_scan_train_triton

    B, T, H, P, G, N = 3, 700, 8, 64, 2, 128
    g = torch.Generator().manual_seed(0)
    inp = [torch.randn(*shape, generator=g) for shape in ((B, T, H, P), (B, T, H), (H,))]
    inp += [-4 * torch.rand(H, generator=g)] + [torch.randn(*shape, generator=g) / math.sqrt(N)
                                                for shape in ((B, T, G, N), (B, T, G, N))]
    inp += [torch.randn(H, generator=g), torch.randn(B, H, P, N, generator=g)]
    inp[1] -= 2  # step sizes about 0.1, as trained models' are
    resets = (torch.rand(B, T, generator=g) < 0.01).cuda() if with_resets else None
    wy, ws = torch.randn(B, T, H, P, generator=g).cuda(), torch.randn(B, H, P, N, generator=g).cuda()
    found = []
    for scan, kw in ((ssd_scan_train, {}), (ssd_scan_train_triton, dict(tiles=SSD_TILES, grad_tiles=SSD_GRAD_TILES))):
        leaves = [v.clone().cuda().requires_grad_(True) for v in inp]
        x, dt, dt_bias, A, Bm, Cm, D, s0 = leaves
        state = s0.clone()
        y = scan(x, dt, dt_bias, (0.0, math.inf), A, Bm, Cm, D, state, 64, None, resets, **kw)
        ((y * wy).sum() + (state * ws).sum()).backward()
        found.append([y.detach().cpu(), state.detach().cpu()] + [v.grad.cpu() for v in leaves])
    for name, ours, theirs in zip("y state x dt dt_bias A B C D state0".split(), found[1], found[0]):
        assert rel_err(ours, theirs) < 1e-4, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,state_dtype", [("float32", "float32"), ("bfloat16", "float32"), ("float32", "bfloat16")])
@pytest.mark.parametrize("B", [1, 37, 300])
def test_gpu_graph_step_equals_eager_and_the_cpu(dtype, state_dtype, B):
    cpu = make(d_model=128, n_layer=3, input_dim=64, head_dim=64, d_state=64, n_groups=1, chunk_size=256)
    gpu = Backbone(cpu.config, device="cuda", dtype=dtype, state_dtype=state_dtype)
    gpu.load_state_dict(cpu.state_dict())
    cpu16 = Backbone(cpu.config, dtype=dtype, state_dtype=state_dtype)
    cpu16.load_state_dict(cpu.state_dict())
    tol = 1e-4 if dtype == state_dtype == "float32" else 2e-2
    # (A_log's update reaches the graph: A is made inside it)
    outs, (s_graph, _, s_cpu), x = graph_eager_and_cpu_steps(gpu, cpu16, gpu._step_eager, B)
    for t, (y_graph, y_eager, y_cpu) in enumerate(outs):
        assert rel_err(y_graph, y_eager) < 1e-6, t
        assert rel_err(y_graph.cpu(), y_cpu) < tol, t
    assert rel_err(s_graph.ssm.cpu(), s_cpu.ssm) < tol
    y_host = gpu.step(x[1], s_graph)  # a CPU tensor in, one out, through the host graph
    assert y_host.device.type == "cpu" and rel_err(y_host, cpu16.step(x[1], s_cpu)) < tol
    seq, _ = gpu(x.transpose(0, 1).cuda())
    assert rel_err(seq.cpu(), cpu16(x.transpose(0, 1))[0].detach()) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_sequence_pass_with_resets(dtype):
    """On CUDA without autograd the sequence pass runs the prefill kernels; with autograd
    the training kernels (the conv's and the SSD's), whose gradients match the CPU's."""
    from fastmamba.kernels.ssd_grad import ssd_scan_train_triton

    cpu = make(d_model=64, n_layer=3, input_dim=24, head_dim=32, d_state=32, n_groups=2, chunk_size=64)
    gpu = Backbone(cpu.config, device="cuda", dtype=dtype)
    gpu.load_state_dict(cpu.state_dict())
    cpu16 = Backbone(cpu.config, dtype=dtype)
    cpu16.load_state_dict(cpu.state_dict())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 300, 24, generator=g)
    resets = torch.rand(5, 300, generator=g) < 0.02
    resets[:, 0] = True
    state = warm_state(cpu16, 5)
    gpu_state = fastmamba.MambaState(state.conv.cuda(), state.ssm.cuda())
    with torch.no_grad():
        assert getattr(gpu._kernel_ops(x.cuda(), gpu_state).ssd, "func", None) is not ssd_scan_train_triton
        y, new = gpu(x.cuda(), gpu_state, resets.cuda())
        y_ref, new_ref = cpu16(x, state, resets)
    tol = 1e-4 if dtype == "float32" else 3e-2
    assert rel_err(y.cpu(), y_ref) < tol and rel_err(new.ssm.cpu(), new_ref.ssm) < tol
    assert rel_err(new.conv.cpu(), new_ref.conv) < tol
    w = torch.randn(5, 300, 64, generator=g)  # (the norm makes sum(y^2) near constant)
    xg = x.cuda().requires_grad_()
    assert gpu._kernel_ops(xg, gpu_state).ssd.func is ssd_scan_train_triton
    (gpu(xg, gpu_state, resets.cuda())[0] * w.cuda()).mean().backward()
    xc = x.clone().requires_grad_()
    (cpu16(xc, state, resets)[0] * w).mean().backward()
    assert rel_err(xg.grad.cpu(), xc.grad) < tol
    for name in ("layers.1.mixer.in_proj.weight", "layers.2.mixer.A_log", "layers.0.mixer.dt_bias"):
        ours, theirs = dict(gpu.named_parameters())[name].grad, dict(cpu16.named_parameters())[name].grad
        assert rel_err(ours.float().cpu(), theirs.float()) < tol, name
