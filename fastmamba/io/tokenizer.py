"""Text <-> token ids through the checkpoint's tokenizer.json, and UTF-8-safe streaming."""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from typing import Sequence

from fastmamba.core.errors import CheckpointError

# Prompt tokens an IncrementalDecoder decodes ahead of the output: any one keeps a decoder's
# strip of a text's leading space off the output; four hold a UTF-8 character's byte tokens
# whole, so a prompt that ends inside a character gives the output no U+FFFD.
PROMPT_CONTEXT_TOKENS = 4

BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's token for a byte it has no piece for


def _byte_level_bytes() -> dict[str, int]:
    """GPT-2's byte-to-unicode map, inverted: byte-level BPE spells each byte as one
    printable character, the printable ones as themselves and the rest as 256 onwards."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


BYTE_LEVEL_BYTES = _byte_level_bytes()


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise CheckpointError(f"{path}: cannot read tokenizer ({e})") from None
        self.path = Path(path)
        self._token_bytes: dict[int, bytes] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """add_special_tokens: the tokenizer's post-processor too (a BOS where its model
        starts every text with one), as a text prompt takes; a chat template's text has its own."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def id_limit(self) -> int:
        """The largest token id + 1: more than vocab_size where the ids leave gaps."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes, which decoding it alone loses: a byte-level token's part of a
        character (decoded, U+FFFD), a SentencePiece token's leading space (stripped from a
        text's first token). Other tokenizers' tokens: their text decoded alone."""
        own = self._token_bytes.get(token_id)
        if own is None:
            own = self._token_bytes[token_id] = self._spelled_bytes(token_id)
        return own

    def _spelled_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is not None and token_id not in self._added_ids:
            if self._spelling == "byte_level" and all(c in BYTE_LEVEL_BYTES for c in piece):
                return bytes(BYTE_LEVEL_BYTES[c] for c in piece)
            if self._spelling == "metaspace":
                byte = BYTE_FALLBACK_TOKEN.fullmatch(piece) if self._byte_fallback else None
                return bytes([int(byte[1], 16)]) if byte else piece.replace("▁", " ").encode()
        return self.decode([token_id]).encode()

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        """Added tokens (special ones among them) are spelled as their text, in no scheme."""
        return frozenset(self._tok.get_added_tokens_decoder())

    @cached_property
    def _pipeline_steps(self) -> list[dict]:
        """The decoder's and pre-tokenizer's steps (a Sequence's, in order), from tokenizer.json."""
        # (the two parts alone: the whole tokenizer.json of a 256k vocabulary is tens of MB,
        # its first logprobs request's stall on the server's event loop)
        steps, todo = [], [json.loads(part.__getstate__()) if part is not None else None
                           for part in (self._tok.decoder, self._tok.pre_tokenizer)]
        while todo:
            step = todo.pop(0)
            if step:
                steps.append(step)
                todo += step.get("decoders", []) + step.get("pretokenizers", [])
        return steps

    @cached_property
    def _spelling(self) -> str | None:
        """How vocabulary entries spell bytes: "byte_level" (GPT-2's map), "metaspace"
        ('▁' for a space: SentencePiece's), or None (neither: decode a token alone)."""
        types = {step["type"] for step in self._pipeline_steps}
        if "ByteLevel" in types:
            return "byte_level"
        if "Metaspace" in types or any(step["type"] == "Replace" and step.get("pattern") == {"String": "▁"}
                                       for step in self._pipeline_steps):
            return "metaspace"
        return None

    @cached_property
    def _byte_fallback(self) -> bool:
        """'<0xNN>' tokens are bytes (the decoder turns them into bytes)."""
        return any(step["type"] == "ByteFallback" for step in self._pipeline_steps)


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces that never split a character.

    Byte-level BPE tokens can end inside a multi-byte UTF-8 character; such a token's text is
    held back (decoding shows U+FFFD) until a later token completes the character. Only a
    short window of recent tokens is decoded each time, so the cost per token stays flat.

    `prompt`: the ids the output continues (none: the output starts the text). Its last few
    are decoded with the first output tokens and never emitted: a SentencePiece decoder
    strips the space of a text's first token, which is the output's first token only when
    the output is decoded alone. The pieces then join to decode(prompt + output) less
    decode(prompt).
    """

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_start = 0  # window start: tokens before it are fully emitted
        self.read_start = len(self.ids)  # tokens before it have their text emitted

    def push(self, token_id: int) -> str:
        """Adds a token; returns the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_start : self.read_start])
        full = self.tokenizer.decode(self.ids[self.prefix_start :])
        if full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the bytes that finish it
        self.prefix_start, self.read_start = self.read_start, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Text still held back at the end (only when the output ends mid-character)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_start : self.read_start])
        full = self.tokenizer.decode(self.ids[self.prefix_start :])
        self.prefix_start = self.read_start = len(self.ids)
        return full[len(prefix) :]
