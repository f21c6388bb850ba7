"""The HTTP API's errors, as OpenAI's bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastmamba.engine.protocol import BAD_REQUEST, BUSY, CONTEXT_TOO_LONG, SHUTTING_DOWN, EngineError

# a full queue's 429 says when to try again (RFC 6585; OpenAI's clients wait that long):
# slots free as requests finish, so a second later is a fair try (a client backs off more
# on its own after another 429)
RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers  # the response's own (a 429's Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over this server's limit of {limit / 2**20:g} MiB (--max-body-mb)",
                    code="request_too_large")


def engine_down() -> APIError:
    return APIError(503, "the engine is not running; the server cannot serve requests", code="engine_unavailable",
                    kind="server_error")


def from_engine(error: EngineError, field: str | None = None) -> APIError:
    """An engine's error as the API's: 429 when its queue is full, 503 when it is shutting
    down or gone, 500 when the model failed (its weights overflow, say); a request the
    engine cannot serve is a 400 naming its field: `field` where the API knows it better
    (a tool_choice's guide, made of `tools`: tools.ToolRequest.field), else the engine's."""
    if error.kind == BUSY:
        return APIError(429, f"the server is busy: {error.message}; try again later", code="rate_limit_exceeded",
                        kind="rate_limit_error", headers={"retry-after": str(RETRY_AFTER_S)})
    if error.status == 503:
        code = "server_shutting_down" if error.kind == SHUTTING_DOWN else "engine_unavailable"
        return APIError(503, error.message, code=code, kind="server_error")
    if error.kind == BAD_REQUEST:
        field = field or error.field
        return APIError(400, f"'{field}': {error.message}" if field else error.message, param=field)
    if error.kind == CONTEXT_TOO_LONG:
        return APIError(400, error.message, param="max_tokens", code="context_length_exceeded")
    return APIError(error.status, f"generation failed: {error.message}", kind="server_error")
