"""Fixtures: tiny random Mamba checkpoints written by transformers, and a tiny tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Kernel tests run the Triton kernels through the interpreter on machines without CUDA;
# the variable must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import install

    install()


CORPUS = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles. "
    "Ünïcödé wörds, naïve café, 日本語のテキスト, emoji ✓ ★ and more text to merge. "
) * 4


def gpu_available() -> bool:
    return torch.cuda.is_available()


def make_tokenizer(path: Path, vocab_size: int = 300) -> int:
    """Trains a byte-level BPE on a small corpus; eos '<|endoftext|>' is id 0. Returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(str(path))
    return tok.get_vocab_size()


def make_llama_tokenizer(path: Path, vocab_size: int = 150) -> int:
    """A Llama-style SentencePiece BPE, as tokenizer.json has it: '▁' for spaces (one put
    before the text), byte-fallback tokens '<0x00>'..'<0xFF>' for characters it has no
    token for, a decoder that strips the text's first space; '<unk>' 0, '<s>' 1, '</s>' 2.
    Returns its size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=60, show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # (the trainer makes none: they go after its tokens)
        vocab[f"<0x{b:02X}>"] = len(vocab)
    path.write_text(json.dumps(spec, ensure_ascii=False))
    return len(vocab)


@pytest.fixture(scope="session")
def byte_level(tmp_path_factory):
    """make_tokenizer's tokenizer (byte-level BPE), loaded."""
    from fastmamba.io.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("byte_level") / "tokenizer.json"
    make_tokenizer(path)
    return Tokenizer(path)


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    """make_llama_tokenizer's tokenizer (SentencePiece-style), loaded."""
    from fastmamba.io.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("llama") / "tokenizer.json"
    make_llama_tokenizer(path)
    return Tokenizer(path)


HF_CONFIGS = {
    # name: MambaConfig overrides (the tiny sizes are shared below)
    "odd_vocab_tied": dict(vocab_size=101),
    "untied_bias_rank": dict(
        vocab_size=97, tie_word_embeddings=False, use_bias=True, use_conv_bias=False, time_step_rank=3
    ),
    "kernel3_state8": dict(vocab_size=64, conv_kernel=3, state_size=8, expand=3),
    "kernel2_state4_wide": dict(vocab_size=50, hidden_size=24, conv_kernel=2, state_size=4, num_hidden_layers=3),
}


def save_hf_checkpoint(folder: Path, seed: int = 0, tokenizer=False, falcon: bool = False, **overrides) -> Path:
    """A random HF MambaForCausalLM (FalconMambaForCausalLM with `falcon`) at tiny sizes,
    saved with save_pretrained; `tokenizer`: True for make_tokenizer's, or a function of
    its signature."""
    if falcon:
        from transformers import FalconMambaConfig as MambaConfig
        from transformers import FalconMambaForCausalLM as MambaForCausalLM
    else:
        from transformers import MambaConfig, MambaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    args = dict(hidden_size=16, num_hidden_layers=2, state_size=16, vocab_size=101)
    if tokenizer:
        args["vocab_size"] = (make_tokenizer if tokenizer is True else tokenizer)(folder / "tokenizer.json")
    args.update(overrides)
    save_kwargs = args.pop("save_kwargs", {})
    torch.manual_seed(seed)
    model = MambaForCausalLM(MambaConfig(**args))
    _spread_parameters(model, seed)
    model.save_pretrained(str(folder), **save_kwargs)
    return folder


def _spread_parameters(model, seed: int) -> None:
    """Gives every parameter random values of a realistic spread.

    transformers' init leaves some at constants (norms at 1, D at 1, biases at 0), which
    would hide a bias or norm weight read from the wrong place.
    """
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight")) or name.endswith("mixer.D"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias") and "dt_proj" not in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def save_original_checkpoint(folder: Path, vocab: int = 98, multiple: int = 8, seed: int = 3) -> tuple[Path, Path]:
    """An original state-spaces checkpoint (pytorch_model.bin, padded vocab, repeated lm_head),
    and the HF checkpoint holding the same weights, as the reference to compare against."""
    padded = -(-vocab // multiple) * multiple
    hf_dir = save_hf_checkpoint(folder / "hf", seed=seed, vocab_size=padded, conv_kernel=4, state_size=16)
    from safetensors.torch import load_file

    sd = load_file(str(hf_dir / "model.safetensors"))
    orig = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in sd.items()}
    orig["lm_head.weight"] = orig["backbone.embedding.weight"]  # as torch.save of a tied model writes it
    out = folder / "original"
    out.mkdir(parents=True)
    torch.save(orig, out / "pytorch_model.bin")
    cfg = dict(
        d_model=16,
        n_layer=2,
        vocab_size=vocab,
        ssm_cfg={},
        rms_norm=True,
        residual_in_fp32=True,
        fused_add_norm=True,
        pad_vocab_size_multiple=multiple,
        tie_embeddings=True,
    )
    (out / "config.json").write_text(json.dumps(cfg))
    return out, hf_dir


FALCON_CONFIGS = {
    # Falcon-Mamba: x_proj's dt_r, B and C RMS-normalised (eps mixer_rms_eps)
    "falcon_tied": dict(vocab_size=101, mixer_rms_eps=1e-6),
    "falcon_untied_rank": dict(
        vocab_size=97, tie_word_embeddings=False, time_step_rank=5, use_bias=True, mixer_rms_eps=1e-5
    ),
    "falcon_wide_state8": dict(vocab_size=64, hidden_size=24, state_size=8, conv_kernel=3, mixer_rms_eps=1e-5),
}


@pytest.fixture(scope="session")
def falcon_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("falcon")
    return {
        name: save_hf_checkpoint(root / name, seed=20 + i, falcon=True, **cfg)
        for i, (name, cfg) in enumerate(FALCON_CONFIGS.items())
    }


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: save_hf_checkpoint(root / name, seed=i, **cfg) for i, (name, cfg) in enumerate(HF_CONFIGS.items())}


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory) -> Path:
    """A tiny random model with a tokenizer.json, for text prompts and streaming."""
    return save_hf_checkpoint(tmp_path_factory.mktemp("text") / "m", seed=11, tokenizer=True)


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |a - ref| over the largest |ref|; a must be finite."""
    assert torch.isfinite(a).all()
    ref = ref.float().cpu()
    return ((a.float().cpu() - ref).abs().max() / ref.abs().max()).item()


def backbone_sequence(B: int, T: int, input_dim: int = 6, width: int = 16):
    """A Backbone sequence pass's seeded inputs on the CPU: x (B, T, input_dim), resets (B, T)
    (about one step in ten, and row 0's first), and weights of its (B, T, width) outputs."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, input_dim, generator=g)
    resets = torch.rand(B, T, generator=g) < 0.1
    resets[0, 0] = True
    return x, resets, torch.randn(B, T, width, generator=g)


def outputs_and_grads(fn, inputs, weights):
    """fn's outputs (detached) and the gradients of sum(out * weight) over them, for each
    input (None where one takes none): ([outputs], [gradients])."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = fn(*leaves)
    sum(((o * w.to(o)).sum() for o, w in zip(outs, weights))).backward()
    return [o.detach() for o in outs], [t.grad for t in leaves]


def transformers_logits(path: Path, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' own model of the checkpoint at `path`, in `dtype` on the CPU: the
    logits of ids (B, T), float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    with torch.no_grad():
        return model(ids.cpu()).logits.float()


def assert_within_transformers_16bit_error(logits: torch.Tensor, path: Path, ids: torch.Tensor, dtype,
                                          bound: float = 1.25) -> None:
    """The accuracy bar for 16-bit storage (docs/architecture.md): logits of ids (B, T)
    finite, and against transformers' float32 model at most `bound` (1.25) times the error
    of transformers' own model in that dtype on the same inputs."""
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype, dtype)
    ref = transformers_logits(path, ids)
    ours, theirs = relative_error(logits, ref), relative_error(transformers_logits(path, ids, dtype), ref)
    assert ours <= bound * theirs, f"error {ours:.3g} against transformers' float32; its {dtype} model's {theirs:.3g}"


@pytest.fixture(scope="session")
def hf_models(checkpoints):
    from transformers import MambaForCausalLM

    return {name: MambaForCausalLM.from_pretrained(str(p)).eval() for name, p in checkpoints.items()}


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
