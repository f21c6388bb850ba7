"""fastmamba.Backbone: the recurrent core over vectors, its sequence pass with resets, its
step, gradients, files; against transformers' MambaModel and a float64 oracle."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fastmamba
from fastmamba import Backbone, BackboneConfig

TOL = 1e-5


def rel_err(a, b) -> float:
    assert torch.isfinite(a).all()
    return ((a - b).abs().max() / b.abs().max()).item()


def make(seed=0, **kw) -> Backbone:
    torch.manual_seed(seed)
    cfg = dict(input_dim=6, d_model=16, n_layer=2, d_state=8)
    cfg.update(kw)
    bb = Backbone(BackboneConfig(**cfg))
    with torch.no_grad():  # spread the constants (norms 1, D 1) so a misread would show
        for name, p in bb.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D")):
                p.add_(0.3 * torch.randn_like(p))
    return bb


def xs(B, T, dim=6, seed=1):
    return torch.randn(B, T, dim, generator=torch.Generator().manual_seed(seed))


def test_matches_transformers_mamba_model():
    from transformers import MambaConfig, MambaModel

    torch.manual_seed(0)
    hf = MambaModel(MambaConfig(hidden_size=16, num_hidden_layers=3, state_size=8, vocab_size=10, time_step_rank=3,
                                use_conv_bias=True, use_bias=True)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    bb = Backbone(BackboneConfig(input_dim=16, d_model=16, n_layer=3, d_state=8, dt_rank=3, proj_bias=True))
    sd = {k: v for k, v in hf.state_dict().items() if not k.startswith("embeddings.")}
    bb.load_state_dict(sd)  # the same names, strictly
    x = xs(2, 11, 16)
    with torch.no_grad():
        ref = hf(inputs_embeds=x).last_hidden_state
    y, _ = bb(x)
    assert y.dtype == torch.float32 and rel_err(y, ref) < 1e-4


def test_input_proj_exists_when_widths_differ_or_asked():
    assert make().input_proj is not None
    assert make(input_dim=16).input_proj is None
    assert make(input_dim=16, input_proj=True).input_proj is not None
    assert "input_proj.weight" in make().state_dict() and "norm_f.weight" in make().state_dict()
    with pytest.raises(ValueError, match="input_proj"):
        BackboneConfig(input_dim=6, d_model=16, n_layer=1, input_proj=False)


def test_fresh_parameters_follow_mamba_ssm_init():
    bb = make(seed=3, d_model=64, n_layer=4)
    m = bb.layers[0].mixer
    assert torch.equal(m.A_log, torch.log(torch.arange(1, 9.0)).repeat(128, 1))
    dt = F.softplus(m.dt_proj.bias)
    assert 1e-3 * 0.99 <= dt.min() and dt.max() <= 0.1 * 1.01
    assert m.dt_proj.weight.abs().max() <= 4**-0.5  # dt_rank ceil(64 / 16) = 4
    torch.manual_seed(3)
    again = Backbone(BackboneConfig(input_dim=6, d_model=64, n_layer=4, d_state=8))
    assert torch.equal(again.layers[0].mixer.in_proj.weight, m.in_proj.weight)  # torch's RNG seeds it


def test_steps_equal_the_sequence_and_halves_equal_one_pass():
    bb = make()
    x = xs(3, 12)
    with torch.no_grad():
        y, final = bb(x)
        state = bb.new_state(3)
        steps = torch.stack([bb.step(x[:, t], state) for t in range(12)], 1)
        assert rel_err(steps, y) < TOL and rel_err(state.ssm, final.ssm) < TOL and rel_err(state.conv, final.conv) < TOL
        y1, mid = bb(x[:, :5])
        y2, end = bb(x[:, 5:], mid)
    assert rel_err(torch.cat([y1, y2], 1), y) < TOL and rel_err(end.ssm, final.ssm) < TOL


def test_the_given_state_is_not_modified():
    bb = make()
    state = bb.new_state(2)
    with torch.no_grad():
        _, state = bb(xs(2, 4))
        before = (state.conv.clone(), state.ssm.clone())
        bb(xs(2, 3, seed=5), state)
    assert torch.equal(state.conv, before[0]) and torch.equal(state.ssm, before[1])


@pytest.mark.parametrize("t0", [1, 2, 7])  # inside the conv's window of the start, and past it
def test_a_reset_restarts_that_row_alone_from_zeros(t0):
    bb = make(d_conv=4)
    x = xs(3, 10)
    with torch.no_grad():
        _, warm = bb(xs(3, 6, seed=9))  # a non-zero state before the sequence
        resets = torch.zeros(3, 10, dtype=torch.bool)
        resets[1, t0] = True
        y, final = bb(x, warm, resets)
        plain, plain_final = bb(x, warm)
        fresh, fresh_final = bb(x[1:2, t0:])  # row 1 from zeros at t0
    assert rel_err(y[1, t0:], fresh[0]) < TOL and rel_err(final.ssm[:, 1], fresh_final.ssm[:, 0]) < TOL
    assert rel_err(final.conv[:, 1], fresh_final.conv[:, 0]) < TOL
    # before the reset, and the other rows: as without it (the conv with resets sums its
    # taps in another order than F.conv1d)
    assert rel_err(y[1, :t0], plain[1, :t0]) < TOL
    assert rel_err(y[[0, 2]], plain[[0, 2]]) < TOL and rel_err(final.ssm[:, [0, 2]], plain_final.ssm[:, [0, 2]]) < TOL


def test_reset_at_step_zero_ignores_the_state():
    bb = make()
    x = xs(2, 5)
    with torch.no_grad():
        _, warm = bb(xs(2, 3, seed=4))
        y, _ = bb(x, warm, torch.tensor([[True] + [False] * 4] * 2))
        cold, _ = bb(x)
    assert rel_err(y, cold) < TOL


def test_masked_reset_touches_only_its_slots():
    bb = make()
    with torch.no_grad():
        _, state = bb(xs(4, 5))
    before = (state.conv.clone(), state.ssm.clone())
    state.reset(torch.tensor([False, True, False, True]))
    assert not state.conv[:, [1, 3]].any() and not state.ssm[:, [1, 3]].any()
    assert torch.equal(state.conv[:, [0, 2]], before[0][:, [0, 2]]) and torch.equal(state.ssm[:, [0, 2]], before[1][:, [0, 2]])
    state.reset(0)
    assert not state.ssm[:, 0].any() and torch.equal(state.ssm[:, 2], before[1][:, 2])
    with pytest.raises(ValueError, match="mask"):
        state.reset(torch.tensor([True, False]))
    # an episode whose state went NaN or infinite (a bad observation): its reset clears it
    state.ssm[:, 1] = float("nan")
    state.conv[:, 3] = float("inf")
    state.reset(torch.tensor([False, True, False, True]))
    assert not state.conv[:, [1, 3]].any() and not state.ssm[:, [1, 3]].any()


def reference64(bb: Backbone, x, conv0, ssm0, resets):
    """The backbone's math written out plainly in float64, step by step (the oracle)."""
    c = bb.config
    p = {k: v.double() for k, v in bb.named_parameters()}
    h = x.double() @ p["input_proj.weight"].T + p["input_proj.bias"]
    B, T, _ = x.shape
    E, N, R = c.d_inner, c.d_state, c.dt_rank

    def rms(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + c.norm_eps) * w

    for i in range(c.n_layer):
        q = lambda n: p[f"layers.{i}.mixer.{n}"]  # noqa: E731
        u = rms(h, p[f"layers.{i}.norm.weight"])
        xz = u @ q("in_proj.weight").T
        conv, s, outs = conv0[i].double(), ssm0[i].double(), []
        A = -torch.exp(q("A_log"))
        for t in range(T):
            if resets is not None:
                keep = (~resets[:, t]).double().view(B, 1, 1)
                conv, s = conv * keep, s * keep
            conv = torch.cat([conv[:, :, 1:], xz[:, t, :E, None]], -1)
            xc = F.silu((conv * q("conv1d.weight")[:, 0]).sum(-1) + q("conv1d.bias"))
            dbc = xc @ q("x_proj.weight").T
            dt = F.softplus(dbc[:, :R] @ q("dt_proj.weight").T + q("dt_proj.bias"))
            s = s * torch.exp(dt[..., None] * A) + (dt * xc)[..., None] * dbc[:, None, R:R + N]
            y = (s * dbc[:, None, R + N:]).sum(-1) + q("D") * xc
            outs.append(y * F.silu(xz[:, t, E:]))
        h = h + torch.stack(outs, 1) @ q("out_proj.weight").T
    return rms(h, p["norm_f.weight"])


@pytest.mark.parametrize("T", [9, 1])  # (one step: the CPU's one-token path must leave autograd's saved tensors alone)
def test_gradients_match_a_float64_oracle(T):
    bb = make(n_layer=2, d_conv=3)
    state = bb.new_state(2)
    state.conv.normal_(generator=torch.Generator().manual_seed(2))
    state.ssm.normal_(generator=torch.Generator().manual_seed(3))
    assert_gradients_match_a_float64_oracle(bb, lambda: make(n_layer=2, d_conv=3), reference64, xs(2, T), state)


def assert_gradients_match_a_float64_oracle(bb: Backbone, again, reference, x, state) -> None:
    """The Backbone's outputs (within 1e-5) and the gradients of a weighted sum of them to x,
    the state and every parameter (within 1e-4) against `reference` (the math written out
    step by step) in float64 autograd, over a second Backbone of the same parameters
    (`again()`); a reset in row 0 halfway where x has more than one step."""
    B, T = x.shape[:2]
    x = x.requires_grad_(True)
    state.conv.requires_grad_(True)
    state.ssm.requires_grad_(True)
    resets = torch.zeros(B, T, dtype=torch.bool)
    resets[0, T // 2] = True
    resets = resets if T > 1 else None
    weight = torch.randn(B, T, 16, generator=torch.Generator().manual_seed(4))
    y, _ = bb(x, state, resets)
    (y * weight).sum().backward()
    ours = {"x": x.grad, "conv": state.conv.grad, "ssm": state.ssm.grad, **{k: p.grad for k, p in bb.named_parameters()}}
    x64, conv64, ssm64 = (t.detach().double().requires_grad_(True) for t in (x, state.conv, state.ssm))
    bb64 = again()  # the same parameters, as float64 leaves
    bb64.load_state_dict(bb.state_dict())
    params64 = dict(bb64.named_parameters())
    for p in params64.values():
        p.data = p.data.double()
    ref = reference(bb64, x64, conv64, ssm64, resets)
    assert rel_err(y.detach().double(), ref.detach()) < 1e-5
    (ref * weight.double()).sum().backward()
    theirs = {"x": x64.grad, "conv": conv64.grad, "ssm": ssm64.grad, **{k: p.grad for k, p in params64.items()}}
    assert set(theirs) == set(ours)
    for name, g in theirs.items():
        assert rel_err(ours[name].double(), g) < 1e-4, name


def test_save_and_load_round_trip(tmp_path):
    bb = make(proj_bias=True)
    bb.save(tmp_path / "bb")
    again = Backbone.load(tmp_path / "bb")
    assert again.config == bb.config
    x = xs(2, 7)
    with torch.no_grad():
        assert torch.equal(again(x)[0], bb(x)[0])
    half = Backbone.load(tmp_path / "bb", dtype="bfloat16")
    assert half.layers[0].mixer.in_proj.weight.dtype == torch.bfloat16


def test_load_errors_name_the_file_and_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    make().save(tmp_path / "bb")
    weights = tmp_path / "bb" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors.pop("layers.1.mixer.x_proj.weight")
    save_file(tensors, str(weights))
    with pytest.raises(fastmamba.CheckpointError, match="model.safetensors.*missing tensor 'layers.1.mixer.x_proj.weight'"):
        Backbone.load(tmp_path / "bb")
    cfg = tmp_path / "bb" / "config.json"
    raw = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**raw, "d_model": -3}))
    with pytest.raises(fastmamba.CheckpointError, match="config.json.*d_model"):
        Backbone.load(tmp_path / "bb")
    cfg.write_text(json.dumps({**raw, "d_modle": 3}))
    with pytest.raises(fastmamba.CheckpointError, match="d_modle"):
        Backbone.load(tmp_path / "bb")
    with pytest.raises(fastmamba.CheckpointError, match="config.json"):
        Backbone.load(tmp_path / "nowhere")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_storage_close(dtype):
    bb = make()
    low_16 = Backbone(bb.config, dtype=dtype)
    low_16.load_state_dict(bb.state_dict())
    x = xs(2, 10)
    with torch.no_grad():
        assert low_16.layers[0].mixer.in_proj.weight.dtype == getattr(torch, dtype)
        assert rel_err(low_16(x)[0], bb(x)[0]) < 2e-2


def test_bad_input_names_the_argument_and_shapes():
    bb = make()
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, 6\).*\(2, 3, 5\)"):
        bb(torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match=r"state has conv .*\(2, 2, 32, 4\).* needs conv \(2, 3, 32, 4\)"):
        bb(torch.zeros(3, 4, 6), bb.new_state(2))
    with pytest.raises(ValueError, match=r"resets must be a bool tensor of shape \(3, 4\)"):
        bb(torch.zeros(3, 4, 6), None, torch.zeros(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"x must have shape \(B, 6\)"):
        bb.step(torch.zeros(3, 7), bb.new_state(3))
    with pytest.raises(ValueError, match="state has conv"):
        bb.step(torch.zeros(3, 6), bb.new_state(4))
    with pytest.raises(ValueError, match="floating-point"):
        bb.step(np.zeros((3, 6), dtype=np.int64), bb.new_state(3))


def test_numpy_in_numpy_out_on_the_cpu():
    bb = make()
    x = xs(3, 1)[:, 0]
    a, b = bb.new_state(3), bb.new_state(3)
    y = bb.step(x.numpy(), a)
    assert isinstance(y, np.ndarray) and np.array_equal(y, bb.step(x, b).numpy())


def test_the_cpu_step_follows_an_optimizers_updates():
    """The CPU step keeps each layer's weights between steps (A made from A_log): an
    optimizer's in-place update of any parameter, A_log included, must reach the next step."""
    bb = make()
    x = xs(2, 3)
    state = bb.new_state(2)
    bb.step(x[:, 0], state)
    A_logs = [p for name, p in bb.named_parameters() if "A_log" in name]
    others = [p for name, p in bb.named_parameters() if "A_log" not in name]
    opt = torch.optim.SGD([dict(params=others), dict(params=A_logs, lr=100.0)], lr=0.05)  # A moves visibly
    y, _ = bb(x)
    y.pow(2).sum().backward()
    A_before = [-torch.exp(p.detach()) for p in A_logs]
    opt.step()
    assert all((-torch.exp(p.detach()) - a).abs().max() > 1e-3 for p, a in zip(A_logs, A_before))
    fresh = make()
    fresh.load_state_dict(bb.state_dict())  # the updated parameters, nothing kept from before
    before = type(state)(state.conv.clone(), state.ssm.clone())
    y_step = bb.step(x[:, 1], state)
    assert torch.equal(y_step, fresh.step(x[:, 1], before))


def test_the_language_models_backbone_shares_its_weights():
    lm = fastmamba.load()
    bb = lm.backbone
    assert bb is lm.backbone and bb.input_proj is None
    assert bb.layers[0].mixer.in_proj.weight.data_ptr() == lm.model.weights.layers[0].in_proj_w.data_ptr()
    h = torch.randn(2, 6, lm.config.d_model, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y, _ = bb(h)
    assert rel_err(y, lm.model.backbone(h, lm.model.new_state(2))) < TOL


def graph_eager_and_cpu_steps(gpu: Backbone, cpu16: Backbone, eager, B: int, sync=None):
    """Six steps of random (B, 64) inputs through the GPU Backbone's graph step, `eager` (the
    same step without a graph) and the CPU's of the same weights, from zero states: rows 0,
    5, 10 ... reset before step 3, and after step 4 an optimizer's in-place update of layer
    2's A_log, which must reach the graph (then `sync()`, where the eager step needs it).
    Returns each step's (graph, eager, cpu) outputs, the three states and the inputs."""
    x = torch.randn(6, B, 64, generator=torch.Generator().manual_seed(1))
    states = gpu.new_state(B), gpu.new_state(B), cpu16.new_state(B)
    outs = []
    for t in range(6):
        if t == 3:
            done = torch.zeros(B, dtype=torch.bool)
            done[::5] = True
            for s in states:
                s.reset(done.to(s.conv.device))
        y_graph = gpu.step(x[t].cuda(), states[0])
        with torch.no_grad():
            y_eager = eager(x[t].cuda(), states[1]).clone()  # (an eager step may reuse its output)
        outs.append((y_graph, y_eager, cpu16.step(x[t], states[2])))
        if t == 4:
            for bb in (gpu, cpu16):
                with torch.no_grad():
                    bb.layers[2].mixer.A_log.add_(0.25)
            if sync is not None:
                sync()
    return outs, states, x


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
# the decode kernels' routes: one-row, decode_gemm.py's smaller and larger; 100: the lockstep step's
@pytest.mark.parametrize("B", [1, 37, 100, 300])
def test_gpu_graph_step_equals_eager_and_the_cpu(dtype, B):
    from fastmamba.engine.backbone_step import step_kernels

    cpu = make(d_model=128, n_layer=3, input_dim=64, d_state=16)
    gpu = Backbone(cpu.config, device="cuda", dtype=dtype)
    gpu.load_state_dict(cpu.state_dict())
    cpu16 = Backbone(cpu.config, dtype=dtype)
    cpu16.load_state_dict(cpu.state_dict())
    eager = step_kernels(gpu, B)  # (the plan's kernels, run eagerly)
    tol = 1e-4 if dtype == "float32" else 2e-2
    outs, (s_graph, _, s_cpu), x = graph_eager_and_cpu_steps(gpu, cpu16, eager, B, eager.sync)
    for t, (y_graph, y_eager, y_cpu) in enumerate(outs):
        assert torch.equal(y_graph, y_eager), t
        assert rel_err(y_graph.cpu(), y_cpu) < tol, t
    assert rel_err(s_graph.ssm.cpu(), s_cpu.ssm) < tol
    y_np = gpu.step(x[0].numpy(), s_graph)  # numpy in, numpy out, through the host graph
    assert isinstance(y_np, np.ndarray) and y_np.shape == (B, 128)
    assert rel_err(torch.from_numpy(y_np), cpu16.step(x[0], s_cpu)) < tol
    y_host = gpu.step(x[1], s_graph)  # a CPU tensor in, one out
    assert y_host.device.type == "cpu" and rel_err(y_host, cpu16.step(x[1], s_cpu)) < tol
    with pytest.raises(ValueError, match="state has conv"):  # after the fast path's call, another state
        gpu.step(x[2].cuda(), gpu.new_state(B + 1))
    seq, _ = gpu(x.transpose(0, 1).cuda())
    assert rel_err(seq.cpu(), cpu16(x.transpose(0, 1))[0].detach()) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_sequence_pass_with_resets(dtype):
    """On CUDA without autograd the sequence pass runs the prefill kernels (the conv and the
    scan take the resets); with autograd the training kernels, whose gradients match the CPU's."""
    cpu = make(d_model=64, n_layer=3, input_dim=24, d_state=16)
    gpu = Backbone(cpu.config, device="cuda", dtype=dtype)
    gpu.load_state_dict(cpu.state_dict())
    cpu16 = Backbone(cpu.config, dtype=dtype)
    cpu16.load_state_dict(cpu.state_dict())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 300, 24, generator=g)
    resets = torch.rand(5, 300, generator=g) < 0.02
    resets[:, 0] = True
    state = cpu16.new_state(5)
    state.ssm.normal_(generator=g)
    gpu_state = fastmamba.MambaState(state.conv.cuda(), state.ssm.cuda())
    with torch.no_grad():
        assert gpu._kernel_ops(x.cuda(), gpu_state) is not None
        y, new = gpu(x.cuda(), gpu_state, resets.cuda())
        y_ref, new_ref = cpu16(x, state, resets)
    tol = 1e-4 if dtype == "float32" else 3e-2
    assert rel_err(y.cpu(), y_ref) < tol and rel_err(new.ssm.cpu(), new_ref.ssm) < tol
    assert rel_err(new.conv.cpu(), new_ref.conv) < tol
    # training: the conv and the scan as autograd Functions whose backward runs in Triton
    from fastmamba.kernels.scan_grad import step_and_scan_train

    xg = x.cuda().requires_grad_()
    assert gpu._kernel_ops(xg, gpu_state).scan.func is step_and_scan_train
    gpu(xg, gpu_state, resets.cuda())[0].square().mean().backward()
    xc = x.clone().requires_grad_()
    cpu16(xc, state, resets)[0].square().mean().backward()
    assert rel_err(xg.grad.cpu(), xc.grad) < tol
    name = "layers.1.mixer.in_proj.weight"
    assert rel_err(dict(gpu.named_parameters())[name].grad.float().cpu(), dict(cpu16.named_parameters())[name].grad.float()) < tol


@pytest.mark.parametrize("batch", [2, 9])  # the one-row kernels, and decode_gemm.py's step
@pytest.mark.parametrize("dtype,state_dtype", [("float32", "float32"), ("bfloat16", "float32"), ("float32", "bfloat16")])
def test_kernel_step_equals_the_reference_step(batch, dtype, state_dtype):
    """KernelStep (the language model's decode kernels; Triton's interpreter without CUDA),
    with a float32 or a bf16 state (updated in float32, rounded once on store in both)."""
    pytest.importorskip("triton")
    from fastmamba.engine.backbone_step import KernelStep

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = make(proj_bias=True)
    bb = Backbone(ref.config, device=device, dtype=dtype, state_dtype=state_dtype)
    bb.load_state_dict(ref.state_dict())
    step = KernelStep(bb, batch)
    s_kernels, s_ref = bb.new_state(batch), bb.new_state(batch)
    x = torch.randn(3, batch, 6, generator=torch.Generator().manual_seed(7)).to(device)
    tol = 1e-4 if dtype == state_dtype == "float32" else 2e-2
    with torch.no_grad():
        for t in range(3):
            assert rel_err(step(x[t], s_kernels), bb._step_eager(x[t], s_ref)) < tol, t
        assert rel_err(s_kernels.ssm, s_ref.ssm) < tol
        bb.layers[1].mixer.A_log.add_(0.5)  # an optimizer's in-place update: sync picks it up
        step.sync()
        assert rel_err(step(x[0], s_kernels), bb._step_eager(x[0], s_ref)) < tol


def test_the_language_models_backbone_follows_its_state_dtype():
    lm = fastmamba.load(state_dtype="bfloat16")
    state = lm.backbone.new_state(3)
    assert state.ssm.dtype == torch.bfloat16 and state.conv.dtype == torch.bfloat16
    assert fastmamba.load().backbone.new_state(1).ssm.dtype == torch.float32


def test_a_state_of_integers_is_refused_by_its_dtype():
    """A state must hold floats: an int64 one was taken and rounded to integers every step."""
    bb = make()
    ints = fastmamba.MambaState(*(t.long() for t in (bb.new_state(2).conv, bb.new_state(2).ssm)))
    with pytest.raises(ValueError, match="state must hold floating-point tensors.*torch.int64"):
        bb.step(torch.zeros(2, 6), ints)
    with pytest.raises(ValueError, match="torch.int64"):
        bb(torch.zeros(2, 3, 6), ints)


def test_reset_takes_masks_and_slot_indices_and_refuses_the_rest_by_name():
    bb = make()
    x = xs(4, 1)[:, 0]

    def stepped():
        state = bb.new_state(4)
        bb.step(x, state)
        return state

    def zeroed(state):
        return [bool(state.conv[:, i].eq(0).all() and state.ssm[:, i].eq(0).all()) for i in range(4)]

    mask = [True, False, False, True]
    for given in (torch.tensor(mask), mask, np.array(mask)):
        state = stepped()
        state.reset(given)
        assert zeroed(state) == mask
    for index in (2, np.int64(2)):
        state = stepped()
        state.reset(index)
        assert zeroed(state) == [False, False, True, False]
    state = stepped()
    for bad, message in [(True, "got True"), (np.bool_(False), "got "), (4, "from 0 to 3"), (-1, "from 0 to 3"),
                         (2.0, "got 2.0"), ("all", "got 'all'"), (torch.zeros(3, dtype=torch.bool), r"shape \(4,\).*\(3,\)"),
                         (torch.tensor(True), r"shape \(4,\).*\(\)"), (torch.ones(4), "torch.float32"),
                         ([1, 0], r"\(2,\)"), ([[True]] * 4, r"\(4, 1\)"), (["a"] * 4, "4 bools")]:
        with pytest.raises(ValueError, match=message):
            state.reset(bad)
    assert zeroed(state) == [False] * 4  # nothing reset by a refused mask


def test_new_state_takes_numpy_integers():
    bb = make()
    assert bb.new_state(np.int64(4)).batch == 4 and bb.new_state(np.int32(1)).conv.shape[1] == 1
    for bad in (True, np.bool_(True), 2.0, 0, np.int64(-3), "2"):
        with pytest.raises(ValueError, match="batch must be a positive integer"):
            bb.new_state(bad)


def test_a_device_that_is_not_there_is_a_value_error():
    cfg = BackboneConfig(input_dim=4, d_model=8, n_layer=1)
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu0'"):
        Backbone(cfg, device="gpu0")
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'mps'"):  # (a torch device, not ours)
        Backbone(cfg, device="mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' was asked for, but PyTorch sees no CUDA GPU here"):
            Backbone(cfg, device="cuda")


@pytest.mark.parametrize("convert,dtype", [
    (lambda m: m.half(), torch.float16),
    (lambda m: m.bfloat16(), torch.bfloat16),
    (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    (lambda m: m.to("cpu", dtype=torch.float16), torch.float16),
])
def test_16bit_conversions_change_the_storage_alone(convert, dtype):
    """.half(), .bfloat16(), .to(dtype): the large matrices take the dtype, the rest stays
    float32, bit for bit; the module then computes as one made in that dtype."""
    bb = make(proj_bias=True)
    before = {k: v.clone() for k, v in bb.state_dict().items()}
    x = xs(3, 5)
    y, _ = bb(x)
    y.square().mean().backward()  # grads follow their parameters' dtypes
    assert convert(bb) is bb
    made = Backbone(bb.config, dtype=dtype)
    made.load_state_dict(before)
    for name, p in bb.named_parameters():
        want = made.state_dict()[name].dtype
        assert p.dtype == want and p.grad.dtype == want, name
        if want == torch.float32:
            assert torch.equal(p.detach(), before[name]), name
    with torch.no_grad():
        assert torch.equal(bb(x)[0], made(x)[0])
        assert torch.equal(bb.step(x[:, 0], bb.new_state(3)), made.step(x[:, 0], made.new_state(3)))
    bb.float()
    assert all(p.dtype == torch.float32 for p in bb.parameters())


@pytest.mark.filterwarnings("ignore:Complex modules")
def test_other_dtypes_are_refused_by_name():
    bb = make()
    for convert, name in [(lambda m: m.double(), "float64"), (lambda m: m.to(torch.float64), "float64"),
                          (lambda m: m.to(torch.complex64), "complex64")]:
        with pytest.raises(ValueError, match=f"float32, bfloat16 or float16, not {name}"):
            convert(bb)
        assert all(p.dtype == torch.float32 for p in bb.parameters())  # untouched


def test_tensor_shapes_are_the_state_dicts():
    from fastmamba.engine.backbone import tensor_shapes

    for kw in (dict(), dict(proj_bias=True, conv_bias=False, dt_rank=3), dict(input_dim=16, input_proj=True)):
        bb = make(**kw)
        assert dict(tensor_shapes(bb.config)) == {k: tuple(v.shape) for k, v in bb.state_dict().items()}


def test_load_checks_the_file_before_it_builds_a_layer(tmp_path, monkeypatch):
    """A config of 100,000 layers over a file of 3: the first missing tensor is named before
    any layer is built (it ran for minutes building them)."""
    import fastmamba.engine.backbone as backbone

    make(n_layer=3).save(tmp_path / "bb")
    cfg = tmp_path / "bb" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "n_layer": 100_000}))

    def no_layers(*args, **kwargs):
        raise AssertionError("a layer was built before the file was checked")

    monkeypatch.setattr(backbone, "_Layer", no_layers)
    with pytest.raises(fastmamba.CheckpointError, match="model.safetensors: missing tensor 'layers.3.norm.weight'"):
        Backbone.load(tmp_path / "bb")


def test_step_graphs_are_bounded_and_keyed_by_batch_and_state_memory(monkeypatch):
    """The step's CUDA graphs (captures faked here, on the CPU): one set a batch size and
    state dtype, a graph a state address within it, both bounded, none keeping a state
    alive; a state over the same memory takes its graph. (Whether a new state lands on a freed
    one's memory is the allocator's choice: not asserted, it failed now and then.)"""
    import weakref

    import fastmamba.engine.backbone_step as backbone_step
    from fastmamba.engine import cuda_graphs

    captures = []

    def setup(self):  # (no kernels, buffers or pool without CUDA)
        self.run, self.kernels, self.x, self.device_index, self.pool = print, None, None, 0, "pool"

    def capture_graph(body, pool):
        captures.append(pool)
        return object(), None

    monkeypatch.setattr(backbone_step.StepGraphs, "_setup", setup)
    monkeypatch.setattr(cuda_graphs, "capture_graph", capture_graph)
    bb = make()
    a, b = bb.new_state(3), bb.new_state(3)
    ga, gb = bb._graph_for(a), bb._graph_for(b)
    assert ga is not gb and captures == ["pool", "pool"]  # the batch's one pool
    assert bb._graph_for(a) is ga and bb._graph_for(fastmamba.MambaState(a.conv, a.ssm)) is ga and len(captures) == 2
    assert len(bb._graphs) == 1  # one batch size, one dtype: its kernels and buffers shared
    conv = weakref.ref(a.conv)
    del a
    assert conv() is None  # its graph kept no reference
    # (a later state may take a's freed memory and with it ga: held here, it would outlive its eviction)
    del ga, gb
    held, dropped = [], []
    for episode in range(1000):
        state = bb.new_state(3)
        g = bb._graph_for(state)
        assert bb._graph_for(state) is g
        dropped.append(weakref.ref(g))
        held = (held + [state])[-3:]  # a few states alive at a time, as a run's rollouts keep
        del g
    assert len(bb._graphs) == 1 and len(bb._graphs.entries[(3, torch.float32, torch.float32)].states) == backbone_step.STATES_PER_BATCH
    assert len({id(r()) for r in dropped if r() is not None}) <= backbone_step.STATES_PER_BATCH  # the rest freed
    in_bf16 = fastmamba.MambaState(held[0].conv.bfloat16(), held[0].ssm.bfloat16())
    assert bb._graph_for(in_bf16) is not bb._graph_for(held[0]) and len(bb._graphs) == 2
    for batch in range(1, 20):
        bb._graph_for(bb.new_state(batch))
    assert len(bb._graphs) == backbone_step.STEP_BATCHES
    bb.to("cpu")  # (a move drops them all)
    assert len(bb._graphs) == 0


@pytest.mark.parametrize("layer", ["mamba1", "mamba2"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_step_follows_parameters_given_new_memory(device, layer):
    """A step made (its weights cached, on CUDA its graphs captured), then the parameters
    replaced rather than written in place: vector_to_parameters (`p.data = ...`), one
    parameter's .data, load_state_dict(assign=True). Each next step is the sequence pass's
    first step under the new values."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kw = dict(layer=layer, head_dim=8, d_state=8) if layer == "mamba2" else {}
    bb = make(**kw).to(device)
    x = xs(3, 1, seed=4)[:, 0].to(device)

    def assert_step_is_the_sequence_pass():
        y = bb.step(x, bb.new_state(3))
        assert rel_err(y.cpu(), bb(x[:, None])[0][:, 0].detach().cpu()) < 1e-5

    bb.step(x, bb.new_state(3))
    others = [make(seed=k, **kw).to(device) for k in (1, 2, 3)]
    vector_to_parameters(parameters_to_vector(others[0].parameters()).detach().clone(), bb.parameters())
    assert_step_is_the_sequence_pass()
    bb.layers[0].mixer.in_proj.weight.data = others[1].layers[0].mixer.in_proj.weight.data.clone()
    assert_step_is_the_sequence_pass()
    bb.load_state_dict({k: v.clone() for k, v in others[2].state_dict().items()}, assign=True)
    assert_step_is_the_sequence_pass()
    assert rel_err(bb.step(x, bb.new_state(3)).cpu(), others[2].step(x, others[2].new_state(3)).cpu()) < 1e-6
