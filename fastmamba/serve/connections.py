"""The HTTP connections' limits under uvicorn: how many may be open, how long a client may
take over its request's headers and how large they may be.

uvicorn closes a connection idle between requests (`timeout_keep_alive`) and refuses
requests past `limit_concurrency` once their headers are in, but it reads headers for as
long as a client cares to send them, and it takes every connection the kernel hands it. So
a thousand slow clients hold a thousand open files: past the process's open-file limit
every other client is refused by the kernel. The protocol here refuses a connection past
the limit the moment it opens (a 503 with an OpenAI error body, and the file closed), and
closes one whose headers are not in after `header_timeout` seconds or past
MAX_HEADER_BYTES. The limit leaves room below the open-file limit for the server's own
files (sockets to the engine, worker pipes, logs).
"""

from __future__ import annotations

import json

MAX_HEADER_BYTES = 64 << 10  # a request line and headers: far past any real client's
REFUSED_LINGER_S = 0.5  # a refused connection stays open this long for the client to read the refusal


def open_file_limit() -> int:
    """The process's open-file limit, raised to its hard limit (up to 65536) first, as
    servers do: the soft limit is often 1024 where the hard one is far higher."""
    try:
        import resource
    except ImportError:
        return 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return 65536 if soft == resource.RLIM_INFINITY else soft


def connection_limit(open_files: int) -> int:
    """Connections the server takes at once: its open-file limit less what its own files
    need (an eighth of it, 128 at least)."""
    return max(16, open_files - max(128, open_files // 8))


def _response(status: int, reason: str, error: dict) -> bytes:
    body = json.dumps({"error": error}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def guarded(base, max_connections: int, header_timeout: float):
    """uvicorn's HTTP protocol class `base` (httptools' or h11's) with the limits above."""
    refusal = _response(503, "Service Unavailable", {
        "message": f"the server has {max_connections} connections open, its limit (from its open-file limit, "
                   "ulimit -n); try again shortly",
        "type": "server_error", "param": None, "code": "too_many_connections"})
    too_slow = _response(408, "Request Timeout", {
        "message": f"the request's headers did not arrive in {header_timeout:g} s (--client-timeout)",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"})
    too_big = _response(431, "Request Header Fields Too Large", {
        "message": f"the request's headers are over {MAX_HEADER_BYTES} bytes", "type": "invalid_request_error",
        "param": None, "code": "headers_too_large"})

    class Guarded(base):
        _refused = False
        _deadline = None  # the timer of the headers awaited, while they are
        _header_bytes = 0

        def connection_made(self, transport) -> None:
            if len(self.server_state.connections) >= max_connections:
                self._refused = True
                self.transport = transport
                transport.write(refusal)
                if transport.can_write_eof():
                    transport.write_eof()
                self._deadline = self.loop.call_later(REFUSED_LINGER_S, transport.close)
                return
            super().connection_made(transport)
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            cycle = self.cycle
            if self._deadline is None and (cycle is None or (cycle.response_complete and not cycle.more_body)):
                self._await_headers()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            if self._deadline is None:
                return
            if self.cycle is not cycle:  # a request's headers are in
                self._deadline.cancel()
                self._deadline = None
            else:
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES:
                    self._deadline.cancel()
                    self._end(too_big)

        def eof_received(self):
            if self._refused:
                self.transport.close()
                return None
            return super().eof_received()

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            if self._refused:
                return
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            self._header_bytes = 0
            self._deadline = self.loop.call_later(header_timeout, self._end, too_slow)

        def _end(self, response: bytes) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.write(response)
                self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def http_protocol():
    """uvicorn's own choice of HTTP protocol class: httptools' where it is installed, else h11's."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol
