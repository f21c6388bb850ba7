"""generate / stream / generate_batch on the CPU engine."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch

import fastmamba
from fastmamba.io.tokenizer import IncrementalDecoder


@pytest.fixture(scope="module")
def lm(text_checkpoint):
    return fastmamba.load(text_checkpoint)


@pytest.fixture(scope="module")
def ids_lm(checkpoints):
    return fastmamba.load(checkpoints["untied_bias_rank"])


PROMPTS = ["To be, or not", "Ünïcödé wörds, naïve café and a much longer prompt to continue", "a"]


def test_deterministic_prefills_each_prompt_as_it_would_alone(checkpoints):
    """Deterministic mode: a batch's prefill gives each prompt bitwise its logits and state
    alone (the default prefills the prompts together, left-padded)."""
    lm = fastmamba.load(checkpoints["untied_bias_rank"], deterministic=True)
    prompts = [[5, 17, 3, 40], list(range(1, 30)), [7]]
    logits, state = lm.prefill(prompts)
    for i, ids in enumerate(prompts):
        alone, alone_state = lm.prefill([ids])
        assert torch.equal(logits[i], alone[0])
        assert torch.equal(state.conv[:, i], alone_state.conv[:, 0]) and torch.equal(state.ssm[:, i], alone_state.ssm[:, 0])


def test_generate_text_prompt(lm):
    g = lm.generate("To be, or not to be", max_tokens=12, stop_token_ids=[])
    assert len(g.token_ids) == 12 and g.finish_reason == "length"
    assert g.prompt_tokens == len(lm.tokenizer.encode("To be, or not to be"))
    assert g.text == lm.tokenizer.decode(g.token_ids)


def test_generate_equals_greedy_argmax_of_forward(ids_lm):
    prompt = [5, 17, 3, 40]
    g = ids_lm.generate(prompt, max_tokens=8, stop_token_ids=[])
    seq = list(prompt)
    for _ in range(8):
        seq.append(int(ids_lm.forward(torch.tensor([seq]))[0, -1].argmax()))
    assert g.token_ids == seq[len(prompt) :]


def test_stop_token_ends_generation_and_is_not_included(ids_lm):
    prompt = [5, 17, 3, 40]
    free = ids_lm.generate(prompt, max_tokens=10, stop_token_ids=[])
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    g = ids_lm.generate(prompt, max_tokens=10, stop_token_ids=[stop_at])
    assert g.token_ids == free.token_ids[:first] and g.finish_reason == "stop"


def test_default_stop_is_the_models_eos(ids_lm):
    prompt = [5, 17, 3, 40]
    free = ids_lm.generate(prompt, max_tokens=10, stop_token_ids=[])
    eos = ids_lm.config.eos_token_id
    expected = free.token_ids[: free.token_ids.index(eos)] if eos in free.token_ids else free.token_ids
    assert ids_lm.generate(prompt, max_tokens=10).token_ids == expected


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_every_eos_id_is_a_default_stop(ids_lm, checkpoints, tmp_path, where):
    """config.json's eos_token_id list whole, and generation_config.json's (an instruct model's
    end of turn): only the list's first id stopped a reply."""
    prompt = [5, 17, 3, 40]
    free = ids_lm.generate(prompt, max_tokens=10, stop_token_ids=[])
    eos = ids_lm.config.eos_token_id
    turn_end = next(t for t in free.token_ids[2:] if t != eos)
    folder = tmp_path / "m"
    shutil.copytree(checkpoints["untied_bias_rank"], folder)
    if where == "config.json":
        config = json.loads((folder / where).read_text())
        (folder / where).write_text(json.dumps({**config, "eos_token_id": [eos, turn_end]}))
    else:
        (folder / where).write_text(json.dumps({"eos_token_id": [turn_end], "temperature": 0.6}))
    lm = fastmamba.load(folder)
    assert lm.config.eos_token_id == eos and lm.config.default_stops == (eos, turn_end)
    end = min(free.token_ids.index(t) for t in (eos, turn_end) if t in free.token_ids)
    g = lm.generate(prompt, max_tokens=10)
    assert g.token_ids == free.token_ids[:end] and g.finish_reason == "stop"
    assert lm.generate(prompt, max_tokens=10, stop_token_ids=[]).token_ids == free.token_ids


def test_a_generation_config_is_checked(checkpoints, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(checkpoints["untied_bias_rank"], folder)
    for text, words in (("{", "cannot read generation_config.json"), ('{"eos_token_id": [1, "x"]}', "'eos_token_id'"),
                        ('{"eos_token_id": 1000000}', "outside the vocabulary")):
        (folder / "generation_config.json").write_text(text)
        with pytest.raises(fastmamba.CheckpointError, match=words) as e:
            fastmamba.load(folder)
        assert "generation_config.json" in str(e.value)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 5}, {"temperature": 1.2, "top_k": 5, "seed": 1}])
def test_stream_equals_generate(lm, sampling):
    pieces = list(lm.stream("To be, or not", max_tokens=30, stop_token_ids=[], **sampling))
    g = lm.generate("To be, or not", max_tokens=30, stop_token_ids=[], **sampling)
    assert [p.token_id for p in pieces if p.token_id is not None] == g.token_ids
    assert "".join(p.text for p in pieces) == g.text


def test_interleaved_streams_equal_separate_ones(lm):
    a = lm.stream("To be, or not", max_tokens=12, stop_token_ids=[], temperature=0.9, seed=1)
    b = lm.stream("naïve café", max_tokens=12, stop_token_ids=[])
    together = list(zip(a, b))
    assert [x.token_id for x, _ in together] == lm.generate(
        "To be, or not", max_tokens=12, stop_token_ids=[], temperature=0.9, seed=1
    ).token_ids
    assert [y.token_id for _, y in together] == lm.generate("naïve café", max_tokens=12, stop_token_ids=[]).token_ids


def test_streaming_never_splits_a_character(lm):
    text = "日本語のテキスト ✓ ★ naïve café"
    ids = lm.tokenizer.encode(text)
    assert any("\ufffd" in lm.tokenizer.decode([t]) for t in ids)  # some tokens are partial characters
    decoder = IncrementalDecoder(lm.tokenizer)
    pieces = [decoder.push(t) for t in ids] + [decoder.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_seeded_sampling_is_deterministic_and_seed_dependent(lm):
    a = lm.generate("To be", max_tokens=20, temperature=1.0, seed=123, stop_token_ids=[])
    b = lm.generate("To be", max_tokens=20, temperature=1.0, seed=123, stop_token_ids=[])
    c = lm.generate("To be", max_tokens=20, temperature=1.0, seed=124, stop_token_ids=[])
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_top_k_one_and_tiny_top_p_equal_greedy(lm):
    greedy = lm.generate("To be", max_tokens=16, stop_token_ids=[]).token_ids
    assert lm.generate("To be", max_tokens=16, temperature=1.5, top_k=1, seed=3, stop_token_ids=[]).token_ids == greedy
    assert lm.generate("To be", max_tokens=16, temperature=1.5, top_p=1e-9, seed=3, stop_token_ids=[]).token_ids == greedy


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batch_equals_alone(lm, temperature):
    params = [
        fastmamba.SamplingParams(max_tokens=9, temperature=temperature, seed=10, stop_token_ids=[]),
        fastmamba.SamplingParams(max_tokens=14, temperature=temperature, top_p=0.9, seed=11, stop_token_ids=[]),
        fastmamba.SamplingParams(max_tokens=5, temperature=temperature, repetition_penalty=1.3, seed=12),
    ]
    batch = lm.generate_batch(PROMPTS, params)
    alone = [lm.generate(p, params[i]) for i, p in enumerate(PROMPTS)]
    assert [g.token_ids for g in batch] == [g.token_ids for g in alone]
    assert [g.text for g in batch] == [g.text for g in alone]
    assert [len(g.token_ids) for g in batch][:2] == [9, 14]


def test_one_params_for_all_prompts(lm):
    outs = lm.generate_batch(PROMPTS[:2], fastmamba.SamplingParams(max_tokens=4, stop_token_ids=[]))
    assert [len(g.token_ids) for g in outs] == [4, 4]


def test_text_prompt_without_tokenizer_is_a_clear_error(ids_lm):
    with pytest.raises(ValueError, match="tokenizer"):
        ids_lm.generate("hello")
    assert ids_lm.generate([1, 2, 3], max_tokens=3, stop_token_ids=[]).text is None


@pytest.mark.parametrize("prompt", [[], [1, 10**6], [1, -1], "x" * 0])
def test_bad_prompts(ids_lm, prompt):
    with pytest.raises(ValueError):
        ids_lm.generate(prompt)


def test_bad_batch_arguments(lm):
    with pytest.raises(ValueError, match="params"):
        lm.generate_batch(["a", "b"], [fastmamba.SamplingParams()])
    with pytest.raises(ValueError, match="prompts"):
        lm.generate_batch("a single string")
    with pytest.raises(ValueError, match="temperature"):
        lm.generate("a", temperature=-1)


def test_state_is_usable_as_a_recurrent_core(ids_lm):
    """The backbone alone (vectors in, vectors out) step by step equals it over a sequence."""
    model = ids_lm.model
    x = torch.randn(2, 6, ids_lm.config.d_model, generator=torch.Generator().manual_seed(0))
    whole = model.backbone(x, model.new_state(2))
    state = model.new_state(2)
    steps = torch.cat([model.backbone(x[:, t : t + 1], state) for t in range(6)], 1)
    assert torch.allclose(steps, whole, rtol=1e-4, atol=1e-5)


def test_ctrl_c_inside_a_step_leaves_another_generation_as_it_is_alone(monkeypatch):
    """A step advances every running generation's state in place: Ctrl-C landing inside one
    that generation A runs left stream B a token ahead of its outputs (wrong tokens from
    there). The step now ends before the KeyboardInterrupt is raised, in A. (The bundled
    model: a random one's greedy tokens repeat, which would hide the shift.)"""
    lm = fastmamba.load()
    prompt = "To be, or not"
    alone = lm.generate(prompt, max_tokens=30, stop_token_ids=[]).token_ids
    b = lm.stream(prompt, max_tokens=30, stop_token_ids=[])
    got = [next(b).token_id for _ in range(5)]
    step, calls = lm.model.step, [0]

    def step_then_ctrl_c(*args, **kwargs):
        out = step(*args, **kwargs)
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # (raised at the next bytecode, inside the step)
        return out

    monkeypatch.setattr(lm.model, "step", step_then_ctrl_c)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a test runner may ignore SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in lm.stream("a", max_tokens=1000, stop_token_ids=[]):
                pass
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    got += [p.token_id for p in b if p.token_id is not None]
    assert calls[0] >= 3 and got == alone


def test_a_batch_past_the_memory_takes_the_slots_it_holds(ids_lm, monkeypatch):
    """generate_batch's engine took a power of two of slots at least the batch, whatever the
    memory (1000 prompts of Mamba-2 2.7b: ~177 GB of states); now at most what half the free
    memory holds, the rest of the batch waiting for free slots, each prompt as alone."""
    from fastmamba.engine import language_model, memory

    lm = language_model.LanguageModel(ids_lm.model, None)
    slot = memory.slot_bytes(lm.model)
    # (room for 6 slots, less what the engine holds: free memory as the device counts it)
    monkeypatch.setattr(memory, "_free_bytes", lambda device: 2 * 6 * slot - slot * (
        lm._client.max_batch if lm._client is not None else 0))
    prompts = [[5 + k, 17, 3] for k in range(20)]
    out = lm.generate_batch(prompts, {"max_tokens": 6, "stop_token_ids": []})
    engine = lm._client
    assert engine.max_batch == 4  # (6 fit: the power of two below)
    assert lm.generate_batch(prompts, {"max_tokens": 6, "stop_token_ids": []}) == out
    assert lm._client is engine  # (it was made anew at every call: the batch was past its size)
    for k in (0, 7, 19):
        assert out[k].token_ids == ids_lm.generate(prompts[k], max_tokens=6, stop_token_ids=[]).token_ids


def test_a_bad_prompt_of_a_batch_is_named_by_its_index(ids_lm):
    V = ids_lm.config.vocab_size
    for bad, words in (([V], f"token id {V}"), ([], "empty"), (b"x", "decode bytes")):
        with pytest.raises(ValueError, match=r"^prompts\[2\]: .*" + words):
            ids_lm.generate_batch([[1, 2], [3], bad, [4]], {"max_tokens": 2})
