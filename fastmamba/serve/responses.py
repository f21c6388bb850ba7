"""OpenAI's response and stream-chunk bodies, built from a request's choices' events (a chat's
tool calls read from each choice's text by tools.ToolReply)."""

from __future__ import annotations

import json
import time


def sse(obj: dict) -> str:
    """One server-sent event of a JSON body."""
    return f"data: {json.dumps(obj)}\n\n"


class Response:
    """Builds OpenAI's response and chunk bodies from the engine's events, choice by choice."""

    def __init__(self, rid, model, chat, encoder, echoes, n: int = 1, tools=None):
        self.rid, self.model, self.chat, self.encoder, self.n = rid, model, chat, encoder, n
        self.tools = tools  # a chat's tools.ToolRequest, or None
        self.replies = [tools.reply() for _ in echoes] if tools is not None else [None] * len(echoes)
        self.created = int(time.time())
        self.texts = list(echoes)
        self.first = [True] * len(echoes)
        self.finish = [None] * len(echoes)
        self.logprobs = [[] for _ in echoes]
        self.usage = dict(prompt_tokens=0, completion_tokens=0, cached_tokens=0)
        self._templates: dict[int, list[str]] = {}

    def sse_chunk(self, index, piece: str, finish, logprob) -> str:
        """A stream chunk's server-sent event. A plain token's comes from a template made
        once a choice (its JSON with a marker where the text goes): a token's JSON costs a
        dumps of its text only, which matters at tens of streams a step. A choice read for
        tool calls has its deltas from its ToolReply."""
        reply = self.replies[index]
        if reply is not None:
            if finish is None:
                return sse(self.chunk(index, reply.delta(piece), None, logprob))
            return sse(self.chunk(index, reply.last(piece, self.texts[index]), reply.finish(finish), logprob))
        if finish is not None or logprob is not None:
            return sse(self.chunk(index, {"content": piece} if self.chat else piece, finish, logprob))
        template = self._templates.get(index)
        if template is None:
            mark = "\u0000text\u0000"
            body = sse(self.chunk(index, {"content": mark} if self.chat else mark, None, None))
            template = self._templates[index] = body.split(json.dumps(mark))
        return template[0] + json.dumps(piece) + template[1]

    def first_delta(self, index) -> dict:
        reply = self.replies[index]
        return reply.first_delta() if reply is not None else {"role": "assistant", "content": ""}

    def add(self, index, kind, data):
        """One event -> (text piece, finish reason, logprob entry) for a chunk."""
        if kind == "done":
            self.finish[index] = data["finish_reason"]
            for key in self.usage:  # (a prompt counted once, not once for each of its n choices)
                if key == "completion_tokens" or index % self.n == 0:
                    self.usage[key] += data[key]
            self.texts[index] += data["tail"]
            return data["tail"], data["finish_reason"], None
        piece = data["text"] or ""
        out = self.texts[index] + piece if self.first[index] else piece  # echo: the prompt goes out first
        at = len(self.texts[index]) + data["held"]
        entry = self._logprob(data, at) if data["logprob"] is not None else None
        self.texts[index] += piece
        self.first[index] = False
        if entry is not None:
            self.logprobs[index].append(entry)
        return out, None, entry

    def _bytes(self, t: int) -> bytes:
        """A token's own bytes, where decoding it alone would give U+FFFD for part of a
        character or drop a SentencePiece token's space (with no tokenizer: its id's digits)."""
        return self.encoder.tokenizer.token_bytes(t) if self.encoder.tokenizer else str(t).encode()

    def _token(self, t: int) -> str:
        return self._bytes(t).decode("utf-8", "replace")

    def _logprob(self, data, at: int) -> dict:
        """A token's logprob entry; a completion's keeps `at`, where its text starts in the
        choice's text (after an echoed prompt, and after text held back for a stop string),
        for text_offset."""
        lp = data["logprob"]
        if self.chat:
            def one(t, v):  # (`bytes`: how a client joins the parts of a character split across tokens)
                b = self._bytes(t)
                return {"token": b.decode("utf-8", "replace"), "logprob": v, "bytes": list(b)}

            return {**one(data["token"], lp["logprob"]), "top_logprobs": [one(t, v) for t, v in lp["top"]]}
        top = {self._token(t): v for t, v in lp["top"]}
        if all(t != data["token"] for t, _ in lp["top"]):  # OpenAI's: the sampled token's is always there
            top[self._token(data["token"])] = lp["logprob"]
        return {"token": self._token(data["token"]), "logprob": lp["logprob"], "top": top, "at": at}

    def _choice_logprobs(self, entries):
        if not entries:
            return None
        if self.chat:
            return {"content": entries}
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [e["top"] for e in entries], "text_offset": [e["at"] for e in entries]}

    def _usage(self):
        u = self.usage
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}

    def response(self) -> dict:
        choices = []
        for i, text in enumerate(self.texts):
            c = {"index": i, "finish_reason": self.finish[i], "logprobs": self._choice_logprobs(self.logprobs[i])}
            reply = self.replies[i]
            if reply is not None:
                c["message"] = reply.message(text)
                c["finish_reason"] = reply.finish(self.finish[i])
            else:
                c.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
            choices.append(c)
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "usage": self._usage()}

    def chunk(self, index, delta, finish, logprob) -> dict:
        c = {"index": index, "finish_reason": finish, "logprobs": self._choice_logprobs([logprob] if logprob else [])}
        c.update({"delta": delta} if self.chat else {"text": delta})
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [c]}

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": self._usage()}
