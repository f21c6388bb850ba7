"""io/tokenizer.py: IncrementalDecoder's text against the tokenizer's own decode, for a
byte-level BPE and a Llama-style SentencePiece tokenizer."""

from __future__ import annotations

import pytest
from conftest import make_llama_tokenizer, make_tokenizer, save_hf_checkpoint

import fastmamba
from fastmamba.io.tokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDecoder, Tokenizer

BUILDERS = {"byte_level": make_tokenizer, "llama": make_llama_tokenizer}


@pytest.fixture(scope="module", params=list(BUILDERS))
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp(request.param) / "tokenizer.json"
    BUILDERS[request.param](path)
    return Tokenizer(path)


def decoded(tokenizer, prompt, output) -> str:
    decoder = IncrementalDecoder(tokenizer, prompt)
    return "".join(decoder.push(t) for t in output) + decoder.flush()


@pytest.mark.parametrize("prompt, output", [
    ("To be, or not to be", " that is the question"),
    ("To be", " €uro naïve"),  # '€' is no token of either: bytes (byte-fallback tokens for llama's)
    ("To", " "),
    ("", "To be"),
])
def test_output_text_is_the_whole_texts_less_the_prompts(tokenizer, prompt, output):
    p, o = tokenizer.encode(prompt), tokenizer.encode(prompt + output)[len(tokenizer.encode(prompt)):]
    assert tokenizer.decode(p + o) == prompt + output  # (the split at the prompt's end is a token boundary)
    assert decoded(tokenizer, p, o) == tokenizer.decode(p + o)[len(tokenizer.decode(p)):] == output


def test_a_sentencepiece_output_keeps_its_first_space(llama):
    """'▁Pa' decoded alone is 'Pa': the decoder strips a text's first space, which is not
    the output's when a prompt comes before it."""
    the = llama._tok.token_to_id("▁the")
    assert llama.decode([the, the]) == "the the"
    assert decoded(llama, llama.encode("To be"), [the, the]) == " the the"
    assert decoded(llama, [], [the, the]) == "the the"  # (no prompt: the output starts the text)


def test_byte_level_output_is_the_same_with_or_without_its_prompt(tmp_path):
    make_tokenizer(tmp_path / "tokenizer.json")
    tok = Tokenizer(tmp_path / "tokenizer.json")
    output = tok.encode(" that 日本語のテキスト ✓ café")
    for prompt in ("To be", "naïve", "日本"):
        assert decoded(tok, tok.encode(prompt), output) == decoded(tok, [], output) == " that 日本語のテキスト ✓ café"


def test_the_decoded_window_stays_short_whatever_the_prompts_length(llama):
    """Per-token cost stays flat: a few of the prompt's tokens, then one or two a token."""
    lengths = []

    class Counting:
        def decode(self, ids):
            lengths.append(len(ids))
            return llama.decode(ids)

    prompt, output = " ".join(["To be, or not to be, that is the question."] * 20), " Whether 'tis nobler in the mind to suffer"
    p = llama.encode(prompt)
    decoder = IncrementalDecoder(Counting(), p)
    assert "".join(decoder.push(t) for t in llama.encode(prompt + output)[len(p):]) == output
    assert max(lengths) == PROMPT_CONTEXT_TOKENS + 1 and max(lengths[2:]) == 2


def test_generate_stream_and_batch_keep_a_sentencepiece_outputs_first_space(tmp_path):
    lm = fastmamba.load(save_hf_checkpoint(tmp_path / "m", seed=3, tokenizer=make_llama_tokenizer))
    the = lm.tokenizer._tok.token_to_id("▁the")
    kw = dict(max_tokens=2, logit_bias={the: 100}, stop_token_ids=[])
    g = lm.generate("To be", **kw)
    assert g.token_ids == [the, the] and g.text == " the the"
    assert "".join(p.text for p in lm.stream("To be", **kw)) == " the the"
    assert [b.text for b in lm.generate_batch(["To be", "Or not"], fastmamba.SamplingParams(**kw))] == [" the the"] * 2


def test_token_bytes_join_to_the_texts_bytes(tokenizer):
    """A token's own bytes: part of a character for some (decoded alone: U+FFFD), a
    SentencePiece token's space kept (decoded alone: stripped)."""
    prompt, text = "To be", " or not, naïve café: 日本語のテキスト ✓ €"
    ids = tokenizer.encode(prompt + text)[len(tokenizer.encode(prompt)):]
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == text.encode()
    assert any(tokenizer.decode([t]).encode() != tokenizer.token_bytes(t) for t in ids)


def test_token_bytes_of_pieces_spelled_each_way(llama, tmp_path):
    def piece(tok, name):
        return tok.token_bytes(tok._tok.token_to_id(name))

    assert piece(llama, "▁the") == b" the" and piece(llama, "<0xE2>") == b"\xe2" and piece(llama, "<s>") == b"<s>"
    make_tokenizer(tmp_path / "tokenizer.json")
    byte_level = Tokenizer(tmp_path / "tokenizer.json")
    assert piece(byte_level, "Ġthe") == b" the" and piece(byte_level, "Ã") == b"\xc3"
    assert piece(byte_level, "<|endoftext|>") == b"<|endoftext|>"


def test_token_bytes_of_other_tokenizers_are_their_decoded_text(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    tok = HFTokenizer(models.WordLevel({"[UNK]": 0, "naïve": 1, "▁x": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    word_level = Tokenizer(tmp_path / "tokenizer.json")
    assert [word_level.token_bytes(t) for t in range(3)] == [b"[UNK]", "naïve".encode(), "▁x".encode()]
