"""Text <-> token ids through the checkpoint's tokenizer.json, and UTF-8-safe streaming."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from fastmamba.core.errors import CheckpointError

# Prompt tokens an IncrementalDecoder decodes ahead of the output: any one keeps a decoder's
# strip of a text's leading space off the output; four hold a UTF-8 character's byte tokens
# whole, so a prompt that ends inside a character gives the output no U+FFFD.
PROMPT_CONTEXT_TOKENS = 4


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise CheckpointError(f"{path}: cannot read tokenizer ({e})") from None
        self.path = Path(path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


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
