"""fastmamba.Backbone: Mamba's recurrent core as a torch module, for uses outside language
(an agent's policy over observation vectors, control, streaming signals).

Two forms over one set of weights:
- `bb(x, state, resets)`: a (B, T) sequence pass, functional (returns the new state) and
  differentiable with respect to the parameters, x and the initial state;
- `bb.step(x, state)`: one step for a batch of environments, in place, no grad; on CUDA one
  graph replay (graphs kept by batch size, then by the state's memory, both bounded:
  Backbone's doc).
The sequence pass runs the language model's own layer (core/mamba1.mixer), whose ops take reset
flags: on the CPU the pure-PyTorch ops; on CUDA the prefill kernels without autograd, and
under autograd the training ops (core/ops.training_ops), whose conv and scan run forward and
backward in Triton.
The step runs the same layer; on CUDA through the language model's decode kernels
(backbone_step.KernelStep) in a CUDA graph.
BackboneConfig(layer="mamba2") makes the layers Mamba-2's (core/mamba2.mixer2), with the same
API and state type; its parameters and ops are backbone_mamba2.py's. Which ops run where, the
deterministic mode and autocast: backbone_ops.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import weakref
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fastmamba.core.errors import CheckpointError
from fastmamba.core.mamba1 import LayerWeights, mixer
from fastmamba.core.ops import REFERENCE_OPS
from fastmamba.core.state import MambaState
from fastmamba.engine import backbone_mamba2, backbone_ops
from fastmamba.engine.backbone_config import BackboneConfig
from fastmamba.engine.backbone_step import LRU, STEP_BATCHES, ParameterAddresses, StateGraph, StepGraphs, storage_dtype

FORMAT = "fastmamba.Backbone"


def tensor_shapes(c: BackboneConfig):
    """Each tensor of a Backbone's state_dict, (name, shape), from the config alone (so that
    `load` checks a file before it builds a layer)."""
    d, E, N, K, R = c.d_model, c.d_inner, c.d_state, c.d_conv, c.dt_rank
    if c.input_proj:
        yield "input_proj.weight", (d, c.input_dim)
        yield "input_proj.bias", (d,)
    for i in range(c.n_layer):
        if c.layer == "mamba2":
            yield from backbone_mamba2.tensor_shapes(c, i).items()
            continue
        yield f"layers.{i}.norm.weight", (d,)
        m = f"layers.{i}.mixer."
        yield m + "A_log", (E, N)
        yield m + "D", (E,)
        yield m + "in_proj.weight", (2 * E, d)
        if c.proj_bias:
            yield m + "in_proj.bias", (2 * E,)
        yield m + "conv1d.weight", (E, 1, K)
        if c.conv_bias:
            yield m + "conv1d.bias", (E,)
        yield m + "x_proj.weight", (R + 2 * N, E)
        yield m + "dt_proj.weight", (E, R)
        yield m + "dt_proj.bias", (E,)
        yield m + "out_proj.weight", (d, E)
        if c.proj_bias:
            yield m + "out_proj.bias", (d,)
    yield "norm_f.weight", (d,)


class _RMSNorm(nn.Module):
    def __init__(self, d: int, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d, device=device))


class _Mixer(nn.Module):
    """The parameters of one layer's mixer, named as transformers' MambaMixer names them."""

    def __init__(self, c: BackboneConfig, device, dtype):
        super().__init__()
        d, E, N, K, R = c.d_model, c.d_inner, c.d_state, c.d_conv, c.dt_rank
        self.in_proj = nn.Linear(d, 2 * E, bias=c.proj_bias, device=device)
        self.conv1d = nn.Conv1d(E, E, K, groups=E, padding=K - 1, bias=c.conv_bias, device=device)
        self.x_proj = nn.Linear(E, R + 2 * N, bias=False, device=device)
        self.dt_proj = nn.Linear(R, E, bias=True, device=device)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32, device=device)).repeat(E, 1))
        self.D = nn.Parameter(torch.ones(E, device=device))
        self.out_proj = nn.Linear(E, d, bias=c.proj_bias, device=device)
        self._init_step_sizes(c)
        with torch.no_grad():  # mamba_ssm's rescale of the residual branch's last product
            self.out_proj.weight /= math.sqrt(c.n_layer)
        for lin in (self.in_proj, self.x_proj, self.dt_proj, self.out_proj):  # the large matrices in `dtype`
            lin.weight.data = lin.weight.data.to(dtype)

    def _init_step_sizes(self, c: BackboneConfig, dt_min=1e-3, dt_max=0.1, dt_floor=1e-4) -> None:
        """mamba_ssm's: dt_proj's weight uniform in +-rank^-0.5, its bias the softplus
        inverse of step sizes log-uniform in [dt_min, dt_max]."""
        with torch.no_grad():
            std = c.dt_rank**-0.5
            self.dt_proj.weight.uniform_(-std, std)
            dt = torch.exp(torch.rand(c.d_inner, device=self.D.device) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
            dt = dt.clamp(min=dt_floor)
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def weights(self, norm_w: torch.Tensor) -> LayerWeights:
        """The layer as mamba1.mixer reads it (views of the parameters; A from A_log)."""
        return LayerWeights(
            norm_w=norm_w, in_proj_w=self.in_proj.weight, in_proj_b=self.in_proj.bias,
            conv_w=self.conv1d.weight[:, 0, :], conv_b=self.conv1d.bias, x_proj_w=self.x_proj.weight,
            dt_proj_w=self.dt_proj.weight, dt_bias=self.dt_proj.bias, A=-torch.exp(self.A_log.float()), D=self.D,
            out_proj_w=self.out_proj.weight, out_proj_b=self.out_proj.bias,
        )


class _Layer(nn.Module):
    def __init__(self, c: BackboneConfig, device, dtype):
        super().__init__()
        self.norm = _RMSNorm(c.d_model, device)
        self.mixer = backbone_mamba2.Mixer2(c, device, dtype) if c.layer == "mamba2" else _Mixer(c, device, dtype)


class Backbone(nn.Module):
    """Mamba's layers and final norm over vectors: (B, T, input_dim) -> (B, T, d_model) float32.

    config: the sizes (BackboneConfig). device, dtype: where the parameters live and the
    storage dtype of the large matrices (float32 default; norms, conv, A_log, D and biases
    stay float32). state_dtype: the dtype of the states `new_state` makes (float32 default, or
    bfloat16: core/dtypes.parse_state_dtype).
    Fresh parameters take mamba_ssm's initialisation from torch's RNG. state_dict names are
    transformers' MambaModel's (Mamba2Model's for config.layer "mamba2") without the
    embedding, plus `input_proj.*`.
    `.half()`, `.bfloat16()`, `.to(dtype)` change the large matrices' storage dtype alone (the
    rest stays float32); a dtype other than float32, bfloat16 and float16 is a ValueError.
    deterministic (also settable later): a row's outputs of `step` and of the sequence pass
    are the same bits whatever the batch it sits in, and the backward is the same bits run to
    run (backbone_ops.py: batch-invariant products and norms, no atomics); it costs speed.
    Under torch.autocast, a pass that autograd differentiates runs its products in
    autocast's dtype (parameters, gradients and the rest float32); the step and a pass
    without autograd keep the Backbone's own dtypes.

    On CUDA, `step` replays a CUDA graph of the step. The graphs are kept by batch size and
    state dtype (the decode kernels, their buffers and one memory pool each; the 8 sizes used
    last), and inside those by where the state's tensors lie in memory, since a graph reads
    and writes the memory it was captured on: a state stepped for the first time costs a
    capture (about three steps' time), and the 4 state addresses used last keep theirs. A
    state made after another of its batch was freed mostly lands where that one lay and
    replays its graph. So a run that makes a state per episode keeps a bounded number of
    graphs, and no graph keeps a state alive. Parameters written in place (optimizers,
    load_state_dict) are read by the next step as they are; parameters given new memory
    (`p.data = ...`, vector_to_parameters, load_state_dict(assign=True)) make the step drop
    its graphs and weights and make them again (backbone_step.ParameterAddresses).
    """

    def __init__(self, config: BackboneConfig, *, device=None, dtype=None, state_dtype=None,
                 deterministic: bool = False):
        super().__init__()
        if not isinstance(config, BackboneConfig):
            raise ValueError(f"config must be a BackboneConfig, got {type(config).__name__}")
        from fastmamba.core.dtypes import parse_dtype, parse_state_dtype

        self.config = config
        dtype = parse_dtype(dtype or torch.float32, fp8=False)  # (its weights are nn.Linear's tensors)
        self.state_dtype = parse_state_dtype(state_dtype or torch.float32)
        device = _parse_device(device)
        if config.input_proj:
            self.input_proj = nn.Linear(config.input_dim, config.d_model, device=device)
            self.input_proj.weight.data = self.input_proj.weight.data.to(dtype)
        else:
            self.input_proj = None
        self.layers = nn.ModuleList([_Layer(config, device, dtype) for _ in range(config.n_layer)])
        self.norm_f = _RMSNorm(config.d_model, device)
        self._graphs = LRU(STEP_BATCHES)  # (batch, state dtypes) -> StepGraphs
        self._last = None  # (graph, x's shape, the state's tensors weakly): the last device-tensor call's
        self._step_weights, self._step_versions = None, None  # the eager step's (see _eager_weights)
        self._addresses = ParameterAddresses()  # (a parameter given new memory: the step forgets its own)
        self.register_load_state_dict_post_hook(_parameters_loaded)
        self.deterministic = deterministic

    @property
    def deterministic(self) -> bool:
        return self._deterministic

    @deterministic.setter
    def deterministic(self, value: bool) -> None:
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"deterministic must be true or false, got {value!r}")
        self._deterministic = bool(value)
        self._graphs.clear()  # (the step's kernels follow the mode)
        self._last = None

    @property
    def device(self) -> torch.device:
        return self.norm_f.weight.device

    def new_state(self, batch: int) -> MambaState:
        """Zero state for `batch` slots (environments), in state_dtype, on the module's device.
        batch: a positive integer (numpy's integers too)."""
        if not isinstance(batch, (int, np.integer)) or isinstance(batch, (bool, np.bool_)) or batch < 1:
            raise ValueError(f"batch must be a positive integer, got {batch!r}")
        conv, ssm = self._state_shapes()
        L, B = self.config.n_layer, int(batch)
        return MambaState(torch.zeros(L, B, *conv, device=self.device, dtype=self.state_dtype),
                          torch.zeros(L, B, *ssm, device=self.device, dtype=self.state_dtype))

    def _state_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """One slot's conv and ssm state of a layer: Mamba-1's (E, K) and (E, N); Mamba-2's
        (E + 2GN, K) and (E, N), E = H x P (backbone_mamba2.py)."""
        c = self.config
        if c.layer == "mamba2":
            return backbone_mamba2.state_shapes(c)
        return (c.d_inner, c.d_conv), (c.d_inner, c.d_state)

    # -- the sequence pass ---------------------------------------------------------------------

    def forward(self, x: torch.Tensor, state: MambaState | None = None, resets: torch.Tensor | None = None):
        """y, new_state = bb(x, state, resets).

        x (B, T, input_dim); state: the state before step 0 (None: zeros), not modified;
        resets (B, T) bool: where true, that row's state is zero before step t (an episode's
        first step). Returns y (B, T, d_model) float32 and the state after step T-1.
        Differentiable with respect to the parameters, x and the state's tensors.
        """
        x = self._check_input(x, 3, "x", "(batch, time, input_dim)")
        B, T, _ = x.shape
        state = self.new_state(B) if state is None else self._check_state(state, B)
        if resets is not None:
            resets = torch.as_tensor(resets, device=x.device)
            if resets.shape != (B, T) or resets.dtype != torch.bool:
                raise ValueError(f"resets must be a bool tensor of shape {(B, T)} like x's (batch, time), "
                                 f"got {resets.dtype} {tuple(resets.shape)}")
        # float32 working copies, one a layer: autograd sees the state's tensors through them
        autocast = torch.is_autocast_enabled(x.device.type) and self._training(x, state)  # (the class's doc)
        with torch.autocast(x.device.type, enabled=autocast):
            convs = [state.conv[i].float().clone() for i in range(self.config.n_layer)]
            ssms = [state.ssm[i].float().clone() for i in range(self.config.n_layer)]
            y = self._layers(x, convs, ssms, resets, self._kernel_ops(x, state))
        new = MambaState(torch.stack(convs).to(state.conv.dtype), torch.stack(ssms).to(state.ssm.dtype))
        return y, new

    def _training(self, x: torch.Tensor, state: MambaState) -> bool:
        """Whether autograd will need this pass."""
        inputs = (x, state.conv, state.ssm, *self.parameters())
        return torch.is_grad_enabled() and any(t.requires_grad for t in inputs)

    def _kernel_ops(self, x: torch.Tensor, state: MambaState):
        """On CUDA: the prefill kernels' ops (Triton: the conv and the scan take the resets)
        where autograd will not need the pass, else the training ops (the conv and the scan
        as autograd Functions whose backward runs in Triton; a Mamba-2 layer's: backbone_mamba2.gpu_ops).
        Elsewhere the reference ops, a Mamba-1 scan's backward written out
        (backbone_ops.CPU_SEQUENCE_OPS; twice differentiable, as the reference).
        Deterministic: backbone_ops.py's."""
        return backbone_ops.sequence_ops(self.config.layer, self.device, self._training(x, state), self.deterministic)

    def _layers(self, x: torch.Tensor, convs, ssms, resets=None, ops=None, weights=None) -> torch.Tensor:
        """x (B, T, input_dim) -> (B, T, d_model) f32, updating each layer's conv and ssm
        state; through `ops` (None: the CPU's ops). weights: each layer's LayerWeights or
        Mamba2LayerWeights (None: read from the modules now, as autograd needs)."""
        c = self.config
        ops = ops or (backbone_mamba2.CPU_OPS if c.layer == "mamba2" else REFERENCE_OPS)
        layer = backbone_mamba2.run if c.layer == "mamba2" else mixer
        h = ops.linear(x, self.input_proj.weight, self.input_proj.bias) if self.input_proj is not None else x.float()
        o = None
        weights = weights or self._layer_weights()
        for lw, conv, ssm in zip(weights, convs, ssms):
            h, u = ops.add_norm(h, o, lw.norm_w, c.norm_eps, lw.in_proj_w.dtype)
            o = layer(c, lw, u, conv, ssm, ops, resets=resets)
        return ops.add_norm(h, o, self.norm_f.weight, c.norm_eps, torch.float32)[1]

    # -- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, x, state: MambaState):
        """One step for every slot: x (B, input_dim) -> y (B, d_model) float32; updates
        `state` in place. x a device tensor gives one; a CPU tensor or a numpy array on a
        CUDA module goes through pinned buffers and gives the same type back. On CUDA the
        step is one CUDA-graph replay (see the class's doc for which graphs are kept)."""
        if torch.is_autocast_enabled(self.device.type):  # the step keeps the Backbone's own dtypes
            with torch.autocast(self.device.type, enabled=False):
                return self._step(x, state)
        return self._step(x, state)

    def _step(self, x, state: MambaState):
        if self._addresses.moved(self):
            self._forget_step()
        last = self._last
        if (last is not None and type(x) is torch.Tensor and state.conv is last[2]() and state.ssm is last[3]()
                and x.shape == last[1] and x.get_device() == last[0].device_index and x.is_floating_point()):
            return last[0].on_device(x)  # the same batch, state and device as the last call: checked then
        as_numpy = isinstance(x, np.ndarray)
        if as_numpy:
            if x.dtype.kind != "f":
                raise ValueError(f"x must hold floating-point values, got a numpy array of dtype {x.dtype}")
            x = torch.from_numpy(np.ascontiguousarray(x))
        x = self._check_input(x, 2, "x", "(batch, input_dim)", move=False)
        state = self._check_state(state, x.shape[0])
        if self.device.type != "cuda":
            y = self._step_eager(x.to(self.device), state)
            return y.numpy() if as_numpy else y
        graph = self._graph_for(state)
        if x.device.type == "cuda":
            if x.device != self.device:
                raise ValueError(f"x is on {x.device}, the backbone on {self.device}")
            self._last = (graph, x.shape, weakref.ref(state.conv), weakref.ref(state.ssm))
            return graph.on_device(x)
        return graph.from_host(x, as_numpy, state)

    @property
    def _last_graph(self):
        """The graph of the last device-tensor call (benchmarks time its replay alone)."""
        return self._last[0] if self._last is not None else None

    @_last_graph.setter
    def _last_graph(self, value) -> None:
        assert value is None, "only cleared"
        self._last = None

    def _graph_for(self, state: MambaState) -> StateGraph:
        """The step's graph over this state's memory: from the graphs of its batch size and
        dtypes, captured if that memory has none."""
        key = (state.batch, state.conv.dtype, state.ssm.dtype)
        graphs = self._graphs.get(key, lambda: StepGraphs(self, state.batch))
        return graphs.for_state(state)

    def _forget_step(self) -> None:
        """Drops the step's graphs and weights, made over parameters that have moved."""
        self._graphs.clear()
        self._last = None
        self._step_weights, self._step_versions = None, None
        self._addresses.forget()

    def _apply(self, fn, *args, **kwargs):
        # .to(), .cuda(), .half() move or remake the parameters the graphs read
        self._forget_step()
        target = fn(torch.zeros((), device=self.device))  # what fn makes of a float32 tensor
        if target.dtype == torch.float32:
            return super()._apply(fn, *args, **kwargs)
        if target.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"a Backbone stores its large matrices in float32, bfloat16 or float16, not "
                             f"{str(target.dtype).removeprefix('torch.')}")
        # A 16-bit dtype is the large matrices' storage: the norms, conv, A_log, D and biases
        # stay float32 (moved to the device fn names, not rounded through 16 bits).
        large = {id(t) for p in self._large_matrices() for t in (p, p.grad) if t is not None}
        return super()._apply(lambda t: fn(t) if id(t) in large or not t.is_floating_point() else t.to(target.device),
                              *args, **kwargs)

    def _large_matrices(self) -> list:
        large = [self.input_proj.weight] if self.input_proj is not None else []
        for layer in self.layers:
            m = layer.mixer
            if isinstance(m, backbone_mamba2.Mixer2):
                large += m.large_matrices()
            else:
                large += [m.in_proj.weight, m.x_proj.weight, m.dt_proj.weight, m.out_proj.weight]
        return large

    def _layer_weights(self) -> list:
        """Each layer as mamba1.mixer (or mamba2.mixer2) reads it: views of the parameters, A from A_log."""
        return [layer.mixer.weights(layer.norm.weight) for layer in self.layers]

    def _eager_weights(self) -> list:
        """Each layer's LayerWeights for the no-grad CPU step, kept between steps: views of
        the parameters (which optimizers and load_state_dict update in place; .to() and the
        like clear them, see _apply), with A = -exp(A_log) made anew once A_log has changed.
        Making them every step cost ~100 µs of the 128 x 3 batch-1 step's ~630 (2-core CI host)."""
        versions = [layer.mixer.A_log._version for layer in self.layers]
        if versions != self._step_versions:
            self._step_weights = self._layer_weights()
            self._step_versions = versions
        return self._step_weights

    def _step_eager(self, x: torch.Tensor, state: MambaState) -> torch.Tensor:
        # (on CUDA this runs inside a CUDA graph, whose replays must make A from A_log themselves)
        weights = self._eager_weights() if self.device.type == "cpu" else None
        ops = backbone_ops.step_ops(self.config, self.device, self.deterministic, storage_dtype(self), len(x))
        if state.conv.dtype == torch.float32 and state.ssm.dtype == torch.float32:
            return self._layers(x[:, None], list(state.conv), list(state.ssm), ops=ops, weights=weights)[:, 0]
        convs, ssms = list(state.conv.float()), list(state.ssm.float())  # 16-bit state: update in f32
        y = self._layers(x[:, None], convs, ssms, ops=ops, weights=weights)[:, 0]
        state.conv.copy_(torch.stack(convs))  # rounded once, on store
        state.ssm.copy_(torch.stack(ssms))
        return y

    # -- checks --------------------------------------------------------------------------------

    def _check_input(self, x, ndim: int, name: str, layout: str, move: bool = True) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor {layout}, got {_describe(x)}")
        if x.dim() != ndim or x.shape[-1] != self.config.input_dim or 0 in x.shape:
            expected = "(B, T, %d)" % self.config.input_dim if ndim == 3 else "(B, %d)" % self.config.input_dim
            raise ValueError(f"{name} must have shape {expected} {layout}, got {tuple(x.shape)}")
        return x.to(self.device) if move else x

    def _check_state(self, state, batch: int) -> MambaState:
        if not isinstance(state, MambaState):
            raise ValueError(f"state must be a MambaState (Backbone.new_state), got {type(state).__name__}")
        if not state.conv.is_floating_point() or not state.ssm.is_floating_point():
            raise ValueError(f"state must hold floating-point tensors (Backbone.new_state's are "
                             f"{str(self.state_dtype).removeprefix('torch.')}), got conv {state.conv.dtype} and ssm "
                             f"{state.ssm.dtype}")
        c, (conv1, ssm1) = self.config, self._state_shapes()
        conv, ssm = (c.n_layer, batch, *conv1), (c.n_layer, batch, *ssm1)
        if tuple(state.conv.shape) != conv or tuple(state.ssm.shape) != ssm:
            raise ValueError(f"state has conv {tuple(state.conv.shape)} and ssm {tuple(state.ssm.shape)}, but this "
                             f"backbone at batch {batch} needs conv {conv} and ssm {ssm}")
        if state.conv.device != self.device or state.ssm.device != self.device:
            raise ValueError(f"state is on {state.conv.device}, the backbone on {self.device}")
        return state

    # -- files ---------------------------------------------------------------------------------

    def save(self, folder) -> None:
        """Writes config.json and model.safetensors into `folder` (created if need be)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"format": FORMAT, **dataclasses.asdict(self.config)}, indent=2))
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(folder / "model.safetensors"))

    @classmethod
    def load(cls, folder, *, device=None, dtype=None, state_dtype=None, deterministic: bool = False) -> "Backbone":
        """A Backbone saved by `save`, strictly: a missing, unexpected or misshapen tensor or a
        bad config raises CheckpointError naming the file and the tensor or key. dtype: the
        large matrices' storage (default: as saved); state_dtype, deterministic: as Backbone's."""
        from safetensors import safe_open

        from fastmamba.io.checkpoint import one_line

        folder = Path(folder)
        cfg_path, weights_path = folder / "config.json", folder / "model.safetensors"
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg_path}: cannot read a backbone config ({type(e).__name__}: {e})") from None
        if not isinstance(raw, dict) or raw.pop("format", None) != FORMAT:
            raise CheckpointError(f"{cfg_path}: not a fastmamba.Backbone config (its 'format' is not {FORMAT!r})")
        fields = {f.name for f in dataclasses.fields(BackboneConfig)}
        if unknown := sorted(set(raw) - fields):
            raise CheckpointError(f"{cfg_path}: unknown key '{unknown[0]}'")
        try:
            config = BackboneConfig(**raw)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{cfg_path}: {e}") from None
        try:
            with safe_open(str(weights_path), framework="pt") as f:
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # missing, truncated or corrupt: the library's many error types
            raise CheckpointError(f"{weights_path}: cannot read weights ({one_line(e)})") from None
        # the file against the config before a layer is built (a config of far more layers
        # than the file holds fails at the first one missing)
        expected = 0
        for name, shape in tensor_shapes(config):
            t = tensors.get(name)
            if t is None:
                raise CheckpointError(f"{weights_path}: missing tensor '{name}'")
            if tuple(t.shape) != shape:
                raise CheckpointError(f"{weights_path}: tensor '{name}' has shape {tuple(t.shape)}, "
                                      f"config.json implies {shape}")
            if not t.is_floating_point() or not torch.isfinite(t).all():
                raise CheckpointError(f"{weights_path}: tensor '{name}' is not finite floating point")
            expected += 1
        if len(tensors) > expected:
            names = {name for name, _ in tensor_shapes(config)}
            raise CheckpointError(f"{weights_path}: unexpected tensor '{min(set(tensors) - names)}'")
        bb = cls(config, device=device, dtype=dtype or tensors["layers.0.mixer.in_proj.weight"].dtype,
                 state_dtype=state_dtype, deterministic=deterministic)
        dtypes = {name: p.dtype for name, p in bb.state_dict().items()}
        bb.load_state_dict({k: v.to(dtypes[k]) for k, v in tensors.items()})
        return bb

    @classmethod
    def of_language_model(cls, model) -> "Backbone":
        """The language model's layers and final norm as a Backbone over its own tensors
        (input_dim = d_model, no input_proj): the large matrices are shared, not copied;
        A_log is derived once from the model's A."""
        c, w = model.config, model.weights
        if c.layer != "mamba1":
            raise ValueError(f"a {c.layer} model's layers are not shared as a fastmamba.Backbone: of_language_model takes "
                             "Mamba-1 models (BackboneConfig(layer='mamba2') makes a fresh Mamba-2 Backbone)")
        if c.dbc_norm_eps is not None:
            raise ValueError("a Falcon-Mamba model's layers are not a fastmamba.Backbone (their norm of dt, B, C)")
        if w.dtype == torch.float8_e4m3fn:
            raise ValueError("an fp8 model's layers are not a fastmamba.Backbone (its weights are nn.Linear's tensors, "
                             "not FP8 ones): load the model with dtype float32, bfloat16 or float16")
        config = BackboneConfig(
            input_dim=c.d_model, d_model=c.d_model, n_layer=c.n_layer, d_state=c.d_state, d_conv=c.d_conv,
            expand=c.d_inner // c.d_model, dt_rank=c.dt_rank, norm_eps=c.norm_eps, conv_bias=c.conv_bias,
            proj_bias=c.proj_bias, input_proj=False,
        )
        if config.d_inner != c.d_inner:
            raise ValueError(f"d_inner {c.d_inner} is not a multiple of d_model {c.d_model}")
        bb = cls(config, device="meta", dtype=w.embedding.dtype, state_dtype=model.state_dtype)

        def share(module, name, tensor):
            if tensor is not None:
                setattr(module, name, nn.Parameter(tensor, requires_grad=False))

        for layer, lw in zip(bb.layers, w.layers):
            m = layer.mixer
            share(layer.norm, "weight", lw.norm_w)
            share(m.in_proj, "weight", lw.in_proj_w)
            share(m.in_proj, "bias", lw.in_proj_b)
            share(m.conv1d, "weight", lw.conv_w[:, None, :])
            share(m.conv1d, "bias", lw.conv_b)
            share(m.x_proj, "weight", lw.x_proj_w)
            share(m.dt_proj, "weight", lw.dt_proj_w)
            share(m.dt_proj, "bias", lw.dt_bias)
            share(m, "A_log", torch.log(-lw.A))
            share(m, "D", lw.D)
            share(m.out_proj, "weight", lw.out_proj_w)
            share(m.out_proj, "bias", lw.out_proj_b)
        share(bb.norm_f, "weight", w.norm_f)
        return bb


def _parameters_loaded(module: Backbone, incompatible_keys) -> None:
    module._addresses.forget()  # (assign=True made new parameters: their addresses are compared next step)


def _parse_device(device) -> torch.device | None:
    """The module's device from a name or torch.device (None: torch's default), refused as
    `fastmamba.load` refuses it."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda", "meta"):  # (mps, xpu...: no ops of this module's run there; meta: shapes only)
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but PyTorch sees no CUDA GPU here")
    return dev


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
