"""Text <-> token ids through the checkpoint's tokenizer.json, and UTF-8-safe streaming."""

from __future__ import annotations

from pathlib import Path

from fastmamba.core.errors import CheckpointError


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

    @property
    def id_limit(self) -> int:
        """The largest token id + 1: more than vocab_size where the ids leave gaps."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces that never split a character.

    Byte-level BPE tokens can end inside a multi-byte UTF-8 character; such a token's text is
    held back (decoding shows U+FFFD) until a later token completes the character. Only a
    short window of recent tokens is decoded each time, so the cost per token stays flat.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_start = 0  # window start: tokens before it are fully emitted
        self.read_start = 0  # tokens before it have their text emitted

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
