"""CUDA graphs of the decode step and of prefill: launched from Python, a step is hundreds of
kernel launches, which cost more than the GPU's work on all but the widest models.

`PoolDecodeGraphs` and `ChunkPrefillGraphs` are the engine's (engine_core.py): the decode step
over a pool of state slots by batch bucket, and prefill chunks that continue a slot's state.
`GraphPrefill` runs the prefill of new prompts, left-padded, as CUDA graphs too: a short
prompt's prefill is a few hundred small launches, which cost more from Python than on the GPU.
`GraphDecoder` runs the Triton decode step and the sampler as one CUDA graph, several steps
a replay, captured once per batch size and sampler: the decode step's own speed
(`fastmamba bench`).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from fastmamba.core.model import Mamba
from fastmamba.core.sampling import SlotParams, sample_greedy
from fastmamba.core.state import MambaState

Pick = Callable[[torch.Tensor, SlotParams], torch.Tensor]


def capture_graph(body: Callable[[], object], pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of body() and the output of the captured call. Two warm-up calls on a
    side stream first: they compile the kernels, which must not happen inside a capture.
    pool: a memory pool to share with other graphs (torch.cuda.graph_pool_handle())."""
    side = warmup_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with no_cyclic_gc(), torch.cuda.graph(graph, pool=pool):
        out = body()
    return graph, out


_WARMUP_STREAMS: dict[tuple, torch.cuda.Stream] = {}


def warmup_stream() -> torch.cuda.Stream:
    """The side stream of every capture's warm-up calls on the current device, one for the
    process: cuBLAS keeps a workspace (32 MiB on an H100) for each stream it has run on until
    the process ends, so a new stream a capture (torch hands out 32 in turn) would hold up to
    a GiB that no deleted model gives back."""
    # (keyed by the Stream type too: a test that stands in for torch.cuda's streams gets its own)
    key = (torch.cuda.current_device() if torch.cuda.is_available() else None, torch.cuda.Stream)
    stream = _WARMUP_STREAMS.get(key)
    if stream is None:
        stream = _WARMUP_STREAMS[key] = torch.cuda.Stream()  # (on the current device)
    return stream


@contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off inside, as it was after. A collection inside a
    capture may free a dead engine's CUDA graph (a reference cycle holding it), and
    destroying a graph while a stream captures invalidates the capture
    (cudaErrorStreamCaptureInvalidated: seen on the GPU with a second model loaded in one
    process). torch.cuda.graph no longer collects before a capture."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


STEPS_PER_READ = 4  # decode steps per graph replay when timing the step (launch cost spread over 4)


class GraphDecoder:
    """Decode step + sampling for a fixed batch size, as CUDA graphs (one per sampler).

    One replay runs `steps` steps and leaves their tokens in `history` (steps, B).
    """

    def __init__(self, model: Mamba, batch: int, deterministic: bool = False, steps: int | None = None, plan=None):
        from fastmamba.engine.decode_step import make_decode_step

        self.model = model
        self.step = make_decode_step(model, batch, deterministic, plan)  # plan: plan.plan_for's unless given
        self.state = model.new_state(batch)
        self.slots = SlotParams.empty(batch, model.config.vocab_size, model.device)
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=model.device)
        self.steps = steps or STEPS_PER_READ
        self.history = torch.zeros(self.steps, batch, dtype=torch.int64, device=model.device)
        self.graphs: dict[Pick, torch.cuda.CUDAGraph] = {}

    def _body(self, pick: Pick) -> None:
        # Greedy sampling fused into the one-row step (argmax inside lm_head): one small
        # kernel after it instead of torch's argmax and four more launches.
        fused = pick is sample_greedy and self.step.plan.step == "one-row"
        for i in range(self.steps):
            if fused:
                self.step(self.tokens, self.state, argmax=True)
                self.step.take_argmax(self.slots, self.tokens, self.history[i])
            else:
                self.tokens.copy_(pick(self.step(self.tokens, self.state), self.slots))
                self.history[i].copy_(self.tokens)

    def _capture(self, pick: Pick) -> torch.cuda.CUDAGraph:
        # The warm-up runs scribble on the state and slots, which `begin` overwrites.
        return capture_graph(lambda: self._body(pick))[0]

    def begin(self, state: MambaState, logits: torch.Tensor, pick: Pick, requests) -> torch.Tensor:
        if pick not in self.graphs:
            self.graphs[pick] = self._capture(pick)
        self.graph = self.graphs[pick]
        self.slots.set_slots(requests)
        self.state.conv.copy_(state.conv)
        self.state.ssm.copy_(state.ssm)
        self.tokens.copy_(pick(logits, self.slots))
        return self.tokens

    def next(self) -> torch.Tensor:
        """The next `steps` steps' tokens, (steps, B)."""
        self.graph.replay()
        return self.history


def graph_prefill_tokens(d_model: int) -> int:
    """Batch x bucket length up to which a prompt prefills as a CUDA graph. Issuing an
    eager prefill's launches costs the host about a millisecond a layer at any length,
    while the GPU's time grows with the tokens and the width, so eager prefill is
    host-bound up to more tokens the narrower the model (130m 1 x 8192: 25.9 ms eager,
    8.75 in a graph; measurements in benchmarks/RESULTS.md, "Prefill"). The crossover,
    measured at 130m's and 2.8b's widths, falls as d_model^1.5 between them; at least
    4096, at most MAX_GRAPH_PREFILL."""
    tokens = int(4096 * (2560 / d_model) ** 1.5) // 512 * 512
    return min(MAX_GRAPH_PREFILL, max(4096, tokens))


MAX_GRAPH_PREFILL = 16384  # (Mamba.chunk_tokens: a longer prefill runs in chunks anyway)
# Padded prompt lengths with a graph each: powers of two up to 512, then steps of 512, so
# that a prompt pads by at most 512 tokens above 512 (even a prompt padded to nearly twice
# its length is faster in a graph where eager is host-bound). A graph holds its
# activations' memory: the prefill graphs share one pool (GraphPrefill), about half the
# memory of a pool each. A graph's first use captures it (about three eager prefills'
# time), then every later prompt of its bucket replays it.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512) + tuple(range(1024, MAX_GRAPH_PREFILL + 1, 512))


class GraphPrefill:
    """Prefill of `batch` prompts left-padded to `length` tokens, as one CUDA graph.

    Left padding leaves a row exactly as if it started at its first real token (the
    kernels force dt = 0 and a zero conv input there), so a prompt shorter than the
    bucket's length runs in the bucket's graph unchanged. `__call__` returns the last
    position's logits and the state, both owned by the graph: use them before the next call.

    pool: a memory pool the graph shares with other prefill graphs, so that their
    activations reuse one space instead of taking one each. The graphs then overwrite each
    other's scratch: the logits are valid until the next call of
    any graph of the pool (the state lies outside it).
    """

    def __init__(self, model: Mamba, batch: int, length: int, pool=None):
        self.model = model
        self.ids = torch.zeros(batch, length, dtype=torch.int64, device=model.device)
        self.start = torch.zeros(batch, dtype=torch.int32, device=model.device)
        self.state = model.new_state(batch)
        self.graph, self.logits = capture_graph(self._body, pool)

    def _body(self) -> torch.Tensor:
        self.state.reset()
        return self.model.prefill(self.ids, self.state, self.start, last_only=True)

    def __call__(self, padded_ids: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, MambaState]:
        """padded_ids (B, T <= length) left-padded from start (B,) -> (logits (B, V), state)."""
        pad = self.ids.shape[1] - padded_ids.shape[1]
        self.ids[:, pad:].copy_(padded_ids)
        self.start.copy_(start + pad)
        self.graph.replay()
        return self.logits, self.state


# Batch sizes the serving engine's decode graphs are captured at; a step of d running
# requests replays the smallest bucket >= d (the rows above d are padding). Steps cost
# about the same over a few rows more (the weights dominate the bytes), and a graph a
# batch size up to 256 would take hundreds of captures.
POOL_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def pool_buckets(max_batch: int) -> tuple[int, ...]:
    """The buckets a pool of max_batch slots uses: those below it, and max_batch itself."""
    return tuple(b for b in POOL_BUCKETS if b < max_batch) + (max_batch,)


class PoolDecodeGraphs:
    """The Triton decode step over the first rows of a state pool, as one CUDA graph per
    bucket of batch sizes (the serving engine's decode).

    The graphs read the token ids from `tokens` and update the pool's rows in place: the
    requests that decode are kept in the pool's first rows, so a step needs no gather or
    scatter of states. All graphs are captured at construction, while the pool is unused,
    because a capture's warm-up calls run the step on the rows it captures.
    """

    def __init__(self, model: Mamba, pool: MambaState, tokens: torch.Tensor, deterministic: bool = False, plan=None):
        from fastmamba.engine.decode_step import make_decode_step

        max_batch = pool.conv.shape[1]
        self.tokens = tokens  # (max_batch,) int64 on the device: each row's input, read by the graphs
        self.buckets = pool_buckets(max_batch)
        mempool = torch.cuda.graph_pool_handle()  # one replays at a time: they share scratch
        self.graphs = {}
        for b in self.buckets:
            step = make_decode_step(model, b, deterministic, plan)  # plan: the table's unless given
            # (a hybrid's KV cache: the graph stores and reads, the engine keeps the books)
            rows = MambaState(pool.conv[:, :b], pool.ssm[:, :b], pool.kv, kv_host=False)
            ids = self.tokens[:b]
            self.graphs[b] = capture_graph(lambda: step(ids, rows), mempool) + (step,)
        pool.reset()

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def __call__(self, d: int) -> torch.Tensor:
        """Decodes rows 0..d-1 of the pool from their inputs in `tokens` (and the padding
        rows up to the bucket, whose state the caller must keep aside); logits (bucket, V)
        f32, valid until the next call."""
        graph, logits, _ = self.graphs[self.bucket(d)]
        graph.replay()
        return logits


class ChunkPrefillGraphs:
    """Prefill of the next tokens of `batch` slots (as many for each), continuing from their
    states, as CUDA graphs of chunk lengths 1, 2, 4, ... up to `longest` (the engine's
    prefill of prompts that resume from a state, or of a long prompt's chunks).

    A chunk runs as its binary pieces (200 tokens: 128 + 64 + 8), each an exact graph with
    no padding: left padding would put zeros where a slot's last tokens belong in the
    conv window. The slots' states are gathered from the pool into the graphs' state and
    scattered back.
    """

    def __init__(self, model: Mamba, longest: int, batch: int = 1, mempool=None):
        self.state = model.new_state(batch)
        self.lengths = [1 << k for k in range(longest.bit_length()) if 1 << k <= longest][::-1]
        mempool = mempool or torch.cuda.graph_pool_handle()
        self.graphs = {}
        for n in self.lengths:
            ids = torch.zeros(batch, n, dtype=torch.int64, device=model.device)

            def body(ids=ids):
                return model.prefill(ids, self.state, last_only=True)

            self.graphs[n] = (ids,) + capture_graph(body, mempool)

    def __call__(self, ids: torch.Tensor, pool: MambaState, rows: torch.Tensor) -> torch.Tensor:
        """ids (batch, T) continuing the pool's slots `rows` (batch,) -> logits (batch, V)
        after the last token, valid until the next call; updates those slots' states."""
        self.state.conv.copy_(pool.conv.index_select(1, rows))
        self.state.ssm.copy_(pool.ssm.index_select(1, rows))
        at, logits = 0, None
        for n in self.lengths:
            while ids.shape[1] - at >= n:
                buf, graph, logits = self.graphs[n]
                buf.copy_(ids[:, at : at + n])
                graph.replay()
                at += n
        pool.conv.index_copy_(1, rows, self.state.conv)
        pool.ssm.index_copy_(1, rows, self.state.ssm)
        return logits


# Batch sizes of the engine's chunk prefill graphs: the chunks of one length in a step go
# in groups of these sizes (a step's budget of 1024-2048 tokens holds 2-4 chunks of 512).
CHUNK_BATCHES = (8, 4, 2, 1)
