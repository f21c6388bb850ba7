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
    _model_arguments(gen)
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), higher = more random")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (0 = off)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style penalty (1.0 = off)")
    gen.add_argument("--seed", type=int, default=None, help="random seed for sampling, 0 to 2^32-1 (default: random)")
    _engine_arguments(gen)
    srv = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve a Mamba model over an OpenAI-compatible HTTP API (completions, chat, streaming), "
        "with continuous batching over state slots and a prefix state cache.",
    )
    _model_arguments(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    srv.add_argument("--served-model-name", metavar="NAME", help="the model's name in the API (default: --model)")
    srv.add_argument("--max-batch", type=int, default=None,
                     help="state slots: requests decoded together (default: 16 on the CPU; on a GPU as many as "
                     "its free memory holds, at most 256)")
    srv.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a slot; more get 429 (default: 256)")
    srv.add_argument("--max-model-len", type=int, default=32768,
                     help="prompt + max_tokens of one request, at most; a request over it gets a 400 (default: 32768)")
    srv.add_argument("--prefill-tokens", type=int, default=4096,
                     help="prompt tokens prefilled per engine step at most: more gives throughput, fewer keeps "
                     "the running streams' pace behind new prompts (default: 4096)")
    srv.add_argument("--prefix-cache-mb", type=int, default=256, help="memory for cached prefix states, MiB; 0 = off (default: 256)")
    srv.add_argument("--replicas", type=int, default=0,
                     help="run N engine replicas on Ray Serve (one GPU each on CUDA), requests routed by prefix; "
                     "needs pip install 'fastmamba[ray]' (default: 0, one engine without Ray)")
    srv.add_argument("--autoscale", metavar="MIN:MAX",
                     help="with Ray Serve: between MIN and MAX replicas as the load asks (in place of --replicas)")
    srv.add_argument("--stream-interval-ms", type=float, default=None,
                     help="with Ray Serve: a replica sends each stream's new tokens on every this many ms, in "
                     "one message (each message costs Ray a fixed time); 0 = each token at once (default: 50)")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (not on /health)")
    srv.add_argument("--max-body-mb", type=float, default=8,
                     help="largest request body, MiB; a larger one gets a 413 before it is read (default: 8)")
    srv.add_argument("--shutdown-timeout", type=float, default=10,
                     help="on SIGTERM or Ctrl-C, seconds to let running requests finish before they are "
                     "cancelled and the server exits (default: 10)")
    _engine_arguments(srv)
    bench = commands.add_parser(
        "bench",
        help="time GPU decode at the public model shapes (random weights)",
        description="Time the GPU decode step at the public Mamba shapes with random weights: "
        "ms/token, tokens/s and the fraction of the memory floor.",
    )
    add_bench_arguments(bench)
    return parser


def _model_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags that choose the model and where it runs (generate and serve)."""
    ap.add_argument("--model", metavar="DIR|ORG/NAME",
                    help="checkpoint folder (HF or original format) or a HuggingFace hub id; default: the bundled model")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    ap.add_argument("--dtype", default="float32", help="storage of the weights: float32, bfloat16/bf16, float16/fp16")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for PyTorch (default: 1, which does not collapse beside a busy neighbour)")


def check_serve_flags(args) -> None:
    """serve's numeric flags in their ranges, before anything loads (the one-line error names the flag)."""
    for flag in ("max_queue", "max_model_len", "prefill_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.replicas < 0:
        raise ValueError(f"--replicas must be at least 0, got {args.replicas}")
    if args.stream_interval_ms is not None and not 0 <= args.stream_interval_ms <= 10_000:
        raise ValueError(f"--stream-interval-ms must be from 0 to 10000, got {args.stream_interval_ms}")
    if args.max_batch is not None and args.max_batch < 1:
        raise ValueError(f"--max-batch must be at least 1, got {args.max_batch}")
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be from 1 to 65535, got {args.port}")
    if args.prefix_cache_mb < 0:
        raise ValueError(f"--prefix-cache-mb must be at least 0, got {args.prefix_cache_mb}")
    if not 0 < args.max_body_mb <= 4096:
        raise ValueError(f"--max-body-mb must be above 0 and at most 4096, got {args.max_body_mb:g}")
    if not 0 <= args.shutdown_timeout <= 3600:
        raise ValueError(f"--shutdown-timeout must be from 0 to 3600 seconds, got {args.shutdown_timeout:g}")


def _engine_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags that choose how the engine computes (generate and serve)."""
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="storage of the recurrent state (bfloat16: half the memory and a faster large-batch "
                    "step on the GPU, at an accuracy cost that grows with the tokens; default: float32)")
    ap.add_argument("--deterministic", action="store_true",
                    help="GPU: a sequence's logits bitwise the same whatever else runs beside it "
                    "(load(deterministic=True)); no effect on the CPU, which is deterministic already")


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
        if args.model is not None and not args.model.strip():
            raise ValueError("--model is empty: give a checkpoint folder or a hub id org/name")
        cores = os.cpu_count() or 1
        if args.threads is not None and not 1 <= args.threads <= cores:
            raise ValueError(f"--threads must be from 1 to {cores} (this machine's cores), got {args.threads}")
        if args.command == "serve":
            check_serve_flags(args)
            from fastmamba.serve.app import serve

            return serve(args)
        return _generate(args)
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


def _generate(args) -> int:
    if sys.stdout is None:  # started with stdout closed: nowhere to write the text
        return EXIT_BROKEN_PIPE
    prompt = _prompt_text(args.prompt)

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
    lm = fastmamba.load(args.model, device=args.device, dtype=args.dtype, threads=args.threads,
                        state_dtype=args.state_dtype, deterministic=args.deterministic)
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
