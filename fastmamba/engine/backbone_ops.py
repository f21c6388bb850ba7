"""Which ops fastmamba.Backbone's passes run on (by device, layer, autograd and mode), and the
pieces of its deterministic mode on CUDA (Backbone(deterministic=True)).

Deterministic: a row's outputs, of the step and of the sequence pass, are the same bits
whatever the batch it sits in, and the backward is the same bits run to run. What breaks
that on the GPU path, and what runs instead:
- products: cuBLAS picks its algorithm by the shape, so they go through
  kernels/products.linear_invariant (a fixed sum per output element; float32 operands in
  three TF32 passes, within ~2^-22 of float32); their backward through torch's products,
  the same bits run to run on one stream;
- torch's row reductions (the norms' mean of squares) pick their thread layout by the row
  count: the norms' forward runs the Triton row kernels, their backward torch's ops on the
  reference's forward, recomputed;
- the training kernels' atomics (the scan's dB and dC, the conv's dw and db): per-program
  partial sums added in a fixed order (kernels/scan_grad.py, kernels/conv_grad.py);
- the prefill kernels choose their launch (and so their sums' order) by the batch size: the
  sequence pass runs the training kernels with or without autograd; the step runs the
  decode plan's deterministic step (invariant_gemm's products).
The Mamba-2 SSD's training kernels need nothing: no atomics, launches chosen by the length.
The cost (not yet measured on a GPU: benchmarks/backbone.py --training --deterministic):
Triton products in place of cuBLAS's (float32 ones in three passes), the partial sums'
memory, and without autograd the training kernels in float32 in place of the prefill ones.
On the CPU the mode changes nothing: repeated runs give the same bits (tested; MKL's own
settings, MKL_CBWR, govern its products' reproducibility), but a row's last bits may depend
on the batch (MKL picks its product kernels by the row count, and torch's vectorized
element-wise functions, silu and softplus among them, compute a tensor's tail in scalar
code: which elements fall there depends on the batch).

Autocast: where autograd needs the pass (training), the products follow an enclosing
torch.autocast (they run in its dtype) and the training kernels' Functions take float32
(custom_fwd); elsewhere (the step, a pass without autograd) the Backbone's own dtypes hold.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from fastmamba.core.ops import REFERENCE_OPS, Ops
from fastmamba.engine import backbone_mamba2
from fastmamba.engine.plan import CPU_SCAN_CHUNK_ELEMENTS
from fastmamba.kernels.scan_grad import step_and_scan_train_ref

# A Mamba-1 sequence pass off the GPU path: the reference ops, but for the scan, whose
# backward is written out (scan_grad.step_and_scan_train_ref: the same values, a small
# fraction of the calls that autograd through the reference's time loop makes)
CPU_SEQUENCE_OPS = replace(REFERENCE_OPS, scan=partial(step_and_scan_train_ref, chunk_elements=CPU_SCAN_CHUNK_ELEMENTS))


def operand_dtype(device_type: str) -> torch.dtype:
    """The dtype of the products' operands: an enclosing autocast's for this device, else float32."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.float32


class _InvariantLinear(torch.autograd.Function):
    """x @ weight.T + bias, float32, each row's result the same bits at any row count
    (kernels/products.linear_invariant). The backward: torch's products (the same bits run
    to run, not batch-invariant: nothing asks it to be)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        from fastmamba.kernels.products import linear_invariant

        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        w = weight.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            y = linear_invariant(x2, w)
        ctx.save_for_backward(x2, w)
        ctx.shape, ctx.has_bias = x.shape, bias is not None
        y = y.view(*x.shape[:-1], w.shape[0])
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        with torch.autocast(x2.device.type, enabled=False):
            d2 = dy.reshape(-1, w.shape[0])
            dx = (d2.to(w.dtype) @ w).view(ctx.shape) if ctx.needs_input_grad[0] else None
            dw = d2.t().to(x2.dtype) @ x2 if ctx.needs_input_grad[1] else None
            db = d2.float().sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype=None) -> torch.Tensor:
    """Ops.linear of the deterministic mode (see _InvariantLinear): float32 (out_dtype, as
    the reference's, ignored), operands in float32 or an enclosing autocast's dtype."""
    return _InvariantLinear.apply(x, weight, bias, operand_dtype(x.device.type))


class _KernelForward(torch.autograd.Function):
    """kernel(*tensors) forward, the gradients of ref(*tensors) backward (recomputed): a
    Triton row kernel's batch-invariant values with its reference twin's derivative."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, kernel, ref, *tensors):
        ctx.ref = ref
        ctx.save_for_backward(*tensors)
        return kernel(*tensors)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:])]
        with torch.enable_grad():
            out = ctx.ref(*inputs)
        wanted = [t for t in inputs if t.requires_grad]
        found = iter(torch.autograd.grad(out, wanted, grad)) if wanted else iter(())
        return (None, None, *(next(found) if t.requires_grad else None for t in inputs))


def add_norm_invariant(h, o, norm_w, eps, dtype=None):
    """Ops.add_norm of the deterministic training ops: add_norm_train's values (float32),
    the norm's forward by kernels/rmsnorm's row kernel."""
    from fastmamba.kernels.rmsnorm import residual_rmsnorm, residual_rmsnorm_ref

    def kernel(h, w):
        u = torch.empty_like(h)
        residual_rmsnorm(h, None, None, w, eps, u)
        return u

    h = h.float() if o is None else h + o
    return h, _KernelForward.apply(kernel, lambda h, w: residual_rmsnorm_ref(h, None, None, w, eps)[1],
                                   h.contiguous(), norm_w.float())


def gated_norm_invariant(y, z, weight, groups: int, eps: float, norm_before_gate: bool = False, out_dtype=None):
    """Ops.gated_norm of the deterministic training ops: gated_rmsnorm_ref's values (float32),
    the forward by kernels/gated_norm's row kernel."""
    from fastmamba.kernels.gated_norm import gated_rmsnorm, gated_rmsnorm_ref

    return _KernelForward.apply(
        lambda y, z, w: gated_rmsnorm(y, z, w, groups, eps, norm_before_gate, torch.float32),
        lambda y, z, w: gated_rmsnorm_ref(y, z, w, groups, eps, norm_before_gate),
        y.float().contiguous(), z.float().contiguous(), weight.float())


def deterministic_ops(layer: str) -> Ops:
    """The sequence pass's ops in deterministic mode on CUDA, with autograd or without (see
    the module's doc). (The Triton interpreter's tests run them on CPU tensors.)"""
    from fastmamba.core.ops import training_ops
    from fastmamba.engine.plan import KERNEL_TILES
    from fastmamba.kernels.conv_grad import causal_conv1d_train
    from fastmamba.kernels.scan_grad import step_and_scan_train

    ops = backbone_mamba2.gpu_ops(training=True) if layer == "mamba2" else training_ops(KERNEL_TILES)
    return replace(ops, linear=invariant_linear, add_norm=add_norm_invariant, gated_norm=gated_norm_invariant,
                   conv=partial(causal_conv1d_train, tiles=KERNEL_TILES.conv_grad, deterministic=True),
                   scan=partial(step_and_scan_train, tiles=KERNEL_TILES.train_scan, deterministic=True))


def sequence_ops(layer: str, device: torch.device, training: bool, deterministic: bool) -> Ops:
    """The ops of the sequence pass (see backbone.Backbone._kernel_ops)."""
    from fastmamba.kernels._triton import HAVE_TRITON

    if device.type != "cuda" or not HAVE_TRITON:
        return backbone_mamba2.CPU_OPS if layer == "mamba2" else CPU_SEQUENCE_OPS
    if deterministic:
        return deterministic_ops(layer)
    if layer == "mamba2":
        return backbone_mamba2.gpu_ops(training)
    from fastmamba.core.ops import training_ops, triton_ops
    from fastmamba.engine.plan import KERNEL_TILES

    return training_ops(KERNEL_TILES) if training else triton_ops(KERNEL_TILES)


def step_ops(config, device: torch.device, deterministic: bool, dtype: torch.dtype = torch.float32,
             batch: int = 1) -> Ops:
    """The ops of the eager step (BackboneConfig `config`): the CPU's, and on CUDA a Mamba-2
    layer's (in a CUDA graph), the GPU ops of the plan's step for the large matrices' dtype
    and the batch (plan.backbone_step_plan: its products through cuBLAS or invariant_gemm;
    deterministic: invariant_gemm's, as the language model's deterministic step)."""
    if config.layer != "mamba2":
        return REFERENCE_OPS
    from fastmamba.engine.plan import backbone_step_plan

    return backbone_mamba2.step_ops(device, backbone_step_plan(config, dtype, batch, deterministic))
