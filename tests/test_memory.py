"""GPU memory comes back: a deleted model gives back everything it took (graphs, their
pools, buffers), and the Backbone's step graphs stay bounded however many states a run
makes. (A first round makes what a process keeps once: cuBLAS's workspace for each stream
it runs on, the graphs' warm-up and capture streams included.)"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from conftest import save_hf_checkpoint

import fastmamba
from fastmamba import Backbone, BackboneConfig

pytestmark = pytest.mark.gpu
SLACK = 16 * 2**20  # bytes: what "where it began" allows


def allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """Two layers at mamba-130m's widths (vocab 50280: the larger products go to cuBLAS)."""
    return save_hf_checkpoint(tmp_path_factory.mktemp("mem") / "m", seed=5, hidden_size=768, num_hidden_layers=2,
                              vocab_size=50280)


def use(path) -> weakref.ref:
    """Loads a model on the GPU and runs what makes graphs and pools: generate, stream, a
    batch that outgrows the engine (rebuilt larger), the backbone's step. Returns a weak
    reference to its embedding."""
    lm = fastmamba.load(path, device="cuda", dtype="bfloat16")
    lm.generate([1, 2, 3], max_tokens=16)
    list(lm.stream([4, 5], max_tokens=8, temperature=0.8, seed=1))
    lm.generate_batch([[1], [2, 3], [4, 5, 6]], {"max_tokens": 8})
    bb = lm.backbone
    bb.step(torch.randn(2, lm.config.d_model, device="cuda"), bb.new_state(2))
    return weakref.ref(lm.model.weights.embedding)


def test_deleted_models_give_back_their_gpu_memory(wide_ckpt):
    for path in (None, wide_ckpt):  # (the once-a-process allocations)
        use(path)
    base = allocated()
    for k, path in enumerate((None, wide_ckpt, None)):
        weights = use(path)
        after = allocated()
        assert weights() is None, f"round {k}: the model is still referenced"
        assert after - base <= SLACK, f"round {k}: {(after - base) / 2**20:.1f} MiB more allocated than before"


def test_backbone_graphs_stay_bounded_over_1000_episodes():
    """A state a episode, a few alive at a time (so they lie at several addresses): memory
    flat after the first episodes, and every step right on whatever memory its state took
    (against the plan's step kernels run eagerly on a copy)."""
    from fastmamba.engine.backbone_step import step_kernels

    torch.manual_seed(0)
    bb = Backbone(BackboneConfig(input_dim=64, d_model=128, n_layer=2), device="cuda")
    x = torch.randn(256, 64, device="cuda")
    eager = step_kernels(bb, 256)
    held, base = [], None
    for episode in range(1000):
        state = bb.new_state(256)
        held = (held + [state])[-3:]
        for _ in range(3):
            bb.step(x, state)
        if episode % 50 == 7:
            copy = fastmamba.MambaState(state.conv.clone(), state.ssm.clone())
            y = bb.step(x, state)
            with torch.no_grad():
                y_ref = eager(x, copy)
            assert torch.equal(y, y_ref) and torch.equal(state.ssm, copy.ssm), episode
            y_host = bb.step(x.cpu().numpy(), state)  # the host graph, over the same memory
            with torch.no_grad():
                y_ref = eager(x, copy)
            assert isinstance(y_host, np.ndarray) and np.array_equal(y_host, y_ref.cpu().numpy()), episode
        if episode == 20:
            base = allocated()
    assert allocated() - base <= SLACK
    assert len(bb._graphs) == 1
