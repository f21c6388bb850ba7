"""`fastmamba.load`: a checkpoint folder or hub id to a LanguageModel on a device and engine."""

from __future__ import annotations

import os

import torch

from fastmamba.core.dtypes import parse_dtype, parse_state_dtype
from fastmamba.core.errors import CheckpointError
from fastmamba.core.fp8 import block_scaled
from fastmamba.core.layers import off_gpu_engine
from fastmamba.core.model import Mamba
from fastmamba.core.ops import REFERENCE_OPS, triton_ops
from fastmamba.engine.language_model import LanguageModel
from fastmamba.engine.memory import check_weights_fit
from fastmamba.engine.plan import KERNEL_TILES
from fastmamba.io.checkpoint import load_checkpoint
from fastmamba.io.files import inside
from fastmamba.io.folders import checkpoint_folder
from fastmamba.io.tokenizer import Tokenizer
from fastmamba.kernels._triton import HAVE_TRITON


def load(
    path=None,
    *,
    device="cpu",
    dtype="float32",
    engine: str | None = None,
    deterministic: bool = False,
    threads: int | None = None,
    state_dtype="float32",
) -> LanguageModel:
    """Loads a Mamba checkpoint folder (HF or original state-spaces format).

    path: a checkpoint folder, or a HuggingFace hub id `org/name` (the local HF cache is
    read first, then the hub; HF_HOME and HF_HUB_OFFLINE apply); a folder of that name
    wins when it exists. None loads the bundled default model.
    device: "cpu" or "cuda" (or a torch.device).
    dtype: storage of the large matrices, "float32", "bfloat16", "float16" or "fp8" (or a torch
    dtype); accumulation, states, norms and logits are float32 whatever it is. "fp8": the
    projections and an untied head in float8 e4m3 with a float32 scale a row (core/fp8.py),
    the embedding (and a tied head) in float32 on the CPU, bfloat16 on a GPU; an FP8 checkpoint (compressed-tensors) keeps its own values
    and scales, and under any other dtype is dequantized. On the GPU the decode step's
    kernels read the e4m3 bytes and prefill runs cuBLASLt's FP8 GEMM (kernels/fp8_gemm.py);
    block-scaled FP8 checkpoints run on the reference engine. On CUDA a model whose weights
    cannot fit the free memory is refused (a CheckpointError) before any is allocated.
    engine: "triton" (GPU kernels and CUDA graphs, the default on CUDA) or "reference"
    (the pure-PyTorch path, the default and only choice on the CPU).
    deterministic: on the GPU, make a slot's logits bitwise the same whatever the batch
    size (the decode step's products then sum each output in one fixed order at every batch
    size, and a batch's prompts prefill one at a time; see benchmarks/RESULTS.md for the
    cost). Without it this holds within each batch range that
    fastmamba.engine.plan.batch_invariant_ranges(d_model, dtype) lists (the README's table).
    threads: PyTorch's CPU threads while the model computes on the CPU (restored after each
    call): None means 1, which does not collapse when another process holds a core; 0
    leaves PyTorch's own setting.
    state_dtype: "float32" (default) or "bfloat16": the dtype the conv and ssm states are
    stored in (updates compute in float32 and round once on store); bfloat16 halves the
    state's memory and the traffic of a large batch's decode step.
    Raises CheckpointError (a ValueError) naming the file and tensor or key on bad input.
    """
    state = parse_state_dtype(state_dtype)
    cores = os.cpu_count() or 1  # (torch.set_num_threads far past the cores can crash the process)
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or not 0 <= threads <= cores):
        raise ValueError(f"threads must be None or an integer from 0 to {cores} (this machine's cores), got {threads!r}")
    storage = parse_dtype(dtype)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but PyTorch sees no CUDA GPU here")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if engine not in (None, "triton", "reference") or (engine == "triton" and (dev.type != "cuda" or not HAVE_TRITON)):
        raise ValueError(f"engine must be 'reference', or 'triton' on a CUDA device with Triton installed; got {engine!r}")
    folder = checkpoint_folder(path)
    if dev.type == "cuda":  # (refused before any weight is allocated, not halfway)
        check_weights_fit(folder, storage, dev)
    config, weights = load_checkpoint(folder, dev, storage)
    blocks = block_scaled(weights) if weights.fp8 else []  # (the FP8 matrices of block scales, by name)
    if engine == "triton" and blocks:
        raise ValueError(f"engine 'triton' takes FP8 weights with a scale a row; this checkpoint's are block-scaled "
                         f"({blocks[0]}): use engine='reference'")
    off_gpu = off_gpu_engine(config)
    if engine == "triton" and off_gpu:
        raise ValueError(f"engine 'triton' cannot run {', '.join(off_gpu)} sublayers yet (the GPU's kernels and "
                         "CUDA graphs for them are not built): use engine='reference' (pure PyTorch, on any device)")
    if engine is None:
        engine = "triton" if dev.type == "cuda" and HAVE_TRITON and not off_gpu and not blocks else "reference"
    tokenizer = None
    if os.path.lexists(folder / "tokenizer.json"):  # (lexists: a broken link is named, not taken for no tokenizer)
        tokenizer = Tokenizer(inside(folder, "tokenizer.json"))
        if tokenizer.id_limit > config.vocab_size:
            raise CheckpointError(
                f"{tokenizer.path}: the tokenizer has {tokenizer.vocab_size} tokens, ids up to {tokenizer.id_limit - 1}: "
                f"more than the model's {config.vocab_size} (vocab_size in config.json)"
            )
    model = Mamba(config, weights, triton_ops(KERNEL_TILES) if engine == "triton" else REFERENCE_OPS, state_dtype=state)
    return LanguageModel(model, tokenizer, folder, engine=engine, deterministic=deterministic, threads=threads)
