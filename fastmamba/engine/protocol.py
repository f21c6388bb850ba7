"""The engine's protocol: every message between the engine core and its clients, as msgspec
Structs, whether they stay in one process (`generate`), cross to the engine process
(`serve`, over ZeroMQ as msgpack) or to a Ray replica.

    client -> engine:  Request, Abort, Shutdown
    engine -> client:  Ready or Fatal (once, at start), then Outputs (one a step): each
                       output a Token, a Finished or a Failed, and the engine's Stats

A request's sampling parameters are validated once, where the request is made (the
SamplingParams constructor, at the HTTP front end or in `generate`); a message decoded on
the other side builds them as `CheckedSamplingParams`, which skips the checks. Errors
travel as `EngineError` with a kind, never as text to be parsed. No torch here: the HTTP
front end imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import msgspec

from fastmamba.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class CheckedSamplingParams(SamplingParams):
    """SamplingParams decoded from a message: checked where the request was made, so the
    checks do not run again here (msgspec calls __post_init__ on decoding)."""

    def __post_init__(self):
        pass


# -- client -> engine ------------------------------------------------------------------------


class Request(msgspec.Struct, tag=True, array_like=True, frozen=True):
    rid: int
    ids: list[int]
    params: CheckedSamplingParams  # (a SamplingParams where the request stays in its process); max_tokens: its bound
    top_logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the k best


class Abort(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The request's client went away, or its text reached a stop string: no more outputs."""

    rid: int


class Shutdown(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The engine fails what is open (a 503: "shutting down") and ends."""


# -- engine -> client ------------------------------------------------------------------------


class Logprob(msgspec.Struct, array_like=True, frozen=True):
    chosen: float  # the sampled token's log-probability
    top: list[tuple[int, float]]  # the k best (token id, log-probability)


class FirstToken(msgspec.Struct, array_like=True, frozen=True):
    """What a client learns with a request's first token."""

    cached_tokens: int  # prompt tokens that came from the prefix cache
    queue_s: float  # seconds from arrival to a state slot


class Token(msgspec.Struct, tag=True, array_like=True, frozen=True):
    rid: int
    token: int
    logprob: Logprob | None = None
    first: FirstToken | None = None  # on the request's first token only


class Finished(msgspec.Struct, tag=True, array_like=True, frozen=True):
    rid: int
    reason: str  # "stop" (a stop token came) or "length" (max_tokens reached)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_s: float


# EngineError kinds, and the HTTP status each stands for
NON_FINITE = "non_finite"  # the model's output is not finite for this input (its weights overflow)
INTERNAL = "internal"  # a fault of the engine's step
SHUTTING_DOWN = "shutting_down"  # the server is shutting down
ENGINE_DOWN = "engine_down"  # the engine process or replica died, or was never reached
BUSY = "busy"  # the queue is full
CONTEXT_TOO_LONG = "context_too_long"  # a request that can never fit the engine's KV cache
BAD_REQUEST = "bad_request"  # a request the engine cannot serve (a guide that does not compile): see `field`
STATUS = {NON_FINITE: 500, INTERNAL: 500, SHUTTING_DOWN: 503, ENGINE_DOWN: 503, BUSY: 429, CONTEXT_TOO_LONG: 400,
          BAD_REQUEST: 400}


class EngineError(msgspec.Struct, array_like=True, frozen=True):
    kind: str  # one of STATUS's keys
    message: str
    field: str | None = None  # a BAD_REQUEST's culprit, the HTTP API's request field (the message leaves it out)

    @property
    def status(self) -> int:
        return STATUS[self.kind]


SHUTDOWN_ERROR = EngineError(SHUTTING_DOWN, "the server is shutting down")


class Failed(msgspec.Struct, tag=True, array_like=True, frozen=True):
    rid: int
    error: EngineError


Output = Union[Token, Finished, Failed]


class Stats(msgspec.Struct, array_like=True, frozen=True):
    running: int = 0  # requests holding a state slot
    waiting: int = 0  # requests queued for a slot
    cache_queries: int = 0  # prefix cache lookups, since the engine started
    cache_hits: int = 0

    def __add__(self, other: "Stats") -> "Stats":
        return Stats(*(a + b for a, b in zip(msgspec.structs.astuple(self), msgspec.structs.astuple(other))))


class Outputs(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """One engine step's outputs, with the engine's stats after it."""

    outputs: list[Output]
    stats: Stats


class Ready(msgspec.Struct, tag=True, array_like=True, frozen=True):
    max_batch: int
    vocab_size: int
    device: str
    dtype: str
    context: int | None = None  # the most tokens (prompt and output) a request's keys and values hold; None: no bound


class Fatal(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The engine could not start: the message names the culprit (a bad checkpoint, say)."""

    message: str


ToEngine = Union[Request, Abort, Shutdown]
FromEngine = Union[Outputs, Ready, Fatal]


def is_end(out: Output) -> bool:
    """Whether the output is a request's last (it finished or failed)."""
    return not isinstance(out, Token)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(kind) -> msgspec.msgpack.Decoder:
    """A msgpack decoder of ToEngine, FromEngine or list[Output] messages."""
    return msgspec.msgpack.Decoder(kind)
