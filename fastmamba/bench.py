"""Decode benchmark: ms/token of the Triton engine at the public Mamba shapes, random weights.

Prints a table (model, dtype, batch, ms/step, tokens/s, fraction of the memory floor) and
writes JSON. The floor is the bytes one step must read (every weight once, the recurrent
state read and written) over the device's copy bandwidth, measured in the same run.
Optionally times HF transformers' MambaForCausalLM at the same shape for a ratio.
"""

from __future__ import annotations

import gc
import json
import time

import torch

from .config import MambaConfig
from .model import LayerWeights, Mamba, MambaWeights

SHAPES = {  # the public checkpoints' sizes (d_state 16, d_conv 4; vocab as published)
    "130m": MambaConfig(d_model=768, n_layer=24, vocab_size=50280),
    "370m": MambaConfig(d_model=1024, n_layer=48, vocab_size=50280),
    "790m": MambaConfig(d_model=1536, n_layer=48, vocab_size=50280),
    "1.4b": MambaConfig(d_model=2048, n_layer=48, vocab_size=50280),
    "2.8b": MambaConfig(d_model=2560, n_layer=64, vocab_size=50280),
    # tiiuae/falcon-mamba-7b: d_inner 8192 (not expand * d_model), dt_rank 256, untied head
    "falcon-7b": MambaConfig(d_model=4096, n_layer=64, vocab_size=65024, d_inner=8192, dt_rank=256,
                             tie_embeddings=False, dbc_norm_eps=1e-6),
}


def random_model(size: str, dtype: torch.dtype, device="cuda", state_dtype: torch.dtype = torch.float32) -> Mamba:
    """A Mamba with random weights of realistic spread at a public shape, built on the
    device; its states in state_dtype."""
    c = SHAPES[size]
    d, L, E, R, N, K = c.d_model, c.n_layer, c.d_inner, c.dt_rank, c.d_state, c.d_conv
    g = torch.Generator(device=device).manual_seed(0)

    def mat(rows, cols, scale=None):
        return (torch.randn(rows, cols, device=device, generator=g) * (scale or cols**-0.5)).to(dtype)

    def vec(n, mean=0.0, std=0.1):
        return mean + std * torch.randn(n, device=device, generator=g)

    layers = [
        LayerWeights(
            norm_w=vec(d, 1.0),
            in_proj_w=mat(2 * E, d),
            in_proj_b=None,
            conv_w=vec(E * K, 0.0, 0.5).view(E, K),
            conv_b=vec(E),
            x_proj_w=mat(R + 2 * N, E),
            dt_proj_w=mat(E, R),
            dt_bias=vec(E, -4.0, 1.0),
            A=-torch.arange(1, N + 1, device=device, dtype=torch.float32).repeat(E, 1),
            D=vec(E, 1.0),
            out_proj_w=mat(d, E, (E * L) ** -0.5),
            out_proj_b=None,
        )
        for _ in range(L)
    ]
    emb = mat(c.vocab_size, d, 0.02)
    head = emb if c.tie_embeddings else mat(c.vocab_size, d)
    return Mamba(c, MambaWeights(embedding=emb, layers=layers, norm_f=vec(d, 1.0), lm_head=head), state_dtype=state_dtype)


def random_language_model(size: str, dtype: torch.dtype, device="cuda", state_dtype: torch.dtype = torch.float32):
    """random_model as a LanguageModel with no tokenizer, on the GPU engine where the device
    is CUDA (a module-level function: the serving benchmark's engine process makes its own)."""
    from .language_model import LanguageModel
    from .model import REFERENCE_OPS, triton_ops

    base = random_model(size, dtype, device, state_dtype)
    gpu = torch.device(device).type == "cuda"
    model = Mamba(base.config, base.weights, triton_ops() if gpu else REFERENCE_OPS, state_dtype=state_dtype)
    return LanguageModel(model, None, engine="triton" if gpu else "reference")


def step_bytes(model: Mamba, batch: int) -> tuple[int, int]:
    """(weight bytes, state bytes) one decode step must move at the least."""
    w = model.weights
    # lm_head is read whole (it is the embedding when tied); of an untied embedding a step
    # reads B rows only
    tensors = [w.lm_head, w.norm_f] + [t for lw in w.layers for t in vars(lw).values() if t is not None]
    weight = sum(t.numel() * t.element_size() for t in tensors)
    c = model.config
    size = torch.empty(0, dtype=model.state_dtype).element_size()
    state = 2 * size * batch * c.n_layer * c.d_inner * (c.d_state + c.d_conv)  # read and written
    return weight, state


def gpu_ms(fn, reps: int, runs: int) -> list[float]:
    """GPU ms per call of fn (CUDA events around `reps` calls), for each of `runs` runs."""
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return times


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 4
    src = torch.empty(n, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = sorted(gpu_ms(lambda: dst.copy_(src), 1, 10))
    return 2 * n * 4 / (times[len(times) // 2] / 1e3)


def time_graph_launches(launches, reps: int = 20) -> float:
    """µs per launch: the callables captured in order in one CUDA graph, replayed `reps`
    times; the best of three such runs."""
    from .cuda_graphs import capture_graph

    graph, _ = capture_graph(lambda: [f() for f in launches])
    graph.replay()
    torch.cuda.synchronize()
    return min(gpu_ms(graph.replay, reps, 3)) * 1e3 / len(launches)


def time_graph_steps(model: Mamba, batch: int, steps: int = 200, deterministic: bool = False, params=None, plan=None) -> float:
    """Median ms per replayed decode step, sampling included: greedy, or with `params`
    (SamplingParams) the sampler that generation would pick for them. plan: a
    decode_plan.DecodePlan instead of the table's."""
    from .cuda_graphs import GraphDecoder
    from .sampling import SamplingParams, pick_sampler

    params = params or SamplingParams()
    dec = GraphDecoder(model, batch, deterministic, plan=plan)
    logits = torch.randn(batch, model.config.vocab_size, device="cuda")
    reqs = [(params, 0, [1])] * batch
    dec.begin(model.new_state(batch), logits, pick_sampler([params], True), reqs)
    for _ in range(10):
        dec.next()
    # each replay runs dec.steps steps
    return sorted(gpu_ms(dec.graph.replay, steps // 5 // dec.steps, 5))[2] / dec.steps


def time_hf(size: str, dtype: torch.dtype, batch: int, tokens: int = 32) -> float | None:
    """ms per generated token of transformers' MambaForCausalLM (FalconMambaForCausalLM for
    Falcon-Mamba), same shape, random weights."""
    hf = hf_model(SHAPES[size], dtype)
    if hf is None:
        return None
    ids = torch.randint(0, SHAPES[size].vocab_size, (batch, 4), device="cuda")
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(ids, **kw)
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / tokens * 1e3
    del hf
    gc.collect()  # HF's model holds reference cycles: free it now, not inside the next engine's peak
    torch.cuda.empty_cache()
    return ms


def hf_model(config: MambaConfig, dtype: torch.dtype):
    """transformers' model of this config on the GPU (random weights), or None without it."""
    try:
        import transformers
    except ImportError:
        return None
    falcon = config.dbc_norm_eps is not None
    hf_config = (transformers.FalconMambaConfig if falcon else transformers.MambaConfig)(**config.to_hf_dict())
    model_class = transformers.FalconMambaForCausalLM if falcon else transformers.MambaForCausalLM
    with torch.device("cuda"):
        return model_class(hf_config).to(dtype).eval()


def run(sizes, dtypes, batches, hf: bool, out: str | None, deterministic: bool = False,
        state_dtype: torch.dtype = torch.float32) -> list[dict]:
    if not torch.cuda.is_available():
        raise ValueError("the decode benchmark needs a CUDA GPU")
    bw = copy_bandwidth()
    mode = (", deterministic" if deterministic else "") + f", {str(state_dtype).replace('torch.', '')} state"
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s (read + write){mode}")
    rows = []
    header = f"{'model':>6} {'dtype':>9} {'batch':>5} {'ms/step':>8} {'tok/s':>9} {'floor ms':>8} {'of floor':>8} {'peak GiB':>8} {'HF ms':>8}"
    print(header)
    for size in sizes:
        for dtype in dtypes:
            torch.cuda.empty_cache()
            model = random_model(size, dtype, state_dtype=state_dtype)
            for batch in batches:
                torch.cuda.reset_peak_memory_stats()  # from the weights up: the engine's peak, not HF's
                ms = time_graph_steps(model, batch, deterministic=deterministic)
                peak = torch.cuda.max_memory_allocated()
                wbytes, sbytes = step_bytes(model, batch)
                floor = (wbytes + sbytes) / bw * 1e3
                hf_ms = time_hf(size, dtype, batch) if hf and batch == 1 else None
                row = dict(
                    model=size, dtype=str(dtype).replace("torch.", ""), state_dtype=str(state_dtype).replace("torch.", ""),
                    batch=batch, ms_per_step=round(ms, 4),
                    tokens_per_s=round(batch * 1e3 / ms, 1), floor_ms=round(floor, 4),
                    fraction_of_floor=round(floor / ms, 3), peak_gib=round(peak / 2**30, 2),
                    hf_ms_per_token=round(hf_ms, 3) if hf_ms else None,
                )
                rows.append(row)
                hf_txt = f"{hf_ms:8.2f}" if hf_ms else f"{'-':>8}"
                print(f"{size:>6} {row['dtype']:>9} {batch:>5} {ms:8.3f} {row['tokens_per_s']:9.0f} {floor:8.3f} {row['fraction_of_floor']:8.2f} {row['peak_gib']:8.2f} {hf_txt}", flush=True)
            del model
    if out:
        with open(out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_bandwidth_tbs=bw / 1e12, rows=rows), f, indent=2)
    return rows


def main_from_args(args) -> int:
    from .checkpoint import parse_dtype

    sizes = args.models.split(",")
    for s in sizes:
        if s not in SHAPES:
            raise ValueError(f"--models: unknown shape {s!r}; known: {', '.join(SHAPES)}")
    dtypes = [parse_dtype(x) for x in args.dtypes.split(",")]
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise ValueError(f"--batches must be comma-separated integers, got {args.batches!r}") from None
    run(sizes, dtypes, batches, args.hf, args.json, args.deterministic, parse_dtype(args.state_dtype))
    return 0


