"""One choice of a request (an engine request) and the text side of its outputs: detokenized
pieces that never split a character, and stop strings that end the text and never go out
split across pieces."""

from __future__ import annotations

import asyncio
import time

from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine.client import EngineClient
from fastmamba.engine.protocol import Failed, Finished, Output
from fastmamba.io.tokenizer import IncrementalDecoder
from fastmamba.serve.metrics import Metrics


class Choice:
    """Its events go to the response's queue as (index, kind, data): ("token", {token, text,
    logprob, held: the length of the text before the token's still held back}) ..., then
    ("done", {...}) or ("error", protocol.EngineError)."""

    def __init__(self, index: int, ids: list[int], params: SamplingParams, stop: tuple[str, ...],
                 top_logprobs: int | None, tokenizer, events: asyncio.Queue, engine: EngineClient, metrics: Metrics,
                 route: int | None = None):
        self.index, self.ids, self.params, self.stop, self.top_logprobs = index, ids, params, stop, top_logprobs
        self.route = route  # where replicas are: the key that routes it (None: its prompt's first tokens)
        self.events, self.engine, self.metrics = events, engine, metrics
        self.decoder = IncrementalDecoder(tokenizer, ids) if tokenizer else None
        self.held = [""]  # text held back: a stop string's possible start
        self.rid = None
        self.tokens = 0
        self.cached_tokens = 0
        self.arrived = self.last = time.perf_counter()
        self.ended = False

    def submit(self) -> None:
        """Raises client.EngineRefused."""
        self.rid = self.engine.submit(self.ids, self.params, self.top_logprobs, self.on_output, route=self.route)
        self.metrics.count("prompt_tokens_total", len(self.ids))

    def cancel(self) -> None:
        if self.rid is not None and not self.ended:
            self.engine.abort(self.rid)
        self.ended = True

    def _put(self, kind, data) -> None:
        self.events.put_nowait((self.index, kind, data))

    def on_output(self, out: Output) -> None:
        if self.ended:
            return
        now = time.perf_counter()
        if isinstance(out, Failed):
            self.ended = True
            return self._put("error", out.error)
        if isinstance(out, Finished):
            return self._done(out.reason, out.cached_tokens)
        if self.tokens == 0:
            self.metrics.observe("time_to_first_token_seconds", now - self.arrived)
            if out.first is not None:
                self.cached_tokens = out.first.cached_tokens
                self.metrics.observe("request_queue_time_seconds", out.first.queue_s)
        else:
            self.metrics.observe("inter_token_latency_seconds", now - self.last)
        self.last = now
        self.tokens += 1
        self.metrics.count("generation_tokens_total")
        lp = None if out.logprob is None else dict(logprob=out.logprob.chosen, top=out.logprob.top[: self.top_logprobs])
        text = self.decoder.push(out.token) if self.decoder else None
        held = len(self.held[0])  # (the token's text comes after it: its text_offset counts it)
        if text is not None and self.stop:
            text, hit = hold_stop(self.held, text, self.stop)
            if hit:
                self._put("token", dict(token=out.token, text=text, logprob=lp, held=held))
                self.engine.abort(self.rid)
                return self._done("stop", self.cached_tokens, at_stop_string=True)
        self._put("token", dict(token=out.token, text=text, logprob=lp, held=held))

    def _done(self, reason, cached_tokens, at_stop_string=False) -> None:
        self.ended = True
        tail = ""
        if not at_stop_string:
            # the text still held back: a character's first bytes (decoded now, U+FFFD),
            # after a stop string's possible start; the two may make a stop string
            tail = self.decoder.flush() if self.decoder else ""
            if self.stop:
                tail, hit = hold_stop(self.held, tail, self.stop)
                reason = "stop" if hit else reason
            tail += self.held[0]
        self.metrics.count("request_success_total")
        self.metrics.observe("e2e_request_latency_seconds", time.perf_counter() - self.arrived)
        self._put("done", dict(finish_reason=reason, tail=tail, prompt_tokens=len(self.ids),
                               completion_tokens=self.tokens, cached_tokens=cached_tokens))


def hold_stop(held: list[str], text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """Stop strings across pieces: returns the text that may go out now and whether a stop
    string was reached. held[0] keeps the tail that could still begin a stop string."""
    buf = held[0] + text
    hits = [i for i in (buf.find(s) for s in stops) if i >= 0]
    if hits:
        held[0] = ""
        return buf[: min(hits)], True
    keep = 0  # the longest tail of buf that is a prefix of some stop string
    for s in stops:
        for n in range(min(len(s) - 1, len(buf)), keep, -1):
            if buf.endswith(s[:n]):
                keep = n
                break
    held[0] = buf[len(buf) - keep :] if keep else ""
    return buf[: len(buf) - keep], False
