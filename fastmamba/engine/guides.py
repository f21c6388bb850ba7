"""Structured output: a request's guide (SamplingParams.guide: a JSON object, a JSON schema, a
regular expression or a list of choices) as an xgrammar grammar over the checkpoint's
vocabulary, and a matcher a request that says which tokens may come next.

The engine knows token ids only: the vocabulary comes from the checkpoint's tokenizer.json,
read when the first guided request comes (xgrammar is imported then, and only then: `pip
install 'fastmamba[structured]'`). Each distinct guide compiles once (a small cache); a
matcher lives as long as its request.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path

import torch

from fastmamba.core.transfer import to_device

STRUCTURED_EXTRA = "pip install 'fastmamba[structured]'"
CACHED_GRAMMARS = 64
# the request field each kind comes from at the HTTP API (an error names it)
FIELD = {"json_object": "response_format", "json_schema": "response_format", "regex": "guided_regex",
         "choice": "guided_choice"}


_SOURCE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GuideError(ValueError):
    """A guide that cannot be served (a bad schema or regex, no xgrammar, no tokenizer): the
    request's fault, a 400 naming `field` (FIELD's of the guide's kind), which its message
    leaves out."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def tokenizer_info(tokenizer_json: Path, vocab_size: int, eos: int):
    """xgrammar's TokenizerInfo of a tokenizer.json, as TokenizerInfo.from_huggingface builds
    it for a fast tokenizer (its vocabulary by id, the vocab type and add_prefix_space
    detected from the serialized tokenizer), without transformers. vocab_size: the model's
    logits' width (at least the tokenizer's)."""
    import xgrammar

    text = Path(tokenizer_json).read_text(encoding="utf-8")
    data = json.loads(text)
    vocab = data["model"]["vocab"]
    if isinstance(vocab, list):  # a Unigram model's [piece, score] pairs
        vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
    vocab = dict(vocab)
    for added in data.get("added_tokens") or ():
        vocab[added["content"]] = added["id"]
    encoded = [""] * vocab_size
    for token, i in vocab.items():
        if i < vocab_size:
            encoded[i] = token
    meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(text)
    return xgrammar.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=[eos],
                                  add_prefix_space=meta["add_prefix_space"])


class Guides:
    """The grammars of one engine: compiled on first use, by guide."""

    def __init__(self, tokenizer_json: Path | None, vocab_size: int, eos: int):
        self.tokenizer_json, self.vocab_size, self.eos = tokenizer_json, vocab_size, eos
        self._compiler = None
        self._grammars: OrderedDict = OrderedDict()

    def compiler(self, field: str):
        """The grammar compiler, made on first use; `field`: the one its errors name."""
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError:
                raise GuideError(f"structured output needs xgrammar: {STRUCTURED_EXTRA}", field) from None
            if self.tokenizer_json is None:
                raise GuideError("structured output needs the checkpoint's tokenizer.json, and this one has none",
                                 field)
            self._compiler = xgrammar.GrammarCompiler(tokenizer_info(self.tokenizer_json, self.vocab_size, self.eos))
        return self._compiler

    def compiled(self, guide: tuple[str, str]):
        grammar = self._grammars.get(guide)
        if grammar is not None:
            self._grammars.move_to_end(guide)
            return grammar
        kind, spec = guide
        compiler = self.compiler(FIELD[kind])
        try:
            # JSON without free whitespace between its tokens (a model that may put any there
            # can run to max_tokens in it); json_object: any JSON object
            if kind in ("json_object", "json_schema"):
                grammar = compiler.compile_json_schema(spec if kind == "json_schema" else '{"type": "object"}',
                                                       any_whitespace=False)
            elif kind == "regex":
                grammar = compiler.compile_regex(spec)
            else:  # choice: one of the strings, as a grammar of string literals
                choices = json.loads(spec)
                grammar = compiler.compile_grammar("root ::= " + " | ".join(
                    json.dumps(c, ensure_ascii=False) for c in choices))
        except Exception as e:  # xgrammar's errors are RuntimeErrors and ValueErrors naming the culprit
            what = {"json_object": "JSON", "json_schema": "JSON schema", "regex": "regex", "choice": "choices"}[kind]
            why = _SOURCE.sub("", str(e).strip())  # (without its "[time] file.cc:line: ")
            raise GuideError(f"cannot compile the {what}: {why[:300]}", FIELD[kind]) from None
        self._grammars[guide] = grammar
        if len(self._grammars) > CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return grammar

    def matcher(self, guide: tuple[str, str], stops: frozenset):
        """A request's matcher: the grammar's end is reachable through the request's stop tokens
        (the model's eos unless it names its own); with none, the grammar's end ends it."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compiled(guide), override_stop_tokens=sorted(stops) or None,
                                       terminate_without_stop_token=not stops)


def token_bitmask(matchers: list, logits: torch.Tensor) -> torch.Tensor | None:
    """The tokens each row of `logits` (n, V) may draw next, as the samplers take them
    (core/sampling.py: xgrammar's int32 (n, ceil(V/32)) bitmask, on the logits' device): a
    row whose matcher (a matcher or None per row) is given held to what its grammar allows,
    the rows without one allowing every token; None where no row is guided."""
    rows = [k for k, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(matchers), logits.shape[-1])  # (every token allowed)
    for k in rows:
        matchers[k].fill_next_token_bitmask(bitmask, k)
    # from pinned memory: a copy from pageable memory waits for the stream's queued work,
    # i.e. for this step's pass, so the host could not fill the masks and launch the
    # sampling while it ran (why no row `indices` go with it either: xgrammar copies them so)
    return to_device(bitmask, logits.device)
