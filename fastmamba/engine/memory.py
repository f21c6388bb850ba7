"""What the engine's memory holds on a device: slots (each a recurrent state, logits and
activations), and a hybrid's KV cache, sized from the free memory where not given."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from fastmamba.core.config import MambaConfig
from fastmamba.core.dtypes import embedding_dtype
from fastmamba.core.errors import CheckpointError
from fastmamba.core.families import family
from fastmamba.core.fp8 import FP8, QUANTIZE_BLOCK
from fastmamba.core.kv_cache import bytes_per_token
from fastmamba.core.layers import state_bytes
from fastmamba.io.checkpoint import expected_shapes
from fastmamba.io.files import inside


def kv_cache_tokens(model, megabytes: int | None, slots: int = 0) -> int | None:
    """The tokens a hybrid's KV cache holds (None for a model without attention): `megabytes`
    of them, or on a GPU half the memory free once the model and its `slots` slots (not yet
    made: slot_bytes each) are in, on the CPU 1024 MiB."""
    c = model.config
    if not getattr(c, "n_attention", 0):
        return None
    per_token = bytes_per_token(c, model.weights.embedding.element_size())
    if megabytes is None:
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            return max(1, (free - slots * slot_bytes(model)) // 2 // per_token)
        megabytes = 1024
    return max(1, (megabytes << 20) // per_token)


# The fewest slots generate's engine has on the CPU: threads sharing a LanguageModel batch up
# to it (a slot costs its state's memory there, and the step runs the slots in use only)
MIN_CPU_SLOTS = 4


def default_max_batch(model) -> int:
    """The slots when --max-batch is not given: 16 on the CPU; on a GPU as many as half its
    free memory holds (each slot's state, logits and decode activations), at most 256."""
    if model.device.type != "cuda":
        return 16
    free, _ = torch.cuda.mem_get_info(model.device)
    return max(1, min(256, free // 2 // slot_bytes(model)))


def batch_slots(model, batch: int, held: int = 0) -> int:
    """The slots of generate's engine for a batch of `batch` prompts: a power of two at least
    `batch` (few rebuilds; on the CPU MIN_CPU_SLOTS at least, so that threads' calls batch
    together), but no more than half the free memory holds (a slot's state, logits and
    activations): the rest of a larger batch waits for free slots. (1000 prompts took 1024
    slots whatever their size: ~177 GB for Mamba-2 2.7b's 173 MB states.) `held`: the slots
    of the engine this one would replace, whose memory counts as free."""
    slots = max(1 << (batch - 1).bit_length(), MIN_CPU_SLOTS if model.device.type == "cpu" else 1)
    free = _free_bytes(model.device)
    fits = slots if free is None else (free + held * slot_bytes(model)) // 2 // slot_bytes(model)
    if fits < slots:  # (a power of two too, one at least)
        slots = 1 << max(fits.bit_length() - 1, 0)
    return slots


def _free_bytes(device: torch.device) -> int | None:
    """Free memory on the device: the GPU's, or the host's available RAM (Linux's
    MemAvailable: page cache counted free; None where the system does not say)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):  # (not Linux)
        pass
    return None


# The prefix cache's default room, in entries: a long prompt leaves a state every 512 tokens
# (prefix_cache.INTERVAL; a hybrid's on the GPU every 2048) and one at its end, and the prefix
# the next request shares must outlive them (Nemotron-H-8B, a float32 state of 100.6 MB:
# 256 MiB held two, and a 2048-token shared prefix never hit; benchmarks/RESULTS.md, "Hybrid
# models").
PREFIX_CACHE_ENTRIES = 16


def default_prefix_cache_bytes(model) -> int:
    """--prefix-cache-mb's default: room for PREFIX_CACHE_ENTRIES slots' recurrent states and
    logits (a hybrid's keys and values come on top of each), at least 256 MiB."""
    c = model.config
    entry = state_bytes(c, model.state_dtype.itemsize) + 4 * c.vocab_size
    return max(256 << 20, PREFIX_CACHE_ENTRIES * entry)


def slot_bytes(model) -> int:
    """A slot's memory: its recurrent state, logits (and the sampler's copies), the sampler's
    rows (the seen marks; logit bias and token counts, 4 bytes each), activations."""
    c = model.config
    return state_bytes(c, model.state_dtype.itemsize) + 4 * c.vocab_size * 4 + 9 * c.vocab_size + 16 * c.d_inner * 4


def _is_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """A tensor the loader stores in the storage dtype: a projection's or experts' weight
    (2-D, or stacked 3-D), not a conv's (E, 1, K) nor a vector."""
    return name.endswith(".weight") and len(shape) >= 2 and not (len(shape) == 3 and shape[1] == 1)


def weights_bytes(config: MambaConfig, dtype: torch.dtype, device="cuda") -> tuple[int, int]:
    """(the bytes a model's weights take on the device in storage `dtype`, the most that
    loading holds besides for a moment): from the shapes its checkpoint must have
    (io/checkpoint.expected_shapes, which the loader checks the files' headers against).
    The projections in `dtype` (FP8: a byte a weight and a float32 scale a row), the
    embedding in dtypes.embedding_dtype (on `device`), the rest float32. The moment: one matrix in float32
    (a conversion's copy; under FP8 the matrix as read, quantized a block of rows at a time
    beside it: core/fp8.quantize), and a sublayer's experts again where the checkpoint stores them one by one
    (stacked at load, both copies held until the stack is made)."""
    total, largest, experts = 0, 0, {}
    for name, shape in expected_shapes(config).items():
        n = math.prod(shape)
        if name == family(config).embedding:
            total += n * embedding_dtype(dtype, device).itemsize
        elif _is_matrix(name, shape):
            size = n * dtype.itemsize + (4 * math.prod(shape[:-1]) if dtype == FP8 else 0)
            total += size
            largest = max(largest, n)
            if one_expert := re.match(r"(.*\.)experts\.\d+\.", name):
                experts[one_expert.group(1)] = experts.get(one_expert.group(1), 0) + size
        else:
            total += 4 * n
    blocks = 3 * 4 * QUANTIZE_BLOCK if dtype == FP8 else 0  # (quantize's float32 temporaries)
    return total, 4 * largest + blocks + max(experts.values(), default=0)


def check_weights_fit(folder: Path, dtype: torch.dtype, device: torch.device, free: int | None = None) -> None:
    """A CheckpointError before anything is allocated if the model in folder cannot fit the
    GPU's free memory in storage `dtype` (free: torch.cuda.mem_get_info's, where not given),
    naming the bytes needed and free, and --dtype fp8 where that would fit: never a CUDA
    out-of-memory error halfway through the load."""
    if not (folder / "config.json").is_file():  # (the loader names what is missing)
        return
    config = MambaConfig.from_file(inside(folder, "config.json"))
    need, moment = weights_bytes(config, dtype)
    if free is None:
        free, _ = torch.cuda.mem_get_info(device)
    if need + moment <= free:
        return
    gib = 2.0**30
    hint = ""
    if dtype != FP8:
        fp8_need, fp8_moment = weights_bytes(config, FP8)
        if fp8_need + fp8_moment <= free:
            hint = f"; with dtype 'fp8' (--dtype fp8) its weights take {fp8_need / gib:.2f} GiB and would fit"
    raise CheckpointError(
        f"{folder}: the model's weights need {need / gib:.2f} GiB ({need} bytes) in {str(dtype).removeprefix('torch.')}"
        f", and loading them {moment / gib:.2f} GiB more for a moment, but {device} has {free / gib:.2f} GiB "
        f"({free} bytes) free{hint}"
    )
