"""Prefill benchmark: tokens/s of the Triton prefill at public shapes (random weights, bf16,
or each of --dtypes: fp8 runs its products through cuBLASLt's FP8 GEMM, kernels/fp8_gemm.py),
time to first token through `generate` / `generate_batch` (1 x 128, 1 x 2048, 1 x 8192,
8 x 2048: graph-captured prefill where cuda_graphs.graph_prefill_tokens says), and peak memory of a 100k-token prompt;
with --hf, transformers' forward over the same 1 x 8192 prompt for a ratio.

With --host, only whether eager prefill is host-bound, at each of --shapes: the eager
prefill's wall time, the host's time to issue it (launched behind a long GPU sleep, so
that no launch waits on the GPU), and the same prefill replayed as a CUDA graph
(cuda_graphs.GraphPrefill).

    python -m benchmarks.prefill --models 130m,2.8b,falcon-7b [--hf] --json prefill.json
    python -m benchmarks.prefill --host --models 130m,2.8b
    python -m benchmarks.prefill --models 2.8b --dtypes bfloat16,fp8 --shapes 1x8192,8x2048
"""

import argparse
import json
import time
from pathlib import Path

import torch

from fastmamba.bench import SHAPES, hf_model, prefill_ms, random_model, wall_ms
from fastmamba.engine.language_model import LanguageModel


def issue_ms(fn) -> float:
    """Host time to issue fn's launches while the GPU is busy with a long sleep."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles ahead of the launches
    t = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return ms


def host_rows(model, size: str, shapes, emit) -> None:
    """--host: eager prefill (wall, host issue) against a CUDA graph of it, at each shape."""
    from fastmamba.engine.cuda_graphs import GraphPrefill

    for B, T in shapes:
        ids = torch.randint(0, model.config.vocab_size, (B, T), device="cuda")
        start = torch.zeros(B, dtype=torch.int32, device="cuda")

        def eager():
            return model.prefill(ids, model.new_state(B), last_only=True)

        host, wall = issue_ms(eager), wall_ms(eager, 5)
        t = time.perf_counter()
        graph = GraphPrefill(model, B, T)
        capture = (time.perf_counter() - t) * 1e3
        replay = wall_ms(lambda: graph(ids, start), 5)
        emit(dict(model=size, batch=B, tokens=T, eager_ms=round(wall, 2), host_issue_ms=round(host, 2),
                  graph_ms=round(replay, 2), capture_ms=round(capture)),
             f"{size:>5} {B}x{T}: eager {wall:7.2f} ms (host issue {host:6.2f}), graph {replay:7.2f} ms "
             f"(capture {capture:.0f} ms)")
        graph = None  # free its pool before the next shape
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--long", type=int, default=100_000, help="tokens of the long-prompt run on 130m")
    ap.add_argument("--models", default="130m,2.8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--shapes", default="1x2048,1x8192,8x2048", help="prefills timed alone, BATCHxTOKENS")
    ap.add_argument("--dtypes", default="bfloat16", help="weights' storage dtypes, comma-separated (bfloat16, fp8, ...)")
    ap.add_argument("--hf", action="store_true", help="also time transformers' forward at 1 x 8192")
    ap.add_argument("--host", action="store_true", help="only eager against a CUDA graph, and the host's issue time")
    args = ap.parse_args()
    from fastmamba.core.dtypes import parse_dtype

    dtypes = [parse_dtype(d) for d in args.dtypes.split(",")]
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    rows = []

    def emit(row: dict, line: str) -> None:
        rows.append(row)
        print(line, flush=True)

    print(f"device: {torch.cuda.get_device_name()}")
    if not args.host:
        print(f"{'model':>6} {'dtype':>13} {'shape':>8} {'ms':>9} {'tokens/s':>10} {'peak GiB':>8}")
    for size, dtype in [(s, d) for s in args.models.split(",") for d in dtypes]:
        model = random_model(size, dtype)
        dt = str(dtype).removeprefix("torch.")
        V = model.config.vocab_size
        if args.host:
            host_rows(model, size, shapes, emit)
            model = None
            torch.cuda.empty_cache()
            continue
        for B, T in shapes:
            torch.cuda.reset_peak_memory_stats()
            ms = prefill_ms(model, B, T)
            row = dict(model=size, dtype=dt, batch=B, tokens=T, ms=round(ms, 2), tokens_per_s=round(B * T / ms * 1e3),
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
            emit(row, f"{size:>6} {dt:>13} {B:>3}x{T:<5} {row['ms']:9.2f} {row['tokens_per_s']:10,} {row['peak_gib']:8.2f}")
        if args.hf and dtype == torch.bfloat16:
            hf = hf_model(model.config, torch.bfloat16)
            ids = torch.randint(0, V, (1, 8192), device="cuda")
            with torch.inference_mode():
                ms = wall_ms(lambda: hf(ids, use_cache=False).logits[:, -1], repeat=1)
            emit(dict(model=size, batch=1, tokens=8192, hf_ms=round(ms, 1)), f"{size:>6} transformers, 1x8192: {ms:.0f} ms")
            hf = None
            torch.cuda.empty_cache()
        # Time to first token: a prompt in, the first token's id back on the host, through
        # the public generation path (its graph-captured prefill), against the eager prefill.
        lm = LanguageModel(model, None, engine="triton")
        for B, n in ((1, 128), (1, 2048), (1, 8192), (8, 2048)):
            prompts = torch.randint(0, V, (B, n)).tolist()
            one = dict(max_tokens=1, stop_token_ids=[])
            ttft = wall_ms(lambda: lm.generate(prompts[0], **one) if B == 1 else lm.generate_batch(prompts, one), repeat=10)
            eager = wall_ms(lambda: model.prefill(torch.tensor(prompts, device="cuda"), model.new_state(B), last_only=True).argmax(-1).tolist(), repeat=10)
            emit(dict(model=size, dtype=dt, batch=B, prompt_tokens=n, ttft_ms=round(ttft, 3), eager_prefill_ms=round(eager, 3)),
                 f"{size:>6} {dt} time to first token, {B} x {n}-token prompt{'s' if B > 1 else ''}: {ttft:.2f} ms "
                 f"(eager prefill, no graph: {eager:.2f} ms)")
        if size == "130m":
            torch.cuda.reset_peak_memory_stats()
            ms = prefill_ms(model, 1, args.long, repeat=1)
            peak = torch.cuda.max_memory_allocated() / 2**30
            emit(dict(model=size, dtype=dt, long_tokens=args.long, ms=round(ms, 1), peak_gib=round(peak, 2)),
                 f"{size:>6} {dt} {args.long:,}-token prompt: {ms:.0f} ms, peak {peak:.2f} GiB (chunks of {model.chunk_tokens} tokens)")
        model = lm = None  # free the weights and graphs before the next size
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=2))


if __name__ == "__main__":
    main()
