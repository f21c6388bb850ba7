"""The `fastmamba` command.

Its promise: output on stdout, and any error as one line on stderr with exit code 2; Ctrl-C
exits 130 and a closed or broken stdout 141 (as SIGPIPE would), both without a word. The
console script enters through `fastmamba.__main__`, which makes Ctrl-C end the process at
once from its first moment; the heavy imports (PyTorch) happen inside `main`.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

from fastmamba.engine.options import EngineOptions, flag
from fastmamba.serve.options import ServeOptions

EXIT_ERROR, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 2, 130, 141


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as the one line every other error is (`--help` stays full)."""

    def error(self, message: str):
        raise _UsageError(f"{message} (see {self.prog} --help)")


class _UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    from fastmamba import __version__

    parser = _Parser(prog="fastmamba", description="Inference engine for Mamba state-space language models.")
    parser.add_argument("--version", action="version", version=f"fastmamba {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    gen = commands.add_parser(
        "generate",
        help="continue a prompt, streaming the text to stdout",
        description="Continue PROMPT with a Mamba model, streaming the text to stdout as it is produced.",
    )
    gen.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    add_options(gen, EngineOptions, EngineOptions.MODEL_FIELDS)
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), higher = more random")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (0 = off)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style penalty (1.0 = off)")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="OpenAI's: subtracted from a token's logit once it is in the output, -2 to 2 (0 = off)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="OpenAI's: subtracted from a token's logit once for each time it is in the output, -2 to 2 "
                          "(0 = off)")
    gen.add_argument("--seed", type=int, default=None, help="random seed for sampling, 0 to 2^32-1 (default: random)")
    srv = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve a Mamba model over an OpenAI-compatible HTTP API (completions, chat, streaming), "
        "with continuous batching over state slots and a prefix state cache.",
    )
    add_options(srv, EngineOptions)
    add_options(srv, ServeOptions)
    bench = commands.add_parser(
        "bench",
        help="time GPU decode at the public model shapes (random weights)",
        description="Time the GPU decode step at the public Mamba shapes with random weights: "
        "ms/token, tokens/s and the fraction of the memory floor.",
    )
    add_bench_arguments(bench)
    return parser


def add_options(ap: argparse.ArgumentParser, options, names=None) -> None:
    """The flags of an options dataclass's fields (all, or `names`): --field-name, typed by
    the field, its help and argparse settings from the field's metadata, its default the
    field's (so that a flag not given leaves the field's default)."""
    for f in fields(options):
        if f.name == "engine" or (names is not None and f.name not in names):
            continue
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        if f.type == "bool":
            ap.add_argument(flag(f.name), action="store_true", help=help_text)
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
        ap.add_argument(flag(f.name), type=kind, default=f.default, help=help_text, **meta)


def add_bench_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", default="130m,370m,1.4b,2.8b", help="comma-separated public shapes")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--hf", action="store_true", help="also time transformers' MambaForCausalLM (batch 1)")
    ap.add_argument("--deterministic", action="store_true", help="the batch-invariant step (load(deterministic=True))")
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the dtype the recurrent state is stored in (load(state_dtype=...))")
    ap.add_argument("--json", help="write the results here")


def main(argv: list[str] | None = None) -> int:
    try:
        parser = _parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_usage(sys.stderr)
            print("fastmamba: error: a command is required: generate, serve or bench (see fastmamba --help)",
                  file=sys.stderr)
            return EXIT_ERROR
        if args.command == "bench":
            from fastmamba.bench import main_from_args

            return main_from_args(args)
        if args.command == "serve":
            from fastmamba.serve.main import serve

            return serve(ServeOptions.from_namespace(args))
        return _generate(args, EngineOptions(**{name: getattr(args, name) for name in EngineOptions.MODEL_FIELDS}))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return _stdout_gone()
    except _UsageError as e:
        return _fail(str(e))
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        return _fail(str(e))  # the library's messages already name the culprit
    except Exception as e:  # anything unforeseen still ends as one line, not a traceback
        return _fail(f"{type(e).__name__}: {e}")


def _fail(message: str) -> int:
    if sys.stderr is not None:
        print(f"fastmamba: error: {' '.join(message.split())}", file=sys.stderr)
    return EXIT_ERROR


def _stdout_gone() -> int:
    """The reader of stdout went away: end quietly, and keep Python's exit-time flush of
    stdout from raising again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, AttributeError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


def _prompt_text(prompt: str) -> str:
    """The prompt as text; bytes that are not UTF-8 reach argv as lone surrogates."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(prompt)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"PROMPT is not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start})") from None
        raise ValueError("PROMPT holds characters that are not valid text (lone surrogates)") from None
    return prompt


def _generate(args, options: EngineOptions) -> int:
    if sys.stdout is None:  # started with stdout closed: nowhere to write the text
        return EXIT_BROKEN_PIPE
    prompt = _prompt_text(args.prompt)

    import fastmamba

    try:
        params = fastmamba.SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            seed=args.seed,
        )
    except ValueError as e:  # "SamplingParams.max_tokens must be ...": name the flag the user gave
        field, _, rest = str(e).removeprefix("SamplingParams.").partition(" ")
        raise ValueError(f"{flag(field)} {rest}") from None
    if options.model is None and not (fastmamba.default_model_dir() / "config.json").exists():
        raise ValueError("no bundled model in this install: pass --model DIR")
    lm = fastmamba.load(**options.load_kwargs())
    if lm.tokenizer is None:
        raise ValueError(f"the model in {lm.path} has no tokenizer.json: give --model a folder with one")
    out = sys.stdout
    for piece in lm.stream(prompt, params):
        out.write(piece.text or "")
        out.flush()
    out.write("\n")
    out.flush()
    return 0


if __name__ == "__main__":  # `python -m fastmamba.cli`: the command's own entry, with its Ctrl-C handler
    from fastmamba.interrupts import end_quietly_on_ctrl_c

    end_quietly_on_ctrl_c()
    sys.exit(main())
