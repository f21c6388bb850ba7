"""The engine core (engine.py) in a process of its own, for `serve`: the front end (HTTP,
tokenization, detokenization, SSE) and the engine share no interpreter lock, so the engine
never waits for the front end's Python, and the front end never waits for a step.

Between them, ZeroMQ PUSH/PULL sockets over ipc:// carry msgpack messages (msgspec):
    front end -> engine: ("add", rid, ids, sampling fields, top_logprobs), ("abort", rid), ("stop",)
    engine -> front end: ("ready", info), ("out", outputs, stats), ("fatal", message)
where outputs are engine.py's tuples. The engine sends one message a step, with every
output of the step. The front end watches the process: if it dies, /health answers 503
and every request still open ends with a 503 at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import tempfile
import threading
import time
from typing import Callable

from fastmamba.core.sampling_params import SamplingParams


class QueueFull(Exception):
    pass


class EngineDown(Exception):
    pass


def engine_main(make_lm: Callable, engine_kwargs: dict, to_engine: str, from_engine: str) -> None:
    """The engine process: builds the model and the engine core, then steps while there is
    work and waits for messages when there is none. It ends when told to, or when the front
    end is gone (a front end killed, or ended by Ctrl-C at once, leaves no engine behind)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the front end decides
    parent = os.getppid()
    import msgspec
    import zmq

    from fastmamba.engine.engine_core import EngineCore, EngineRequest

    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(to_engine)
    outbox.connect(from_engine)
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode
    try:
        lm = make_lm()
        kwargs = dict(engine_kwargs)
        max_batch = kwargs.pop("max_batch", None) or default_max_batch(lm)
        core = EngineCore(lm, max_batch=max_batch, **kwargs)
        core.capture_prefill_graphs()
    except Exception as e:  # the front end prints it as the command's one line
        outbox.send(encode(("fatal", f"{e}" if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}")))
        return
    outbox.send(encode(("ready", dict(max_batch=max_batch, vocab_size=lm.config.vocab_size,
                                      device=str(lm.device), dtype=str(lm.dtype).removeprefix("torch.")))))
    sent = None
    while True:
        if os.getppid() != parent:
            return
        timeout = 0 if core.has_work else 100  # ms: idle, the engine sleeps in poll
        while inbox.poll(timeout):
            msg = decode(inbox.recv())
            if msg[0] == "add":
                _, rid, ids, fields, top = msg
                core.add(EngineRequest(ids, SamplingParams(**fields), top, rid=rid))
            elif msg[0] == "abort":
                core.abort(msg[1])
            else:  # "stop"
                outbox.send(encode(("out", core.fail_all("the server is shutting down", 503), core.stats())))
                return
            timeout = 0
        if core.has_work:
            outs = core.step()
            stats = core.stats()
            if outs or stats != sent:  # (a freed slot changes the gauges without an output)
                outbox.send(encode(("out", outs, stats)))
                sent = stats


def default_max_batch(lm) -> int:
    """The slots when --max-batch is not given: 16 on the CPU; on a GPU as many as half its
    free memory holds (each slot's state, logits and decode activations), at most 256."""
    if lm.device.type != "cuda":
        return 16
    import torch

    c = lm.config
    state = c.n_layer * c.d_inner * (c.d_conv + c.d_state) * lm.model.state_dtype.itemsize
    per_slot = state + 4 * c.vocab_size * 4 + 16 * c.d_inner * 4  # logits (and the sampler's copies), activations
    free, _ = torch.cuda.mem_get_info(lm.device)
    return max(1, min(256, free // 2 // per_slot))


class EngineClient:
    """The front end's handle on the engine process: starts it and waits until it is ready,
    sends requests and aborts, and hands each request's outputs to its callback on the
    front end's event loop.

    `emit(output)` is called on the event loop with each of the request's engine outputs;
    a request the engine cannot finish (it died, or the server shuts down) gets an "error"
    output with status 503.
    """

    def __init__(self, make_lm: Callable, engine_kwargs: dict, max_queue: int = 256, start_timeout: float = 3600):
        import multiprocessing

        import msgspec
        import zmq

        self._encode, self._decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode
        self._dir = tempfile.mkdtemp(prefix="fastmamba-")
        to_engine, from_engine = (f"ipc://{os.path.join(self._dir, n)}" for n in ("to-engine", "from-engine"))
        self._ctx = zmq.Context()
        self._out, self._in = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._out.bind(to_engine)
        self._in.bind(from_engine)
        self._out_lock = threading.Lock()  # (the event loop sends; a drain's timer thread sends the stop)
        self.max_queue = max_queue
        self._handlers: dict[int, Callable] = {}  # open requests (touched on the event loop only)
        self._rids = itertools.count()
        self._loop = None
        self.stats = dict(running=0, waiting=0, cache_queries=0, cache_hits=0)
        self.on_stats: Callable | None = None
        self._stopping = False
        self.proc = multiprocessing.get_context("spawn").Process(
            target=engine_main, args=(make_lm, engine_kwargs, to_engine, from_engine), name="fastmamba-engine", daemon=True)
        self.proc.start()
        self.info = self._wait_ready(start_timeout)
        self.max_batch = self.info["max_batch"]
        self._alive = True
        self._reader = threading.Thread(target=self._read, name="fastmamba-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._in.poll(100):
                kind, info = self._decode(self._in.recv())
                if kind == "ready":
                    return info
                self.close()
                raise ValueError(info)  # "fatal": the load's own message
            if not self.proc.is_alive():
                self.close()
                raise RuntimeError(f"the engine process exited while starting (exit code {self.proc.exitcode})")
        self.close()
        raise RuntimeError(f"the engine did not start in {timeout:g} s")

    @property
    def alive(self) -> bool:
        return self._alive and not self._stopping

    # -- the event loop's side ---------------------------------------------------------------

    def submit(self, ids: list[int], params: SamplingParams, top_logprobs: int | None, emit: Callable,
               route: int | None = None) -> int:
        """Sends a request; its rid. QueueFull when --max-queue requests wait already, EngineDown
        when the engine is gone. (`route` chooses among replicas: one engine has no use for it.)"""
        if not self.alive:
            raise EngineDown("the engine is not running")
        if len(self._handlers) - self.max_batch >= self.max_queue:  # those beyond the slots wait
            raise QueueFull(f"{self.max_queue} requests are waiting already")
        import asyncio

        self._loop = self._loop or asyncio.get_running_loop()
        rid = next(self._rids)
        self._handlers[rid] = emit
        self._send(("add", rid, ids, dataclasses.asdict(params), top_logprobs))
        return rid

    def abort(self, rid: int) -> None:
        """The request's client went away, or its text reached a stop string: no more outputs."""
        if self._handlers.pop(rid, None) is not None and self.alive:
            self._send(("abort", rid))

    def _send(self, msg: tuple) -> None:
        with self._out_lock:
            self._out.send(self._encode(msg))

    def _dispatch(self, outs: list, stats: dict | None) -> None:
        if stats is not None:
            self.stats = stats
            if self.on_stats is not None:
                self.on_stats(stats)
        for out in outs:
            emit = self._handlers.get(out[0])
            if emit is None:
                continue  # aborted meanwhile
            if out[3] is not None:
                del self._handlers[out[0]]
            emit(out)

    def _fail_open(self, message: str) -> None:
        for rid in list(self._handlers):
            self._dispatch([(rid, None, None, "error", dict(message=message, status=503))], None)

    # -- the reader thread ------------------------------------------------------------------

    def _read(self) -> None:
        """The reader thread: it alone uses the inbound socket once the engine is ready."""
        while True:
            if self._in.poll(100):
                msg = self._decode(self._in.recv())
                if msg[0] == "out" and self._loop is not None:
                    self._loop.call_soon_threadsafe(self._dispatch, msg[1], msg[2])
            elif not self.proc.is_alive():
                self._alive = False
                if self._loop is not None and not self._stopping:
                    self._loop.call_soon_threadsafe(self._fail_open, f"the engine process died (exit code "
                                                                     f"{self.proc.exitcode}); the server cannot serve")
                break
        self._in.close(linger=0)

    # -- shutting down ----------------------------------------------------------------------

    def shutdown(self, timeout: float = 10) -> None:
        """Ends the requests still open with a 503 (the engine fails them and says so), then
        stops the engine process."""
        if self._stopping:
            return
        self._stopping = True
        if self.proc.is_alive():
            self._send(("stop",))
            self.proc.join(timeout)
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._fail_open, "the server is shutting down")
            except RuntimeError:  # the loop closed meanwhile
                pass
        self.close()

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.join(5)  # it sees the process gone, and closes its socket
        else:
            self._in.close(linger=0)
        with self._out_lock:
            self._out.close(linger=0)
        if self._in.closed:
            self._ctx.term()
        try:
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)
        except OSError:
            pass
