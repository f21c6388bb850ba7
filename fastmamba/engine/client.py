"""EngineClient: the one interface through which requests reach an engine core and its
outputs come back, whoever runs the core:

- InProcessClient (here): the core in this process, stepped by the caller (`generate`,
  `stream`, `generate_batch`: language_model.py);
- process.ProcessClient: the core in a process of its own, over ZeroMQ (`fastmamba serve`);
- serve/deploy.RayClient: the cores of Ray Serve replicas, each a ProcessClient
  (`fastmamba serve --replicas N`).

A client delivers each output of a request (protocol.Token ..., then one Finished or
Failed) to the `emit` callback given with it: on the caller's thread in `step()` for the
in-process client, on the event loop of the thread that submitted for the others.
No torch here: the HTTP front end imports this module.
"""

from __future__ import annotations

import abc
import itertools
from typing import Callable

from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine import protocol
from fastmamba.engine.protocol import EngineError, Output, Stats

Emit = Callable[[Output], None]


class EngineRefused(Exception):
    """A request the engine did not take: its queue is full (protocol.BUSY), or it is not
    running (protocol.ENGINE_DOWN)."""

    def __init__(self, error: EngineError):
        super().__init__(error.message)
        self.error = error


class EngineClient(abc.ABC):
    """Requests in, outputs to each request's `emit`. `stats` holds the engine's latest
    Stats; `on_stats`, when set, is called with each new one. `capacity`: the most requests
    it holds at once, running and waiting (None: no fixed bound), so that a request of more
    choices than that is refused as one that can never fit, not as a busy server's.
    `context`: the most tokens, prompt and output, one request's keys and values may take in
    its KV cache (None: no such bound)."""

    max_batch: int
    stats: Stats
    on_stats: Callable[[Stats], None] | None = None
    capacity: int | None = None
    context: int | None = None

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the engine takes requests (False once it died or is shutting down)."""

    @abc.abstractmethod
    def submit(self, ids: list[int], params: SamplingParams, top_logprobs: int | None, emit: Emit,
               route: int | None = None) -> int:
        """Sends a request; returns its rid. `route` is the key replicas are chosen by (a
        conversation's, say; None: the prompt's own). Raises EngineRefused."""

    @abc.abstractmethod
    def abort(self, rid: int) -> None:
        """The request's client went away, or its text reached a stop string: no more outputs."""

    def shutdown(self, timeout: float = 10) -> None:
        """Ends the requests still open (a Failed, protocol.SHUTTING_DOWN) and stops the engine."""


class InProcessClient(EngineClient):
    """An engine core (engine_core.EngineCore) in this process, stepped by the caller: each
    `step()` runs one engine step and hands its outputs to their requests' callbacks, so
    several generations (interleaved streams) can share the core, each reading only its own."""

    def __init__(self, core):
        self.core = core
        self.max_batch = core.max_batch
        self.stats = Stats()
        self._emits: dict[int, Emit] = {}
        self._rids = itertools.count()

    @property
    def alive(self) -> bool:
        return True

    @property
    def busy(self) -> bool:
        """Whether a request is still open."""
        return bool(self._emits)

    def submit(self, ids, params, top_logprobs, emit, route=None) -> int:
        rid = next(self._rids)
        self._emits[rid] = emit
        self.core.add(protocol.Request(rid, ids, params, top_logprobs))
        return rid

    def abort(self, rid: int) -> None:
        if self._emits.pop(rid, None) is not None:
            self.core.abort(rid)

    def step(self) -> None:
        deliver(self.core.step(), self._emits)
        self.stats = self.core.stats()
        if self.on_stats is not None:
            self.on_stats(self.stats)


def deliver(outs: list[Output], emits: dict[int, Emit]) -> None:
    """Each output to its request's callback; a request's last output lets it go. Outputs of
    a request aborted meanwhile are dropped."""
    for out in outs:
        emit = emits.get(out.rid)
        if emit is None:
            continue
        if protocol.is_end(out):
            del emits[out.rid]
        emit(out)
