"""LanguageModel, the object `fastmamba.load` returns: forward, generate, stream, generate_batch."""

from __future__ import annotations

import os
import signal
import threading
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from fastmamba.core.errors import NonFiniteError
from fastmamba.core.model import Mamba
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine.client import InProcessClient
from fastmamba.engine.cpu_threads import cpu_threads
from fastmamba.engine.engine_core import EngineCore
from fastmamba.engine.memory import batch_slots, kv_cache_tokens
from fastmamba.engine.prefill import Prefill
from fastmamba.engine.protocol import BAD_REQUEST, NON_FINITE, Failed, Finished
from fastmamba.io.prompts import (
    PromptEncoder,
    check_token_ids,
    describe,
    is_integer_dtype,
)
from fastmamba.io.tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens only; a stop token is not included
    text: str | None  # None when the checkpoint has no tokenizer
    finish_reason: str  # "stop" (a stop token came) or "length" (max_tokens reached)
    prompt_tokens: int


@dataclass
class StreamPiece:
    token_id: int | None  # None only for a last piece that flushes held-back text
    text: str | None


class _CtrlC:
    """Ctrl-C held while an engine step runs in the main thread, then raised as it would have
    been. A step advances every running generation's state in place and hands each its
    outputs: one cut midway left another thread's generation a token ahead of its outputs
    (wrong tokens from there), or without its last outputs (waiting for ever). A second
    Ctrl-C during the step acts at once (a step that hangs can still be left).

    Its handler, once set at a step, stays and hands every Ctrl-C outside a step to the
    handler it found (Python's raises KeyboardInterrupt; the command's ends the process): two
    handler swaps a step cost ~8 µs, a check ~0.3. Only the main thread takes SIGINT; a
    handler set outside Python (an embedding application's) is left alone."""

    def __init__(self):
        self.stepping, self.held, self.previous = False, None, None
        self.handler = self._on_sigint  # (one bound method: compared by identity below)

    def _on_sigint(self, signum, frame) -> None:
        if self.stepping and self.held is None:
            self.held = frame
            return
        self._forward(frame)

    def _forward(self, frame) -> None:
        if callable(self.previous):
            self.previous(signal.SIGINT, frame)
        elif self.previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    def enter(self) -> bool:
        """Before a step: whether Ctrl-C is held during it."""
        if threading.current_thread() is not threading.main_thread():
            return False
        current = signal.getsignal(signal.SIGINT)
        if current is not self.handler:
            if current is None:
                return False
            try:
                signal.signal(signal.SIGINT, self.handler)
            except ValueError:  # (an interpreter without signals)
                return False
            self.previous = current
        self.stepping = True
        return True

    def leave(self, held: bool) -> None:
        """After the step: a Ctrl-C held during it now acts."""
        if held:
            self.stepping = False
            frame, self.held = self.held, None
            if frame is not None:
                self._forward(frame)


_CTRL_C = _CtrlC()


# Every LanguageModel, so that a forked child forgets their engines: a fork copies the lock
# and the requests of threads the child does not have (a generation running in another
# thread left the child's first call waiting for ever on its step).
_MODELS: weakref.WeakSet = weakref.WeakSet()


def _after_fork() -> None:
    for lm in list(_MODELS):
        lm._forget_engine()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class LanguageModel:
    """A model with its tokenizer, and the engine its generations run on (`fastmamba.load`
    makes one).

    Safe to share between threads: calls from several threads are requests of the one
    engine, batched together as the server's are, and each gets what it would get alone."""

    def __init__(
        self,
        model: Mamba,
        tokenizer: Tokenizer | None,
        path: Path | None = None,
        engine: str = "reference",
        deterministic: bool = False,
        threads: int | None = None,
    ):
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.path = path
        self.engine = engine  # "reference" (pure PyTorch) or "triton" (GPU kernels + CUDA graphs)
        self.deterministic = deterministic
        # PyTorch's CPU threads while this model computes (cpu_threads.py), restored between
        # calls and between streamed tokens. 0: as PyTorch has it.
        self.threads = 1 if threads is None else threads
        # (no CUDA graphs for hybrids: their attention reserves KV blocks on the host each pass)
        self.prefill = Prefill(model, graphs=engine == "triton" and not self.config.hybrid, deterministic=deterministic)
        # A DecodePlan (plan.py) for the engine's decode step at every batch size in place of
        # the plan table's: for tests and benchmarks, set before the first generation.
        self.decode_plan = None
        self._backbone = None
        # (_client: the engine under generate, stream and generate_batch, made at first use)
        # Every thread's generations share the engine. `_lock` guards its request bookkeeping
        # (submit, abort, a rebuild) and the `_stepping` flag; a step runs outside the lock
        # but with the flag set, so one thread steps the engine for all while the others
        # read their own outputs, or wait for the step's end (`_lock.wait`: no polling).
        # `_queued` counts the threads waiting to submit: no step starts before they have,
        # so a new request joins the next step, not the end of another's generation.
        self._forget_engine()
        _MODELS.add(self)  # (a forked child forgets its engine: _after_fork)

    def _forget_engine(self) -> None:
        self._client: InProcessClient | None = None
        self._lock = threading.Condition(threading.Lock())
        self._stepping = False
        self._queued = 0
        self._closed: deque = deque()  # (client, rids) of generations that ended while the engine was busy

    def __reduce__(self):
        raise TypeError("a LanguageModel cannot be pickled (its engine holds threads' requests and device memory): "
                        "call fastmamba.load() in the other process")

    def _engine(self, batch: int) -> InProcessClient:
        """The engine, with at least `batch` slots where it can be (made anew, larger, when a
        batch outgrows an idle one: its decode graphs are captured for every bucket up to its
        size). While other generations run, the one there takes the batch: its requests wait
        for free slots (other threads' calls batch with them up to its size). Called with the
        engine held (`_engine_held`)."""
        # (memory.batch_slots: powers of two, within half the free memory, the engine's own
        # counted free; on a GPU each bucket also costs a decode graph, all captured when the
        # engine is made. Compared with the engine's size, not the batch's: a batch capped by
        # the memory rebuilt the engine at every call)
        held = self._client.max_batch if self._client is not None else 0
        # (an engine with room for the batch stays: the free memory is not read at every call)
        slots = batch_slots(self.model, batch, held) if held < batch else held
        if self._client is None or (self._client.max_batch < slots and not self._client.busy):
            self._client = None  # (its memory goes to the new one, sized now)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            # offline, a step prefills whole prompts up to the model's chunk (no grid: no cache)
            # a hybrid's KV cache: on a GPU one pool of fixed size (its decode steps in CUDA
            # graphs), half the memory free once its slots are in (the slots are made first: a
            # cache sized without them ran out of memory beside another engine); on the CPU one
            # that grows as asked
            kv_tokens = (kv_cache_tokens(self.model, None, slots)
                         if self.device.type == "cuda" else None)
            core = EngineCore(self.model, self.prefill, max_batch=slots, prefill_tokens=self.model.chunk_tokens,
                              threads=self.threads, decode_plan=self.decode_plan, kv_tokens=kv_tokens,
                              tokenizer=self.tokenizer.path if self.tokenizer is not None else None)
            self._client = InProcessClient(core)
        # (the attributes may change between generations: benchmarks set threads so)
        self._client.core.threads, self.prefill.deterministic = self.threads, self.deterministic
        return self._client

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def backbone(self):
        """The model's layers and final norm as a fastmamba.Backbone (vectors of d_model in
        and out) over the model's own tensors, shared, not copied."""
        with self._lock:
            if self._backbone is None:
                from fastmamba.engine.backbone import Backbone

                self._backbone = Backbone.of_language_model(self.model)
            return self._backbone

    @property
    def dtype(self) -> torch.dtype:
        """The large matrices' storage dtype (torch.float8_e4m3fn for dtype="fp8")."""
        return self.model.weights.dtype

    def __repr__(self) -> str:
        c = self.config
        return (
            f"LanguageModel({self.path}, d_model={c.d_model}, n_layer={c.n_layer}, vocab={c.vocab_size}, "
            f"device={self.device}, dtype={self.dtype})"
        )

    # -- plain forward ---------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 logits (B, T, V) of whole sequences (V may include padding columns).

        input_ids: an integer tensor (B, T) with B, T >= 1; anything else is a ValueError."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or not is_integer_dtype(input_ids.dtype):
            raise ValueError("input_ids must be an integer tensor of shape (batch, time)")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: give at least one row of one token")
        self._check_ids(input_ids.flatten().tolist(), "input_ids")
        with cpu_threads(self.threads, self.device):
            logits = self.model.forward(input_ids.to(self.device, torch.int64))
            self.model.check_finite(logits, input_ids)  # (its rows are read only if the logits are not finite)
            return logits

    # -- generation --------------------------------------------------------------------------

    def generate(self, prompt, params: SamplingParams | None = None, **sampling) -> Generation:
        """Continues `prompt` and returns a Generation (the new tokens, their text, why it
        stopped, the prompt's length).

        prompt: a str (the checkpoint needs a tokenizer) or token ids (see `encode`).
        params: a SamplingParams or a dict of its fields; keyword arguments override fields.
        A given seed gives the same tokens every time, alone or beside other prompts.
        Raises ValueError naming a bad prompt or value, TypeError for an unknown option."""
        params = SamplingParams.from_kwargs(params, sampling)
        return self.generate_batch([prompt], params)[0]

    def stream(self, prompt, params: SamplingParams | None = None, **sampling) -> Iterator[StreamPiece]:
        """Like `generate`, but yields a StreamPiece per token as soon as it is sampled: its
        id and the text it completes (pieces never split a UTF-8 character; a last piece
        with no token may carry held-back text). The texts concatenate to `generate`'s."""
        params = SamplingParams.from_kwargs(params, sampling)
        ids = self.encode(prompt)
        self._check_params_ids(params)
        decoder = IncrementalDecoder(self.tokenizer, ids) if self.tokenizer else None
        for _, token, _ in self._generate([ids], [params]):
            if token is not None:
                yield StreamPiece(token, decoder.push(token) if decoder else None)
        if decoder and (tail := decoder.flush()):
            yield StreamPiece(None, tail)

    def generate_batch(
        self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Generation]:
        """Generates for several prompts together, one Generation each, in order; each is
        what `generate` gives that prompt alone (same seed, same tokens).

        params: one SamplingParams (or dict) for all, or a list with one per prompt.
        Raises ValueError naming the bad prompt, parameter or stop token id."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts must be a non-empty list of prompts, got {describe(prompts)}")
        if params is None or isinstance(params, (SamplingParams, dict)):
            params = [SamplingParams.from_kwargs(params, {})] * len(prompts)
        elif isinstance(params, (list, tuple)) and len(params) == len(prompts):
            params = [SamplingParams.from_kwargs(p, {}) if isinstance(p, dict) else p for p in params]
        if not isinstance(params, list) or len(params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"params must be one SamplingParams (or dict) or a list of {len(prompts)} of them")
        for p in params:
            self._check_params_ids(p)
        all_ids = []
        for i, p in enumerate(prompts):  # (the error names which prompt: a batch may hold thousands)
            try:
                all_ids.append(self.encode(p))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}" if len(prompts) > 1 else str(e)) from None
        decoders = [IncrementalDecoder(self.tokenizer, ids) if self.tokenizer else None for ids in all_ids]
        texts = [[] for _ in prompts]
        out = [[] for _ in prompts]
        finish = ["length"] * len(prompts)
        for i, token, reason in self._generate(all_ids, params):
            if token is not None:
                out[i].append(token)
                if decoders[i]:
                    texts[i].append(decoders[i].push(token))
            if reason:
                finish[i] = reason
        return [
            Generation(
                token_ids=out[i],
                text="".join(texts[i]) + decoders[i].flush() if decoders[i] else None,
                finish_reason=finish[i],
                prompt_tokens=len(all_ids[i]),
            )
            for i in range(len(prompts))
        ]

    # -- internals -------------------------------------------------------------------------

    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt: a str, or token ids (a list or tuple of ints, a 1-D integer
        tensor or numpy array). Anything else is a ValueError naming the problem."""
        return PromptEncoder(self.tokenizer, self.config.vocab_size, self.path).encode(prompt)

    def _check_ids(self, ids, what: str) -> list[int]:
        return check_token_ids(ids, self.config.vocab_size, what)

    def _check_params_ids(self, params: SamplingParams) -> None:
        """The token ids a SamplingParams names (stop tokens, logit_bias's keys), against the vocabulary."""
        self._check_ids(params.stop_token_ids or [], "SamplingParams.stop_token_ids")
        self._check_ids(list(params.logit_bias or ()), "SamplingParams.logit_bias")

    def _generate(self, all_ids: list[list[int]], params: list[SamplingParams]):
        """Yields (prompt index, token or None, finish reason or None) as the engine makes
        them: the prompts run as requests of the engine, stepped from here. Each request's
        outputs go to its own queue, so a generation stepping the engine for another
        (interleaved streams, other threads) leaves that one's outputs for its own loop."""
        queues = [deque() for _ in all_ids]
        client, rids = None, []
        try:  # (the submissions inside: a Ctrl-C between two left the first running for no one)
            with self._engine_held():
                client = self._engine(len(all_ids))
                for ids, p, q in zip(all_ids, params, queues):
                    rids.append(client.submit(ids, p, None, q.append))
            left = len(rids)
            while left:
                if not any(queues):
                    self._step_or_wait(client, queues)
                    continue
                for i, q in enumerate(queues):
                    while q:
                        out = q.popleft()
                        if isinstance(out, Failed):
                            if out.error.kind == NON_FINITE:
                                raise NonFiniteError(out.error.message)
                            if out.error.kind == BAD_REQUEST:  # (a guide that does not compile)
                                raise ValueError(out.error.message)
                            raise RuntimeError(f"generation failed: {out.error.message}")
                        if isinstance(out, Finished):
                            left -= 1
                            yield i, None, out.reason
                        else:
                            yield i, out.token, None
        finally:  # also when the caller stops reading a stream: its requests end
            if client is not None:
                self._close(client, rids)

    @contextmanager
    def _engine_held(self):
        """The engine to this thread alone inside: no step runs and no other thread changes
        its requests."""
        with self._lock:
            self._queued += 1
            try:
                while self._stepping:
                    self._lock.wait()
            finally:
                self._queued -= 1
            try:
                self._abort_closed()
                yield
            finally:
                self._lock.notify_all()  # (a step waiting for this submission)

    def _step_or_wait(self, client: InProcessClient, queues: list[deque]) -> None:
        """One engine step for every generation, run by this thread; or, while another
        thread runs one, a wait until it ends or an output for `queues` comes."""
        with self._lock:
            if self._stepping or self._queued:
                while (self._stepping or self._queued) and not any(queues):
                    self._lock.wait()
                return
            self._abort_closed()
            self._stepping = True
        try:
            held = _CTRL_C.enter()
            try:
                client.step()  # (its outputs go to their generations' queues: deque appends, thread-safe)
            finally:
                _CTRL_C.leave(held)
        finally:
            with self._lock:
                self._stepping = False
                self._lock.notify_all()

    def _close(self, client: InProcessClient, rids: list[int]) -> None:
        """Ends a generation's requests (a no-op for those finished). A generator may be
        closed by the garbage collector in any thread, even one in the middle of a step or
        holding the lock: so this never waits, and leaves the aborts to the engine's next
        user when the engine is busy."""
        self._closed.append((client, rids))
        if self._lock.acquire(blocking=False):
            try:
                if not self._stepping:
                    self._abort_closed()
            finally:
                self._lock.release()

    def _abort_closed(self) -> None:
        while self._closed:
            client, rids = self._closed.popleft()
            for rid in rids:
                client.abort(rid)
