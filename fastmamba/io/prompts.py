"""Prompts to token ids: a string through the checkpoint's tokenizer, or token ids checked
against the vocabulary. Shared by the language model and the HTTP front end, which has no
model and imports no torch."""

from __future__ import annotations

import numbers
from pathlib import Path

from fastmamba.io.tokenizer import Tokenizer


class PromptEncoder:
    """Prompts to token ids with a checkpoint's tokenizer (or none) and vocabulary: the
    language model's, and the server's front end's, which has no model."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, path: Path | None = None):
        self.tokenizer, self.vocab_size, self.path = tokenizer, vocab_size, path

    def encode(self, prompt, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt: a str, or token ids (a list or tuple of ints, a 1-D integer
        tensor or numpy array). Anything else is a ValueError naming the problem. A str gets
        the tokenizer's special tokens (a BOS where its post-processor adds one), as
        transformers' tokenizer(text) and vLLM's completions give; a chat template's rendered
        text passes add_special_tokens=False (the template writes its own)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                where = f" in {self.path}" if self.path else ""
                raise ValueError(f"this model has no tokenizer.json{where}: pass the prompt as a list of token ids")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"the prompt is not valid text: a lone surrogate at character {e.start}") from None
            ids = self.tokenizer.encode(prompt, add_special_tokens)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        elif hasattr(prompt, "dtype") and hasattr(prompt, "tolist"):  # a torch tensor or numpy array
            kind = getattr(prompt, "ndim", None)
            if kind != 1 or not is_integer_dtype(prompt.dtype):
                raise ValueError(f"a prompt of token ids must be 1-D integers, got {describe(prompt)}")
            ids = prompt.tolist()
        else:
            hint = " (decode bytes to str first)" if isinstance(prompt, (bytes, bytearray)) else ""
            raise ValueError(f"a prompt is a str or a list of token ids, got {describe(prompt)}{hint}")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        return check_token_ids(ids, self.vocab_size, "prompt")



def check_token_ids(ids, vocab: int, what: str) -> list[int]:
    """ids as a list of Python ints, or a ValueError naming the first one that is not a
    token id in [0, vocab). (The server checks request fields with it too.)"""
    if isinstance(ids, list) and set(map(type, ids)) <= {int} and (not ids or (min(ids) >= 0 and max(ids) < vocab)):
        return ids  # (C-level checks: a long prompt's ids one by one in Python cost milliseconds)
    for t in ids:  # the first culprit, named
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"{what} holds {t!r} ({type(t).__name__}), not an integer token id")
        if not 0 <= t < vocab:
            raise ValueError(f"{what} holds token id {int(t)}, outside the vocabulary [0, {vocab})")
    return [int(t) for t in ids]


def is_integer_dtype(dtype) -> bool:
    """True for the integer dtypes of torch and numpy (not bool, float or complex), without
    importing either."""
    if hasattr(dtype, "is_floating_point"):  # a torch dtype
        return not dtype.is_floating_point and not dtype.is_complex and str(dtype) != "torch.bool"
    return getattr(dtype, "kind", None) in ("i", "u")


def describe(value) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"{type(value).__name__} of shape {tuple(shape)} and dtype {value.dtype}"
    return f"{type(value).__name__} {value!r}"[:120]
