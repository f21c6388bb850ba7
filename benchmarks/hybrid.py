"""Hybrid models (Mamba-2 + attention + MLP or experts) at a public shape with random weights,
bf16, on the engine fastmamba.load gives them on the GPU (the GPU engine; the reference engine,
pure PyTorch, where the layer table says the GPU engine does not run a kind):
the engine's decode step at batch 1 / 32 / 128 over contexts of --context tokens (wall ms a
step, sampling and the host's bookkeeping included, against the floor: weights (of experts,
those the rows pick), recurrent states and the contexts' keys and values read once) with the
state in each of --state-dtypes, a --long prompt (32768 tokens) through the engine (its first
token, its step, the memory it held at the peak), prefill (--prefills: 1 x 8192 and 8 x 2048), and transformers'
`generate` at batch 1 over the same random model in the same run.

    python -m benchmarks.hybrid --shape nemotron-h-8b --state-dtypes float32,bfloat16 --json hybrid.json
    python -m benchmarks.hybrid --shape granite-4.0-h-tiny --batches 1,8,64 --prefills 1x4096 --json granite.json
    python -m benchmarks.hybrid --shape nemotron-h-tiny --device cpu --no-hf   # a smoke run

(nemotron-3-nano-30b-a3b: 63 GB of bf16 weights, and its experts, stored one by one, are
stacked at load, about 120 GB at the peak: an H200.)
"""

import argparse
import ast
import itertools
import json
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from fastmamba.bench import HYBRID_SHAPES, _random_tensors, copy_bandwidth
from fastmamba.core.config import MambaConfig
from fastmamba.core.dtypes import parse_state_dtype
from fastmamba.core.kv_cache import bytes_per_token
from fastmamba.core.layers import off_gpu_engine
from fastmamba.core.model import Mamba
from fastmamba.core.moe import MoEWeights
from fastmamba.core.ops import REFERENCE_OPS, triton_ops
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine.engine_core import EngineCore
from fastmamba.engine.language_model import LanguageModel
from fastmamba.engine.plan import KERNEL_TILES, LAYER_OPS, DecodePlan, one_row_blocks
from fastmamba.engine.protocol import Failed, Finished, Request, Token
from fastmamba.io.checkpoint import build_weights


def cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def gpu_engine(c: MambaConfig) -> bool:
    """Whether the GPU engine runs every sublayer kind of the model (the layer table's say, as
    fastmamba.load reads it); else it runs on the reference engine on the GPU too."""
    return not off_gpu_engine(c)


def engine(model: Mamba) -> str:
    return "reference" if model.ops is REFERENCE_OPS else "triton"


def model_of(shape: str, device: str) -> tuple[Mamba, dict]:
    raw = HYBRID_SHAPES[shape]
    c = MambaConfig.from_dict(raw, shape)
    dtype = torch.bfloat16 if cuda(device) else torch.float32
    tensors = _random_tensors(c, device, dtype)
    weights = build_weights(c, tensors, dict.fromkeys(tensors, "random"), device, dtype)
    del tensors
    empty_cache()
    return Mamba(c, weights, triton_ops(KERNEL_TILES) if cuda(device) and gpu_engine(c) else REFERENCE_OPS), raw


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synced(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def floor_ms(model: Mamba, batch: int, context: int, bandwidth: float) -> float:
    """The step's floor: its weights (of a mixture of experts, those the rows pick: E (1 - (1 -
    k / E)^B) experts of E, expected under uniform routing, as random weights route), every
    row's recurrent state read and written and its context's keys and values read, at the
    copy bandwidth."""
    w, c = model.weights, model.config
    tensors = [w.embedding if w.lm_head is w.embedding else w.lm_head, w.norm_f]
    tensors += [t for lw in w.layers for t in _tensors(lw)]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    if c.n_experts:
        unpicked = (1 - c.experts_per_token / c.n_experts) ** batch  # (an expert no row picks)
        weights -= unpicked * sum(t.numel() * t.element_size() for lw in w.layers if isinstance(lw, MoEWeights)
                                  for t in (lw.in_w, lw.out_w))
    state = model.new_state(1)
    per_row = 2 * (state.conv.numel() + state.ssm.numel()) * state.conv.element_size()
    kv = bytes_per_token(c, w.embedding.element_size()) * context  # every context's keys and values read
    return (weights + batch * (per_row + kv)) / bandwidth * 1e3


def _tensors(obj):
    for v in vars(obj).values():
        if isinstance(v, torch.Tensor):
            yield v
        elif hasattr(v, "__dict__"):
            yield from _tensors(v)


def decode_ms(model: Mamba, batch: int, context: int, steps: int, plan=None, prefill_tokens: int = 8192) -> float:
    """Wall ms of an engine step once `batch` requests with `context`-token prompts decode
    (plan: the decode plan, engine/plan.py's; None: the table's)."""
    # The first rows decode a token a step while the others prefill: their outputs outlast
    # the prefill's steps (128 rows of 16k tokens: 256 of them), then the warm-up and the timing.
    out = -(-batch * context // prefill_tokens) + 3 * steps + 32
    lm = LanguageModel(model, None, engine=engine(model))
    core = EngineCore(model, lm.prefill, max_batch=batch, prefill_tokens=prefill_tokens,
                      kv_tokens=batch * (context + out + 64), decode_plan=plan)
    g = torch.Generator().manual_seed(batch)
    for k in range(batch):
        ids = torch.randint(3, model.config.vocab_size, (context,), generator=g).tolist()
        core.add(Request(k, ids, SamplingParams(max_tokens=out, stop_token_ids=[])))
    while core.running < batch or any(r.pos < len(r.ids) for r in core.slots if r is not None):
        for o in core.step():
            if isinstance(o, Failed):
                raise RuntimeError(f"a {context}-token request failed: {o.error.kind}: {o.error.message}")
            if isinstance(o, Finished):
                raise RuntimeError(f"a request ended before all {batch} rows of {context} tokens were decoding")
    for _ in range(5):
        core.step()
    ms = synced(lambda: [core.step() for _ in range(steps)]) / steps
    return ms  # (the engine and its KV cache go with this frame)


def long_prompt(model: Mamba, tokens: int, out: int = 16) -> dict:
    """One request with a `tokens`-token prompt through the engine (prefilled in chunks):
    its time to the first token, its decode step, and the device memory it held at the
    peak beyond what the model held before."""
    gpu = model.weights.norm_f.is_cuda
    lm = LanguageModel(model, None, engine=engine(model))
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    core = EngineCore(model, lm.prefill, max_batch=1, prefill_tokens=8192, kv_tokens=tokens + out + 64)
    ids = torch.randint(3, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(7)).tolist()
    core.add(Request(0, ids, SamplingParams(max_tokens=out, stop_token_ids=[])))
    t0, times = time.perf_counter(), []
    while core.has_work:
        outs = core.step()
        if any(isinstance(o, Token) for o in outs):
            times.append(time.perf_counter())
        for o in outs:
            if isinstance(o, Failed):  # (the engine's reason, not an empty list of times)
                raise RuntimeError(f"the {tokens}-token prompt failed: {o.error.kind}: {o.error.message}")
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if gpu else float("nan")
    gaps = [b - a for a, b in zip(times, times[1:])]
    return dict(tokens=tokens, ttft_ms=round((times[0] - t0) * 1e3, 1),
                decode_ms=round(sorted(gaps)[len(gaps) // 2] * 1e3, 3) if gaps else None, peak_gib_above_model=round(peak, 2))


def serve_steps(model: Mamba, rows: int, prompt: int, budget: int, cache_mb: int, profile: bool = False) -> dict:
    """`rows` requests with `prompt`-token prompts through the engine as `fastmamba serve` runs
    them (a prefill budget a step, the prefix cache on: prompts prefill in chunks on its
    grid, each continuing its slot's state and keys and values): wall ms of each step until
    every first token, and with `profile` the torch profiler's heaviest ops of the second."""
    lm = LanguageModel(model, None, engine=engine(model))
    core = EngineCore(model, lm.prefill, max_batch=rows, prefill_tokens=budget, prefix_cache_bytes=cache_mb << 20,
                      kv_tokens=rows * (prompt + 64))
    g = torch.Generator().manual_seed(3)
    for k in range(rows):
        ids = torch.randint(3, model.config.vocab_size, (prompt,), generator=g).tolist()
        core.add(Request(k, ids, SamplingParams(max_tokens=8, stop_token_ids=[])))
    steps, first = [], 0
    while first < rows:
        if profile and len(steps) == 1:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                                        if cuda(str(model.device)) else None) as prof:
                ms = synced(core.step)
            for key in ("self_cuda_time_total", "self_cpu_time_total") if cuda(str(model.device)) else ("self_cpu_time_total",):
                print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60), flush=True)
        else:
            ms = synced(core.step)
        steps.append(round(ms, 1))
        first = sum(1 for r in core.slots if r is not None and r.pos >= len(r.ids))
    return dict(rows=rows, prompt=prompt, prefill_budget=budget, prefix_cache_mb=cache_mb, step_ms=steps,
                ms_per_1k_prompt_tokens=round(sum(steps) / (rows * prompt / 1000), 1))


def hf_ms_per_token(raw: dict, context: int, tokens: int = 16) -> float | None:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    config = AutoConfig.for_model(**raw)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(3, raw["vocab_size"], (1, context), device="cuda")
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, do_sample=False)
        short = synced(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False))
        full = synced(lambda: model.generate(ids, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, do_sample=False))
    return (full - short) / tokens


def one_row_variant(ap, model: Mamba, variant: str) -> DecodePlan:
    """The one-row plan at the model's shapes with one launch setting changed: "field=literal"."""
    field, _, value = variant.partition("=")
    c = model.config
    blocks = one_row_blocks(c.d_model, c.d_inner, c.vocab_size, model.weights.dtype, c.layer)
    if field not in {f.name for f in fields(blocks)}:
        ap.error(f"--one-row-variant {variant!r}: OneRowBlocks has no field {field!r}")
    try:
        return DecodePlan("one-row", blocks=replace(blocks, **{field: ast.literal_eval(value)}))
    except (ValueError, SyntaxError) as e:
        ap.error(f"--one-row-variant {variant!r}: the value is not a Python literal ({e})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="nemotron-h-8b", choices=list(HYBRID_SHAPES))
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens a request, before decoding")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prefill-tokens", type=int, default=8192, help="the engine's prompt tokens a step while "
                    "the decode's requests come in")
    ap.add_argument("--state-dtypes", default="float32", help="the recurrent state's dtypes to decode with (float32,bfloat16)")
    ap.add_argument("--plans", default="table", help="the decode plans to time: the table's (table), and "
                    "one-row (kernels/decode_step_hybrid.py) or layer-ops, e.g. table,one-row")
    ap.add_argument("--one-row-variant", action="append", default=[], metavar="FIELD=VALUE",
                    help="also time the one-row plan with one of its launch settings changed (plan.OneRowBlocks' "
                         "field, a Python literal), e.g. 'router=(8, 256, 4, 1)'; repeatable")
    ap.add_argument("--rounds", type=int, default=1, help="time the plans this many times, every other round in "
                    "reverse order (A B .. B A: a GPU's clock drifts as it heats)")
    ap.add_argument("--long", type=int, default=None,
                    help="a prompt of this many tokens through the engine: its first token, step and peak memory "
                         "(default: 32768 on the GPU, none on the CPU; 0: none)")
    ap.add_argument("--prefills", default=None, help="prefill shapes, rows x tokens (default 1x8192,8x2048; "
                    "on the CPU 1x256,2x128; none: no prefill)")
    ap.add_argument("--serve-steps", default=None,
                    help="rows x prompt tokens through the engine as the server prefills them, step by step, with "
                         "the prefix cache on (256 MB, serve's default) and off, the first profiled (e.g. 8x2048)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda (bf16 weights, the GPU engine), or cpu for a smoke run (float32)")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.prefills = args.prefills or ("1x8192,8x2048" if cuda(args.device) else "1x256,2x128")
    prefills = [] if args.prefills == "none" else [tuple(map(int, p.split("x"))) for p in args.prefills.split(",")]
    rows = []

    def emit(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    if cuda(args.device) and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (--device cpu for a smoke run)")
    plans = {"table": None, "layer-ops": LAYER_OPS, "one-row": DecodePlan("one-row")}
    if not set(args.plans.split(",")) <= set(plans):
        ap.error(f"--plans takes {', '.join(plans)}, comma-separated; got {args.plans!r}")
    names = args.plans.split(",") + args.one_row_variant
    bw = copy_bandwidth() if cuda(args.device) else 20e9  # (the CPU's floor: a nominal 20 GB/s)
    model, raw = model_of(args.shape, args.device)
    for variant in args.one_row_variant:
        plans[variant] = one_row_variant(ap, model, variant)
    emit(device=torch.cuda.get_device_name() if cuda(args.device) else "cpu", shape=args.shape, engine=engine(model),
         copy_bandwidth_gbs=round(bw / 1e9))
    for state_dtype in args.state_dtypes.split(","):
        m = Mamba(model.config, model.weights, model.ops, state_dtype=parse_state_dtype(state_dtype))
        for b, r in itertools.product([int(x) for x in args.batches.split(",")], range(args.rounds)):
            for plan in names[::-1] if r % 2 else names:
                ms = decode_ms(m, b, args.context, args.steps, plans[plan], args.prefill_tokens)
                floor = floor_ms(m, b, args.context, bw)
                emit(what="decode", state=state_dtype, batch=b, context=args.context, plan=plan, ms=round(ms, 3),
                     floor_ms=round(floor, 3), of_floor=round(floor / ms, 3), **({"round": r} if args.rounds > 1 else {}))
        m = None
    if args.serve_steps:
        rows_, prompt = map(int, args.serve_steps.split("x"))
        for cache_mb in (256, 0):
            emit(what="serve steps", **serve_steps(model, rows_, prompt, 4096, cache_mb, profile=cache_mb > 0))
    long = args.long if args.long is not None else (32768 if cuda(args.device) else 0)
    if long:
        try:
            emit(what="long prompt", **long_prompt(model, long))
        except RuntimeError as e:  # (the rest still measured)
            emit(what="long prompt", tokens=long, error=str(e)[:500])
    for batch, n in prefills:
        ids = torch.randint(3, model.config.vocab_size, (batch, n), device=args.device)
        with torch.inference_mode():
            model.prefill(ids[:, :128], model.new_state(batch, 128), last_only=True)
            ms = min(synced(lambda: model.prefill(ids, model.new_state(batch, n), last_only=True)) for _ in range(3))
        emit(what="prefill", batch=batch, tokens=n, ms=round(ms, 1))
    if not args.no_hf and cuda(args.device):
        model = None  # (the engine's model freed before transformers' is built)
        empty_cache()
        emit(what="transformers generate", batch=1, context=args.context,
             ms_per_token=round(hf_ms_per_token(raw, args.context), 2))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
