"""EngineOptions: what a serving engine is built from (which model, where and how it
computes, its slots and budgets), and building it. Each option is spelled here once: the
command line's flags (`fastmamba generate`, `fastmamba serve`), `serve`'s options and the
Ray deployment's arguments are all made from these fields (cli.py, serve/options.py).

No torch at import: the HTTP front end reads these options too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# The state dtypes the command line names (core/dtypes.parse_state_dtype takes these and aliases).
STATE_DTYPES = ("float32", "bfloat16")


def option(help: str, **argparse) -> dict:
    """A field's metadata for the command line: its help text, and argparse settings
    (metavar, choices) beyond those its type gives."""
    return {"help": help, **argparse}


def flag(name: str) -> str:
    """The command-line flag of an option's field name: max_batch -> --max-batch."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class EngineOptions:
    model: str | None = field(default=None, metadata=option(
        "checkpoint folder (HF or original format) or a HuggingFace hub id; default: the bundled model",
        metavar="DIR|ORG/NAME"))
    device: str = field(default="cpu", metadata=option("cpu or cuda (default: cpu)"))
    dtype: str = field(default="float32", metadata=option(
        "storage of the weights: float32, bfloat16/bf16, float16/fp16, fp8 (the CPU: float8 e4m3 projections with a "
        "scale a row)"))
    threads: int | None = field(default=None, metadata=option(
        "CPU threads for PyTorch (default: 1, which does not collapse beside a busy neighbour)"))
    state_dtype: str = field(default="float32", metadata=option(
        "storage of the recurrent state (bfloat16: half the memory and a faster large-batch step on the GPU, "
        "at an accuracy cost that grows with the tokens; default: float32)", choices=STATE_DTYPES))
    deterministic: bool = field(default=False, metadata=option(
        "GPU: a sequence's logits bitwise the same whatever else runs beside it (load(deterministic=True)); "
        "no effect on the CPU, which is deterministic already"))
    max_batch: int | None = field(default=None, metadata=option(
        "state slots: requests decoded together (default: 16 on the CPU; on a GPU as many as half its free "
        "memory holds, at most 256)"))
    prefill_tokens: int | None = field(default=None, metadata=option(
        "prompt tokens prefilled per engine step at most: more gives throughput, fewer keeps the running streams' "
        "pace behind new prompts (default: 4096 on a GPU, 512 on the CPU)"))
    prefix_cache_mb: int | None = field(default=None, metadata=option(
        "memory for cached prefix states, MiB; 0 = off (default: room for 16 states, at least 256)"))
    kv_cache_mb: int | None = field(default=None, metadata=option(
        "hybrids: memory for the attention layers' keys and values, MiB (default: on a GPU half its free memory "
        "once the model and its slots are in; 1024 on the CPU)"))

    # The fields `fastmamba generate` takes too (the rest are the serving engine's).
    MODEL_FIELDS = ("model", "device", "dtype", "threads", "state_dtype", "deterministic")

    def __post_init__(self):
        if self.model is not None and not str(self.model).strip():
            raise ValueError("--model is empty: give a checkpoint folder or a hub id org/name")
        cores = os.cpu_count() or 1
        if self.threads is not None and not 1 <= self.threads <= cores:
            raise ValueError(f"--threads must be from 1 to {cores} (this machine's cores), got {self.threads}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"--state-dtype must be {' or '.join(STATE_DTYPES)}, got {self.state_dtype!r}")
        if self.prefill_tokens is not None and self.prefill_tokens < 1:
            raise ValueError(f"--prefill-tokens must be at least 1, got {self.prefill_tokens}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"--max-batch must be at least 1, got {self.max_batch}")
        if self.prefix_cache_mb is not None and self.prefix_cache_mb < 0:
            raise ValueError(f"--prefix-cache-mb must be at least 0, got {self.prefix_cache_mb}")
        if self.kv_cache_mb is not None and self.kv_cache_mb < 1:
            raise ValueError(f"--kv-cache-mb must be at least 1, got {self.kv_cache_mb}")

    def step_prefill_tokens(self) -> int:
        """--prefill-tokens, or its default for the device. The CPU's is small because a step is
        silent while it runs: 4096 prompt tokens of the 130m shape take ~20 s on one core (2048 took
        9.7 s), close to the front end's --engine-timeout of 30 s, past which it calls the engine
        wedged; 512 take ~2 s, and the running streams wait that long for their next token."""
        if self.prefill_tokens is not None:
            return self.prefill_tokens
        return 512 if self.device == "cpu" else 4096

    def load_kwargs(self) -> dict:
        """fastmamba.load's arguments."""
        return dict(path=self.model, device=self.device, dtype=self.dtype, deterministic=self.deterministic,
                    threads=self.threads, state_dtype=self.state_dtype)


def build_engine(options: EngineOptions, folder=None):
    """The serving engine core these options name (its model loaded, its prefill graphs
    captured): (EngineCore, protocol.Ready). folder: the checkpoint folder already resolved."""
    from fastmamba.engine.engine_core import EngineCore
    from fastmamba.engine.loader import load
    from fastmamba.engine.memory import default_max_batch, default_prefix_cache_bytes, kv_cache_tokens
    from fastmamba.engine.protocol import Ready

    kwargs = options.load_kwargs()
    if folder is not None:
        kwargs["path"] = str(folder)
    lm = load(**kwargs)
    max_batch = options.max_batch or default_max_batch(lm.model)
    core = EngineCore(lm.model, lm.prefill, max_batch=max_batch, prefill_tokens=options.step_prefill_tokens(),
                      prefix_cache_bytes=default_prefix_cache_bytes(lm.model) if options.prefix_cache_mb is None
                      else options.prefix_cache_mb << 20, threads=lm.threads,
                      kv_tokens=kv_cache_tokens(lm.model, options.kv_cache_mb, max_batch),
                      tokenizer=lm.tokenizer.path if lm.tokenizer is not None else None)
    core.capture_prefill_graphs()
    kv = core.pool.kv
    context = kv.request_blocks * kv.block_size if kv is not None and not kv.growable else None
    return core, Ready(max_batch, lm.config.vocab_size, str(lm.device), str(lm.dtype).removeprefix("torch."), context)
