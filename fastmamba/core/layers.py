"""The one table of layer kinds: what each model family's recurrent layer is (its mixer, its
tensors and their shapes, its weights built from them, a slot's state shapes, whether the
Triton engine runs it), and the memory a slot's state takes, read from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fastmamba.core import mamba2
from fastmamba.core.mamba1 import mamba1_shapes, mamba1_weights, mixer


@dataclass(frozen=True)
class LayerKind:
    """What a model family's recurrent layer is: its mixer (the `mixer` signature), its
    tensors and their shapes, its weights from them, and one slot's conv and ssm state shapes."""

    mixer: Callable
    shapes: Callable  # (config, prefix) -> {HF name: shape}
    weights: Callable  # (prefix, big, small) -> the layer's weights
    state: Callable  # config -> (conv state shape, ssm state shape) of one slot
    gpu_kernels: bool  # whether the Triton engine runs it


# The one table of layer kinds (MambaConfig.layer): the loader, the shape checks, the state
# and its size, and the engine read it; a hybrid model's attention layers would be a row.
LAYER_KINDS = {
    "mamba1": LayerKind(mixer=mixer, shapes=mamba1_shapes, weights=mamba1_weights,
                        state=lambda c: ((c.d_inner, c.d_conv), (c.d_inner, c.d_state)), gpu_kernels=True),
    "mamba2": LayerKind(mixer=mamba2.mixer2, shapes=mamba2.shapes, weights=mamba2.layer_weights,
                        state=mamba2.state_shapes, gpu_kernels=True),
}


def layer_kind(config) -> LayerKind:
    return LAYER_KINDS[getattr(config, "layer", "mamba1")]




def state_bytes(config, dtype_bytes: int) -> int:
    """The bytes one slot's recurrent state takes (every layer's conv and ssm state) when
    stored in a dtype of `dtype_bytes` bytes an element: the one formula for every layer kind,
    read by the server's slot count and the prefix cache's sizing."""
    conv, ssm = layer_kind(config).state(config)
    return config.n_layer * (_numel(conv) + _numel(ssm)) * dtype_bytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
