"""The Backbone's step on CUDA: the whole step in one launch at small widths (LockstepKernels:
kernels/lockstep_step.py, where the plan's LOCKSTEP_ROUTES say so), else the language
model's decode kernels over the backbone's own parameters (KernelStep); replayed as CUDA
graphs kept by batch size and state dtypes, and within those by the state's memory, both
bounded (StepGraphs, StateGraph). `bb` is always a
fastmamba.Backbone (backbone.py, which imports this module)."""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
from torch import nn

from fastmamba.core.state import MambaState
from fastmamba.kernels.products import linear_invariant, linear_storage


def decode_model(bb: nn.Module):
    """The backbone as a language model for the decode kernels: an identity matrix as the
    embedding (unused: the step takes vectors) and as lm_head, so that the "logits" are the
    final-normed hidden state; the layers read the module's parameters, not copies (A = -exp(A_log)
    is the one derived tensor: KernelStep.sync)."""
    from fastmamba.core.config import MambaConfig
    from fastmamba.core.model import Mamba, MambaWeights
    from fastmamba.core.ops import triton_ops
    from fastmamba.engine.plan import KERNEL_TILES

    c = bb.config
    storage = bb.layers[0].mixer.in_proj.weight.dtype
    sizes = MambaConfig(
        d_model=c.d_model, n_layer=c.n_layer, vocab_size=c.d_model, d_state=c.d_state, d_conv=c.d_conv,
        d_inner=c.d_inner, dt_rank=c.dt_rank, conv_bias=c.conv_bias, proj_bias=c.proj_bias, norm_eps=c.norm_eps,
    )
    eye = torch.eye(c.d_model, device=bb.device, dtype=storage)
    with torch.no_grad():  # the kernels read the parameters themselves
        layers = bb._layer_weights()
    return Mamba(sizes, MambaWeights(embedding=eye, layers=layers, norm_f=bb.norm_f.weight, lm_head=eye), triton_ops(KERNEL_TILES))


class KernelStep:
    """The step through the language model's decode kernels (kernels/decode_step.py: one
    row a program at small batches; decode_gemm.py's step above), with vectors in place of
    the embedding lookup and an identity matrix as lm_head, so that what they return is the
    final-normed hidden state. Needs Triton; the state in any float dtype (the kernels update
    it in float32 and round once on store). The backbone's deterministic mode takes the
    decode plan's deterministic step and input_proj through invariant_gemm: a row's bits the
    same at any batch size."""

    def __init__(self, bb: nn.Module, batch: int):
        from fastmamba.engine.decode_step import make_decode_step

        self.config, self.input_proj = bb.config, bb.input_proj  # (not bb: the backbone holds this)
        model = decode_model(bb)
        self.layers = model.weights.layers
        self.A_logs = [layer.mixer.A_log for layer in bb.layers]  # (read every step: no module lookups)
        self.versions = tuple(a._version for a in self.A_logs)
        self.step = make_decode_step(model, batch, bb.deterministic)
        self.input_linear = linear_invariant if bb.deterministic else linear_storage

    def sync(self) -> None:
        """A = -exp(A_log) anew where A_log has changed since (an optimizer step bumps its
        version counter); outside any graph, before a replay."""
        versions = tuple(a._version for a in self.A_logs)
        if versions != self.versions:
            with torch.no_grad():
                for lw, A_log in zip(self.layers, self.A_logs):
                    torch.exp(A_log.float(), out=lw.A).neg_()
            self.versions = versions

    def __call__(self, x: torch.Tensor, state: MambaState) -> torch.Tensor:
        p = self.input_proj
        h = self.input_linear(x, p.weight, p.bias) if p is not None else x.float()
        return self.step(None, state, h=h)


class LockstepKernels:
    """The lockstep step (kernels/lockstep_step.py) over a Backbone's parameters, read
    through a table of their addresses: an optimizer's in-place updates are seen at once, and
    A = -exp(A_log) is taken in the kernel (nothing to sync). Moving the module (`.to()`)
    drops the Backbone's steps (Backbone._apply), and with them this table."""

    def __init__(self, bb: nn.Module, batch: int, route):
        from fastmamba.kernels.lockstep_step import SLOTS, LockstepStep

        self.tensors = []  # held, so that the table's addresses stay theirs
        table = []
        for layer in bb.layers:
            tensors = lockstep_tensors(layer)
            self.tensors += [t for t in tensors.values() if t is not None]
            table.append([tensors[name].data_ptr() if tensors[name] is not None else 0 for name in SLOTS])
        p = bb.input_proj
        self.step = LockstepStep(bb.config, torch.tensor(table, dtype=torch.int64, device=bb.device), storage_dtype(bb),
                                 (p.weight, p.bias) if p is not None else None, bb.norm_f.weight, batch, route.rows,
                                 bb.config.d_inner // route.channels, route.warps)

    def sync(self) -> None:
        pass

    def __call__(self, x: torch.Tensor, state: MambaState) -> torch.Tensor:
        return self.step(x, state)


def storage_dtype(bb: nn.Module) -> torch.dtype:
    """The large matrices' dtype."""
    return bb.layers[0].mixer.in_proj.weight.dtype


def lockstep_tensors(layer) -> dict:
    """One Mamba-1 layer's parameters by the lockstep table's slot names: the layer as
    mamba1.mixer reads it (the mixer's `weights`: views of the parameters), with A_log in
    place of A, which the kernel takes from it."""
    from fastmamba.kernels.lockstep_step import SLOTS

    lw = layer.mixer.weights(layer.norm.weight)
    return {name: layer.mixer.A_log if name == "A_log" else getattr(lw, name) for name in SLOTS}


def lockstep_reads(bb: nn.Module) -> bool:
    """Whether the lockstep kernel reads these parameters as they lie: the large matrices
    (input_proj's too) in one storage dtype, the rest float32, all contiguous (as Backbone
    makes them; a module cast by hand otherwise takes the decode kernels' step)."""
    storage = storage_dtype(bb)
    named = [(k, t) for layer in bb.layers for k, t in lockstep_tensors(layer).items()]
    named.append(("norm_f", bb.norm_f.weight))
    if bb.input_proj is not None:
        named += [("input_proj_w", bb.input_proj.weight), ("input_proj_b", bb.input_proj.bias)]
    return all(t is None or (t.dtype == (storage if k.endswith("_proj_w") else torch.float32) and t.is_contiguous())
               for k, t in named)


def step_kernels(bb: nn.Module, batch: int):
    """The kernels of a Mamba-1 Backbone's step on CUDA at this batch size, as the plan
    names them: LockstepKernels where a row of LOCKSTEP_ROUTES takes the batch (and the
    parameters lie as the kernel reads them), else KernelStep."""
    from fastmamba.engine.plan import lockstep_route

    sms = torch.cuda.get_device_properties(bb.device).multi_processor_count
    route = lockstep_route(bb.config, storage_dtype(bb), batch, bb.deterministic, sms) if lockstep_reads(bb) else None
    return LockstepKernels(bb, batch, route) if route is not None else KernelStep(bb, batch)


# Bounds on the step's CUDA graphs (see Backbone's doc): a graph costs its capture's memory
# and a capture about three steps' time, while a run steps a few batch sizes (rollouts,
# evaluation) and one or two states a batch size at a time.
STEP_BATCHES = 8  # batch sizes (and state dtypes) with their kernels, buffers and graphs kept
STATES_PER_BATCH = 4  # state addresses with a graph kept, per batch size


class ParameterAddresses:
    """Where a module's parameters' values lie, as its step's weights and graphs last read them.
    Optimizers, load_state_dict and `p.data.mul_()` write in place: nothing moves. A parameter
    given new memory (`p.data = ...`, torch.nn.utils.vector_to_parameters, load_state_dict
    with assign=True, which makes new parameters: forget() is its post-load hook's) moves,
    and moved() says so once. (A list of the parameters, their addresses compared: ~3 µs a
    step at 128 x 3's 33 parameters on the 2-core host, where walking module.parameters()
    took ~30.)"""

    def __init__(self):
        self.params, self.at = None, None

    def moved(self, module) -> bool:
        if self.params is None:
            self.params = list(module.parameters())
        at = list(map(torch.Tensor.data_ptr, self.params))
        moved, self.at = self.at is not None and at != self.at, at
        return moved

    def forget(self) -> None:
        self.params = None  # (made again from the module; `at` stays, to compare with)


class LRU:
    """A dict of at most `size` entries that drops the least recently used."""

    def __init__(self, size: int):
        self.size = size
        self.entries: OrderedDict = OrderedDict()

    def get(self, key, make):
        """The entry of `key`, made by make() (and the oldest dropped) if there is none."""
        value = self.entries.get(key)
        if value is None:
            value = make()
            self.entries[key] = value
            if len(self.entries) > self.size:
                self.entries.popitem(last=False)
        else:
            self.entries.move_to_end(key)
        return value

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)


def state_address(state: MambaState) -> tuple:
    """Where a state's tensors lie: what a graph captured over them reads and writes (their
    shapes and dtype are the graph's batch size's)."""
    return state.conv.data_ptr(), state.conv.stride(), state.ssm.data_ptr(), state.ssm.stride()


class StepGraphs:
    """The step at one batch size on CUDA: the kernels step_kernels picks where Triton is
    there, with their scratch, else (and for Mamba-2 layers) the module's own step; the input
    and output buffers; one memory pool; and the graphs over the last STATES_PER_BATCH state
    addresses. The kernels and buffers are made at the first capture. Holds the backbone
    weakly (the backbone holds this)."""

    def __init__(self, bb: nn.Module, batch: int):
        self.bb, self.batch = weakref.ref(bb), batch
        self.states = LRU(STATES_PER_BATCH)  # state_address -> StateGraph
        self.kernels = self.run = None

    def for_state(self, state: MambaState) -> "StateGraph":
        return self.states.get(state_address(state), lambda: StateGraph(self, state))

    def _setup(self) -> None:
        from fastmamba.kernels._triton import HAVE_TRITON

        bb, B = self.bb(), self.batch
        dev = bb.device
        if HAVE_TRITON and bb.config.layer == "mamba1":
            self.kernels = self.run = step_kernels(bb, B)
        else:  # the module's own step (a Mamba-2 layer's on the GPU ops: backbone_mamba2.step_ops)
            module = self.bb
            self.run = lambda x, state: module()._step_eager(x, state)
        self.device_index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.x = torch.zeros(B, bb.config.input_dim, device=dev)
        self.host_x = torch.zeros(B, bb.config.input_dim, pin_memory=True)
        self.host_y = torch.zeros(B, bb.config.d_model, pin_memory=True)
        self.pool = torch.cuda.graph_pool_handle()  # one replays at a time: the graphs share scratch

    def capture(self, body, state: MambaState):
        """capture_graph's, with the state as it was before the warm-up calls."""
        from fastmamba.engine.cuda_graphs import capture_graph

        if self.run is None:
            self._setup()
        saved = (state.conv.clone(), state.ssm.clone())
        graph, out = capture_graph(body, self.pool)
        state.conv.copy_(saved[0])
        state.ssm.copy_(saved[1])
        return graph, out


class StateGraph:
    """The step over one state's memory, as CUDA graphs captured on first use: one for
    device tensors (x copied in, y cloned out), one for host tensors (the copies from and to
    pinned buffers inside the graph, so a call is one replay and one wait). Holds no
    reference to the state: its memory is where the graphs read and write it."""

    def __init__(self, graphs: StepGraphs, state: MambaState):
        self.graphs = graphs
        conv, ssm = state.conv, state.ssm  # (the bodies run at capture only)
        self.device_graph, self.y = graphs.capture(lambda: graphs.run(graphs.x, MambaState(conv, ssm)), state)
        self.x, self.kernels, self.device_index = graphs.x, graphs.kernels, graphs.device_index  # (the batch's)
        self.host_graph = None

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            self.kernels.sync()  # A, after an optimizer step
        self.x.copy_(x)
        self.device_graph.replay()
        return self.y.clone()  # the graph's own output is rewritten by the next step

    def from_host(self, x: torch.Tensor, as_numpy: bool, state: MambaState):
        g = self.graphs
        if self.host_graph is None:
            def body():
                g.x.copy_(g.host_x, non_blocking=True)
                g.host_y.copy_(g.run(g.x, state), non_blocking=True)
            self.host_graph = g.capture(body, state)[0]
        if g.kernels is not None:
            g.kernels.sync()  # A, after an optimizer step
        g.host_x.copy_(x)
        self.host_graph.replay()
        torch.cuda.current_stream().synchronize()
        return g.host_y.numpy().copy() if as_numpy else g.host_y.clone()
