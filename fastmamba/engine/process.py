"""The engine core (engine_core.py) in a process of its own, for `serve`: the front end (HTTP,
tokenization, detokenization, SSE) and the engine share no interpreter lock, so the engine
never waits for the front end's Python, and the front end never waits for a step.

Between them, ZeroMQ PUSH/PULL sockets over ipc:// carry protocol.py's messages as msgpack:
Request, Abort and Shutdown to the engine; Ready or Fatal once, then Outputs (one a step,
with every output of the step and the engine's stats) back. The front end watches the
process: if it dies, `alive` turns False and every request still open ends with a Failed
(protocol.ENGINE_DOWN) at once.

No torch at import: the engine process imports the model stack when it starts.
"""

from __future__ import annotations

import itertools
import os
import signal
import tempfile
import threading
import time

from fastmamba.engine import protocol
from fastmamba.engine.client import Emit, EngineClient, EngineRefused, deliver
from fastmamba.engine.options import EngineOptions
from fastmamba.engine.protocol import EngineError, Failed, Stats


def engine_main(options: EngineOptions, folder: str | None, to_engine: str, from_engine: str) -> None:
    """The engine process: builds the model and the engine core, then steps while there is
    work and waits for messages when there is none. It ends when told to, or when the front
    end is gone (a front end killed, or ended by Ctrl-C at once, leaves no engine behind)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the front end decides
    parent = os.getppid()
    import zmq

    from fastmamba.engine.options import build_engine

    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(to_engine)
    outbox.connect(from_engine)
    encode, decode = protocol.encoder().encode, protocol.decoder(protocol.ToEngine).decode
    try:
        core, ready = build_engine(options, folder)
    except Exception as e:  # the front end prints it as the command's one line
        outbox.send(encode(protocol.Fatal(f"{e}" if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}")))
        return
    outbox.send(encode(ready))
    sent = None
    while True:
        if os.getppid() != parent:
            return
        timeout = 0 if core.has_work else 100  # ms: idle, the engine sleeps in poll
        while inbox.poll(timeout):
            msg = decode(inbox.recv())
            if isinstance(msg, protocol.Request):
                core.add(msg)
            elif isinstance(msg, protocol.Abort):
                core.abort(msg.rid)
            else:  # Shutdown
                failed = core.fail_all(protocol.SHUTDOWN_ERROR)
                outbox.send(encode(protocol.Outputs(failed, core.stats())))
                return
            timeout = 0
        if core.has_work:
            outs = core.step()
            stats = core.stats()
            if outs or stats != sent:  # (a freed slot changes the gauges without an output)
                outbox.send(encode(protocol.Outputs(outs, stats)))
                sent = stats


class ProcessClient(EngineClient):
    """The front end's handle on the engine process: starts it and waits until it is ready,
    sends requests and aborts, and hands each request's outputs to its callback on the
    event loop of the thread that submitted it.

    options: the engine's (its model among them); folder: the checkpoint folder, resolved
    already; max_queue: requests that may wait beyond the slots (more are refused, BUSY). A
    request the engine cannot finish (it died, or the server shuts down) gets a Failed.
    """

    def __init__(self, options: EngineOptions, folder=None, max_queue: int = 256, start_timeout: float = 3600):
        import multiprocessing

        import zmq

        self._encode = protocol.encoder().encode
        self._decode = protocol.decoder(protocol.FromEngine).decode
        self._dir = tempfile.mkdtemp(prefix="fastmamba-")
        to_engine, from_engine = (f"ipc://{os.path.join(self._dir, n)}" for n in ("to-engine", "from-engine"))
        self._ctx = zmq.Context()
        self._out, self._in = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._out.bind(to_engine)
        self._in.bind(from_engine)
        self._out_lock = threading.Lock()  # (the event loop sends; a drain's timer thread sends the stop)
        self.max_queue = max_queue
        self._handlers: dict[int, Emit] = {}  # open requests (touched on the event loop only)
        self._rids = itertools.count()
        self._loop = None
        self.stats = Stats()
        self.on_stats = None
        self._stopping = False
        folder = None if folder is None else str(folder)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=engine_main, args=(options, folder, to_engine, from_engine), name="fastmamba-engine", daemon=True)
        self.proc.start()
        self.info = self._wait_ready(start_timeout)
        self.max_batch = self.info.max_batch
        self._alive = True
        self._reader = threading.Thread(target=self._read, name="fastmamba-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout: float) -> protocol.Ready:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._in.poll(100):
                msg = self._decode(self._in.recv())
                if isinstance(msg, protocol.Ready):
                    return msg
                self.close()
                raise ValueError(msg.message)  # Fatal: the load's own message
            if not self.proc.is_alive():
                self.close()
                raise RuntimeError(f"the engine process exited while starting (exit code {self.proc.exitcode})")
        self.close()
        raise RuntimeError(f"the engine did not start in {timeout:g} s")

    @property
    def alive(self) -> bool:
        return self._alive and not self._stopping

    # -- the event loop's side ---------------------------------------------------------------

    def submit(self, ids, params, top_logprobs, emit, route=None) -> int:
        """(`route` chooses among replicas: one engine has no use for it.)"""
        if not self.alive:
            raise EngineRefused(EngineError(protocol.ENGINE_DOWN, "the engine is not running"))
        if len(self._handlers) - self.max_batch >= self.max_queue:  # those beyond the slots wait
            raise EngineRefused(EngineError(protocol.BUSY, f"{self.max_queue} requests are waiting already"))
        import asyncio

        self._loop = self._loop or asyncio.get_running_loop()
        rid = next(self._rids)
        self._handlers[rid] = emit
        self._send(protocol.Request(rid, ids, params, top_logprobs))
        return rid

    def abort(self, rid: int) -> None:
        if self._handlers.pop(rid, None) is not None and self.alive:
            self._send(protocol.Abort(rid))

    def _send(self, msg) -> None:
        with self._out_lock:
            self._out.send(self._encode(msg))

    def _dispatch(self, outs: list[protocol.Output], stats: Stats | None) -> None:
        if stats is not None:
            self.stats = stats
            if self.on_stats is not None:
                self.on_stats(stats)
        deliver(outs, self._handlers)

    def _fail_open(self, error: EngineError) -> None:
        self._dispatch([Failed(rid, error) for rid in self._handlers], None)

    # -- the reader thread ------------------------------------------------------------------

    def _read(self) -> None:
        """The reader thread: it alone uses the inbound socket once the engine is ready."""
        while True:
            if self._in.poll(100):
                msg = self._decode(self._in.recv())
                if isinstance(msg, protocol.Outputs) and self._loop is not None:
                    self._loop.call_soon_threadsafe(self._dispatch, msg.outputs, msg.stats)
            elif not self.proc.is_alive():
                self._alive = False
                if self._loop is not None and not self._stopping:
                    down = EngineError(protocol.ENGINE_DOWN, f"the engine process died (exit code {self.proc.exitcode}); "
                                                             "the server cannot serve")
                    self._loop.call_soon_threadsafe(self._fail_open, down)
                break
        self._in.close(linger=0)

    # -- shutting down ----------------------------------------------------------------------

    def shutdown(self, timeout: float = 10) -> None:
        """Ends the requests still open (the engine fails them and says so), then stops the
        engine process."""
        if self._stopping:
            return
        self._stopping = True
        if self.proc.is_alive():
            self._send(protocol.Shutdown())
            self.proc.join(timeout)
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._fail_open, protocol.SHUTDOWN_ERROR)
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
