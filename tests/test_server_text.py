"""The server's text side without a server: a Choice fed the engine's outputs by hand, its
events made into bodies by a Response, as serve/app.py does, for a byte-level BPE and a
Llama-style SentencePiece tokenizer."""

from __future__ import annotations

import asyncio

import pytest

from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine.protocol import Finished, Logprob, Token
from fastmamba.io.prompts import PromptEncoder
from fastmamba.serve.choices import Choice
from fastmamba.serve.metrics import Metrics
from fastmamba.serve.responses import Response

pytest.importorskip("prometheus_client")


class Engine:
    """Takes one request and leaves its outputs to the test."""

    rid = 7

    def __init__(self):
        self.aborted = False

    def submit(self, ids, params, top_logprobs, emit, route=None) -> int:
        return self.rid

    def abort(self, rid) -> None:
        self.aborted = True


def serve(tokenizer, prompt: str, tokens: list[int], *, stop=(), logprobs: list[Logprob] | None = None,
          top_logprobs: int | None = None, chat=False, echo=False, reason="length"):
    """A choice of `prompt` that the engine answers with `tokens` (and `logprobs`, one a
    token) then ends for `reason`: (Response, the stream's (piece, finish, logprob entry)
    for each event)."""
    ids = tokenizer.encode(prompt)
    events: asyncio.Queue = asyncio.Queue()
    engine = Engine()
    choice = Choice(0, ids, SamplingParams(max_tokens=len(tokens)), tuple(stop), top_logprobs, tokenizer, events,
                    engine, Metrics())
    choice.submit()
    for k, t in enumerate(tokens):
        choice.on_output(Token(engine.rid, t, logprobs[k] if logprobs else None))
    choice.on_output(Finished(engine.rid, reason, len(ids), len(tokens), 0, 0.0))
    response = Response("cmpl-1", "m", chat, PromptEncoder(tokenizer, tokenizer.vocab_size), [prompt if echo else ""])
    streamed = []
    while not events.empty():
        _, kind, data = events.get_nowait()
        streamed.append(response.add(0, kind, data))
    return response, streamed


def test_a_sentencepiece_outputs_first_space_stays_after_its_prompt(llama):
    the = llama._tok.token_to_id("▁the")
    for echo, want in ((False, " the the"), (True, "To be the the")):
        response, streamed = serve(llama, "To be", [the, the], echo=echo)
        assert response.response()["choices"][0]["text"] == want
        assert "".join(piece for piece, _, _ in streamed) == want


def greedy_logprobs(tokens: list[int]) -> list[Logprob]:
    return [Logprob(-0.25, [(t, -0.25)]) for t in tokens]


def offsets_index_the_text(response, streamed) -> list[int]:
    """The completion's text_offset (checked to be the streamed one's too) after each
    token's text was checked to start there."""
    choice = response.response()["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    assert [e["at"] for _, _, e in streamed if e] == lp["text_offset"]
    assert [text[at:at + len(t)] for t, at in zip(lp["tokens"], lp["text_offset"])] == lp["tokens"]
    return lp["text_offset"]


@pytest.mark.parametrize("echo", [False, True])
def test_text_offset_counts_text_held_back_for_a_stop_string(byte_level, echo):
    """'k', 'in', 'g' are held back as a possible start of 'kingl' until ',' comes: each
    token's text starts where it is in the returned text all the same."""
    tokens = byte_level.encode(" a king, and a")
    assert len(tokens) >= 4
    prompt = "To be"
    response, streamed = serve(byte_level, prompt, tokens, stop=["kingl"], logprobs=greedy_logprobs(tokens),
                               top_logprobs=1, echo=echo)
    start = len(prompt) if echo else 0
    assert response.response()["choices"][0]["text"] == (prompt if echo else "") + " a king, and a"
    pieces = [byte_level.decode([t]) for t in tokens]
    want = [start + sum(map(len, pieces[:k])) for k in range(len(tokens))]
    assert offsets_index_the_text(response, streamed) == want


def test_completions_top_logprobs_hold_the_sampled_token(byte_level):
    """As OpenAI's legacy completions: "the logprob of the sampled token, so there may be up
    to logprobs+1 elements"; chat's top_logprobs are the k best only."""
    a, b, c = (byte_level.encode(w)[0] for w in (" a", " the", " to"))
    logprobs = [Logprob(-2.5, [(b, -0.5), (c, -1.5)]), Logprob(-0.5, [(b, -0.5), (c, -1.5)])]
    response, _ = serve(byte_level, "To be", [a, b], logprobs=logprobs, top_logprobs=2)
    lp = response.response()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-2.5, -0.5]
    assert lp["top_logprobs"] == [{" the": -0.5, " to": -1.5, " a": -2.5}, {" the": -0.5, " to": -1.5}]
    chat, _ = serve(byte_level, "To be", [a, b], logprobs=logprobs, top_logprobs=2, chat=True)
    content = chat.response()["choices"][0]["logprobs"]["content"]
    assert [[e["token"] for e in entry["top_logprobs"]] for entry in content] == [[" the", " to"]] * 2


@pytest.mark.parametrize("name", ["byte_level", "llama"])
@pytest.mark.parametrize("text, whole_characters", [(" that is the question", True),
                                                    (" naïve 日本語のテキスト €", False)])
def test_logprob_tokens_are_their_own_bytes(name, text, whole_characters, request):
    """Chat's `bytes` join to the text's bytes, characters split across tokens included;
    token strings (the bytes decoded, U+FFFD for part of a character) join to the text
    where every token holds whole characters, SentencePiece's spaces included."""
    tokenizer = request.getfixturevalue(name)
    prompt = "To be"
    tokens = tokenizer.encode(prompt + text)[len(tokenizer.encode(prompt)):]
    chat, _ = serve(tokenizer, prompt, tokens, logprobs=greedy_logprobs(tokens), top_logprobs=1, chat=True)
    content = chat.response()["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == text.encode()
    assert all(e["token"] == bytes(e["bytes"]).decode("utf-8", "replace") for e in content)
    completion, _ = serve(tokenizer, prompt, tokens, logprobs=greedy_logprobs(tokens), top_logprobs=1)
    choice = completion.response()["choices"][0]
    assert choice["text"] == text and choice["logprobs"]["tokens"] == [e["token"] for e in content]
    assert ("".join(choice["logprobs"]["tokens"]) == text) == whole_characters


@pytest.mark.parametrize("stop, text, reason", [
    (["\ufffd"], " to be ", "stop"),
    ([" \ufffd"], " to be", "stop"),  # (the ' ' held back for it, the U+FFFD flushed at the end)
    (["zz"], " to be \ufffd", "length"),
])
def test_stop_strings_are_looked_for_in_the_text_flushed_at_the_end(byte_level, stop, text, reason):
    """max_tokens cuts '€' after its first bytes: they are decoded at the end, as U+FFFD."""
    prompt = "To be"
    tokens = byte_level.encode(prompt + " to be €")[len(byte_level.encode(prompt)):-1]
    assert byte_level.decode(tokens) == " to be \ufffd"
    response, streamed = serve(byte_level, prompt, tokens, stop=stop)
    choice = response.response()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (text, reason)
    assert "".join(piece for piece, _, _ in streamed) == text and streamed[-1][1] == reason
