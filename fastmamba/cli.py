"""The `fastmamba` command."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastmamba",
        description="Inference engine for Mamba state-space language models.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"fastmamba {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = commands.add_parser(
        "generate",
        help="continue a prompt, streaming the text to stdout",
        description="Continue PROMPT with a Mamba model, streaming the text to stdout as it is produced.",
    )
    gen.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    gen.add_argument("--model", metavar="DIR|ORG/NAME", help="checkpoint folder (HF or original format) or a HuggingFace hub id org/name; default: the bundled model")
    gen.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    gen.add_argument("--dtype", default="float32", help="storage of the weights: float32, bfloat16/bf16, float16/fp16")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), higher = more random")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (0 = off)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style penalty (1.0 = off)")
    gen.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    bench = commands.add_parser(
        "bench",
        help="time GPU decode at the public model shapes (random weights)",
        description="Time the GPU decode step at the public Mamba shapes with random weights: "
        "ms/token, tokens/s and the fraction of the memory floor.",
    )
    from .bench import add_arguments

    add_arguments(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "bench":
            from .bench import main_from_args

            return main_from_args(args)
        return _generate(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        # One short line naming the culprit; the library's messages already do.
        print(f"fastmamba: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except Exception as e:  # anything unforeseen still ends as one line, not a traceback
        print(f"fastmamba: error: {type(e).__name__}: {_one_line(str(e))}", file=sys.stderr)
        return 2


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _generate(args) -> int:
    import fastmamba

    params = fastmamba.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    if args.model is None and not (fastmamba.default_model_dir() / "config.json").exists():
        raise ValueError("no bundled model in this install: pass --model DIR")
    lm = fastmamba.load(args.model, device=args.device, dtype=args.dtype)
    out = sys.stdout
    for piece in lm.stream(args.prompt, params):
        out.write(piece.text or "")
        out.flush()
    out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
