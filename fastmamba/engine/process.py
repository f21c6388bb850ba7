"""The engine core (engine_core.py) in a process of its own, for `serve`: the front end (HTTP,
tokenization, detokenization, SSE) and the engine share no interpreter lock, so the engine
never waits for the front end's Python, and the front end never waits for a step.

Between them, ZeroMQ PUSH/PULL sockets over ipc:// carry protocol.py's messages as msgpack:
Request, Abort and Shutdown to the engine; Ready or Fatal once, then Outputs (one a step,
with every output of the step and the engine's stats, and at least one every HEARTBEAT_S
when idle) back. The socket files go as soon as both connections are up. The front end
watches the process: if it dies, or sends nothing for `silence_s` (stopped, or stuck in a
step), `alive` turns False and every request still open ends with a Failed
(protocol.ENGINE_DOWN) at once. The engine process watches its parent: when the front end
is gone, however it went (while the engine loads too), the engine removes the socket
folder and exits.

No torch at import: the engine process imports the model stack when it starts.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
import time

from fastmamba.engine import protocol
from fastmamba.engine.client import Emit, EngineClient, EngineRefused, deliver
from fastmamba.engine.options import EngineOptions
from fastmamba.engine.protocol import EngineError, Failed, Stats

HEARTBEAT_S = 0.5  # the engine's longest silence while it is well (its idle loop sends its stats)
FINAL_LINGER_MS = 1000  # how long the engine's last message (Fatal, or the requests it failed) may take to go
log = logging.getLogger(__name__)


def exit_with_parent(remove: tuple[str, ...] = ()) -> None:
    """In a process that multiprocessing spawned: a thread that waits for the parent to end
    (its sentinel pipe closes, however the parent died: SIGKILL included), removes the
    folders `remove` and ends this process at once. It does not wait for the main thread,
    which may be inside a step, a blocked send or zmq's Context.term."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        multiprocessing.connection.wait([parent.sentinel])
        for path in remove:
            shutil.rmtree(path, ignore_errors=True)
        os._exit(0)

    threading.Thread(target=watch, name="fastmamba-parent-watch", daemon=True).start()


def engine_main(options: EngineOptions, folder: str | None, to_engine: str, from_engine: str) -> None:
    """The engine process: builds the model and the engine core, then steps while there is
    work and waits for messages when there is none, sending its stats at least every
    HEARTBEAT_S. It ends when told to, or when the front end is gone (a front end killed,
    or ended by Ctrl-C at once, leaves no engine and no socket folder behind)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the front end decides
    exit_with_parent(remove=(os.path.dirname(to_engine.removeprefix("ipc://")),))
    import zmq

    from fastmamba.engine.options import build_engine

    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # a message to a front end that is gone never holds the process
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(to_engine)
    outbox.connect(from_engine)
    encode, decode = protocol.encoder().encode, protocol.decoder(protocol.ToEngine).decode

    def last(msg) -> None:
        """The process's last message, given FINAL_LINGER_MS to reach the front end."""
        outbox.send(encode(msg))
        outbox.close(linger=FINAL_LINGER_MS)
        inbox.close()
        ctx.term()

    try:
        core, ready = build_engine(options, folder)
    except Exception as e:  # the front end prints it as the command's one line
        return last(protocol.Fatal(f"{e}" if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}"))
    outbox.send(encode(ready))
    sent, sent_at = None, time.monotonic()
    while True:
        timeout = 0 if core.has_work else 100  # ms: idle, the engine sleeps in poll
        while inbox.poll(timeout):
            msg = decode(inbox.recv())
            if isinstance(msg, protocol.Request):
                core.add(msg)
            elif isinstance(msg, protocol.Abort):
                core.abort(msg.rid)
            else:  # Shutdown
                return last(protocol.Outputs(core.fail_all(protocol.SHUTDOWN_ERROR), core.stats()))
            timeout = 0
        outs = core.step() if core.has_work else []
        stats = core.stats()
        # (a freed slot changes the gauges without an output; the heartbeat says the engine is well)
        if outs or stats != sent or time.monotonic() - sent_at >= HEARTBEAT_S:
            outbox.send(encode(protocol.Outputs(outs, stats)))
            sent, sent_at = stats, time.monotonic()


class ProcessClient(EngineClient):
    """The front end's handle on the engine process: starts it and waits until it is ready,
    sends requests and aborts, and hands each request's outputs to its callback on the
    event loop of the thread that submitted it.

    options: the engine's (its model among them); folder: the checkpoint folder, resolved
    already; max_queue: requests that may wait beyond the slots (more are refused, BUSY);
    silence_s: how long the engine may send nothing (it sends at least every HEARTBEAT_S)
    before it is taken for wedged: not alive, and its open requests failed, until it speaks
    again. A request the engine cannot finish (it died or is wedged, or the server shuts
    down) gets a Failed.
    """

    def __init__(self, options: EngineOptions, folder=None, max_queue: int = 256, start_timeout: float = 3600,
                 silence_s: float = 30):
        import zmq

        if silence_s <= HEARTBEAT_S:
            raise ValueError(f"silence_s must be over the engine's heartbeat of {HEARTBEAT_S} s, got {silence_s}")
        self._encode = protocol.encoder().encode
        self._decode = protocol.decoder(protocol.FromEngine).decode
        self._dir = tempfile.mkdtemp(prefix="fastmamba-")
        self._closed = threading.Event()
        self._stop_lock = threading.Lock()  # (a drain's timer thread and the main thread may both stop it)
        self._out_lock = threading.Lock()  # (the event loop sends; a drain's timer thread sends the stop)
        self._stopping = False
        self._reader = None
        self.proc = None
        try:
            to_engine, from_engine = (f"ipc://{os.path.join(self._dir, n)}" for n in ("to-engine", "from-engine"))
            self._ctx = zmq.Context()
            self._ctx.setsockopt(zmq.LINGER, 0)  # nothing queued for a dead engine holds this process
            self._out, self._in = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
            self._out.setsockopt(zmq.SNDHWM, 0)  # (bounded by the open requests: a send never blocks the event loop)
            self._out.setsockopt(zmq.IMMEDIATE, 1)  # a send succeeds only over a connection that is up
            self._out.bind(to_engine)
            self._in.bind(from_engine)
            self.max_queue = max_queue
            self.silence_s = silence_s
            self._handlers: dict[int, Emit] = {}  # open requests (touched on the event loop only)
            self._rids = itertools.count()
            self._loop = None
            self.stats = Stats()
            self.on_stats = None
            folder = None if folder is None else str(folder)
            self.proc = multiprocessing.get_context("spawn").Process(
                target=engine_main, args=(options, folder, to_engine, from_engine), name="fastmamba-engine",
                daemon=True)
            self.proc.start()
            self.info = self._wait_ready(start_timeout)
            self._remove_socket_files()
        except BaseException:  # a failed start, or Ctrl-C while loading: no process and no folder left
            self.close()
            raise
        self.max_batch = self.info.max_batch
        self.capacity = self.max_batch + max_queue
        self.context = self.info.context
        self._alive = True
        self._wedged = False
        self._heard = time.monotonic()  # when the engine last spoke
        self._reader = threading.Thread(target=self._read, name="fastmamba-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout: float) -> protocol.Ready:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._in.poll(100):
                msg = self._decode(self._in.recv())
                if isinstance(msg, protocol.Ready):
                    return msg
                raise ValueError(msg.message)  # Fatal: the load's own message
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine process exited while starting (exit code {self.proc.exitcode})")
        raise RuntimeError(f"the engine did not start in {timeout:g} s")

    def _remove_socket_files(self, timeout: float = 10) -> None:
        """Once both connections are up the socket files have done their work: removed now,
        no way the two processes end (Ray's SIGKILL of a replica and its children included)
        leaves them behind. The engine's Ready came over one; a send succeeds only over the
        other when it is up (an Abort of no request: the engine ignores it)."""
        deadline = time.monotonic() + timeout
        while not self._send(protocol.Abort(-1)):
            if time.monotonic() > deadline or not self.proc.is_alive():
                return  # (close removes them)
            time.sleep(0.01)
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        """Running, not shutting down, and heard from within `silence_s`."""
        return self._alive and not self._stopping and not self._wedged

    # -- the event loop's side ---------------------------------------------------------------

    def submit(self, ids, params, top_logprobs, emit, route=None) -> int:
        """(`route` chooses among replicas: one engine has no use for it.)"""
        if not self.alive:
            raise EngineRefused(self._down_error())
        if len(self._handlers) - self.max_batch >= self.max_queue:  # those beyond the slots wait
            raise EngineRefused(EngineError(protocol.BUSY, f"{self.max_queue} requests are waiting already"))
        import asyncio

        self._loop = self._loop or asyncio.get_running_loop()
        rid = next(self._rids)
        if not self._send(protocol.Request(rid, ids, params, top_logprobs)):
            raise EngineRefused(EngineError(protocol.ENGINE_DOWN, "the engine is not connected"))
        self._handlers[rid] = emit
        return rid

    def abort(self, rid: int) -> None:
        if self._handlers.pop(rid, None) is not None and self.alive:
            self._send(protocol.Abort(rid))

    def _send(self, msg) -> bool:
        """Sends without waiting; False when the engine is not connected (it died)."""
        import zmq

        with self._out_lock:
            if self._out.closed:
                return False
            try:
                self._out.send(self._encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                return False
        return True

    def _down_error(self) -> EngineError:
        if self._stopping:
            return protocol.SHUTDOWN_ERROR
        if self._wedged:
            return EngineError(protocol.ENGINE_DOWN, f"the engine process has not answered for over {self.silence_s:g} "
                                                     "s (stopped, or stuck in a step); the server cannot serve")
        return EngineError(protocol.ENGINE_DOWN, "the engine is not running")

    def _dispatch(self, outs: list[protocol.Output], stats: Stats | None) -> None:
        if stats is not None and stats != self.stats:
            self.stats = stats
            if self.on_stats is not None:
                self.on_stats(stats)
        deliver(outs, self._handlers)

    def _fail_open(self, error: EngineError, abort: bool = False) -> None:
        """Ends every open request with `error`; `abort`: and tells the engine to drop them
        (a wedged engine that comes back must not run them for no one). The stats then say
        nothing runs or waits (the engine's last ones would stay on /metrics for good); its
        counters keep their counts."""
        rids = list(self._handlers)
        idle = Stats(cache_queries=self.stats.cache_queries, cache_hits=self.stats.cache_hits)
        self._dispatch([Failed(rid, error) for rid in rids], idle)
        if abort:
            for rid in rids:
                self._send(protocol.Abort(rid))

    def _on_loop(self, fn, *args) -> None:
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed meanwhile
                pass

    # -- the reader thread ------------------------------------------------------------------

    def _read(self) -> None:
        """The reader thread: it alone uses the inbound socket once the engine is ready, and
        it judges the engine's health: dead (the process ended) or wedged (silent)."""
        while not self._closed.is_set():
            if self._in.poll(100):
                msg = self._decode(self._in.recv())
                self._heard = time.monotonic()
                if self._wedged:  # (it speaks again: it takes requests again)
                    log.warning("fastmamba: the engine process answers again; the server serves")
                    self._wedged = False
                if isinstance(msg, protocol.Outputs) and (msg.outputs or msg.stats != self.stats):
                    self._on_loop(self._dispatch, msg.outputs, msg.stats)
            elif not self.proc.is_alive():
                self._alive = False
                if not self._stopping:
                    error = EngineError(protocol.ENGINE_DOWN, f"the engine process died (exit code "
                                                              f"{self.proc.exitcode}); the server cannot serve")
                    log.error("fastmamba: %s", error.message)
                    self._on_loop(self._fail_open, error)
                break
            elif not self._wedged and time.monotonic() - self._heard > self.silence_s:
                self._wedged = True
                if not self._stopping:
                    log.error("fastmamba: %s", self._down_error().message)
                    self._on_loop(self._fail_open, self._down_error(), True)
        self._in.close(linger=0)

    # -- shutting down ----------------------------------------------------------------------

    def shutdown(self, timeout: float = 10) -> None:
        """Ends the requests still open (the engine fails them and says so), then stops the
        engine process. A second call (a drain's timer, then the main thread) waits for the
        first to finish: the process never exits with the socket folder still there."""
        with self._stop_lock:
            if self._closed.is_set():
                return
            self._stopping = True
            if self.proc.is_alive() and not self._wedged:
                self._send(protocol.Shutdown())
                self.proc.join(timeout)
            if self._loop is not None and not self._loop.is_closed():
                self._on_loop(self._fail_open, protocol.SHUTDOWN_ERROR)
            self.close()

    def close(self) -> None:
        """Stops the process (at once), closes the sockets and removes their folder."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        self._closed.set()
        if self._reader is not None:
            self._reader.join(5)  # it sees the close, and closes its socket
        out, inbound, ctx = (getattr(self, name, None) for name in ("_out", "_in", "_ctx"))
        with self._out_lock:
            if out is not None:
                out.close(linger=0)
        if inbound is not None and self._reader is None:
            inbound.close(linger=0)
        if ctx is not None and (inbound is None or inbound.closed):
            ctx.term()  # (every socket closed, with linger 0: it returns at once)
        shutil.rmtree(self._dir, ignore_errors=True)
