"""Decode benchmark: ms/token of the Triton engine at the public Mamba shapes, random weights.

Prints a table (model, dtype, batch, ms/step, tokens/s, fraction of the memory floor) and
writes JSON. The floor is the bytes one step must read (every weight once, the recurrent
state read and written) over the device's copy bandwidth, measured in the same run.
Optionally times HF transformers' MambaForCausalLM at the same shape for a ratio.

The random models, the floor and the timers here (graph-replayed steps, eager prefills, wall
and host time) are those of every script in benchmarks/ too.
"""

from __future__ import annotations

import gc
import json
import time

import torch

from fastmamba.core.config import MambaConfig
from fastmamba.core.families import family, sublayers
from fastmamba.core.fp8 import nbytes
from fastmamba.core.layers import LAYER_KINDS, state_bytes
from fastmamba.core.model import Mamba

SHAPES = {  # the public checkpoints' sizes (d_state 16, d_conv 4; vocab as published)
    "130m": MambaConfig(d_model=768, n_layer=24, vocab_size=50280),
    "370m": MambaConfig(d_model=1024, n_layer=48, vocab_size=50280),
    "790m": MambaConfig(d_model=1536, n_layer=48, vocab_size=50280),
    "1.4b": MambaConfig(d_model=2048, n_layer=48, vocab_size=50280),
    "2.8b": MambaConfig(d_model=2560, n_layer=64, vocab_size=50280),
    # tiiuae/falcon-mamba-7b: d_inner 8192 (not expand * d_model), dt_rank 256, untied head
    "falcon-7b": MambaConfig(d_model=4096, n_layer=64, vocab_size=65024, d_inner=8192, dt_rank=256,
                             tie_embeddings=False, dbc_norm_eps=1e-6),
    # Mamba-2: state-spaces/mamba2-* (d_state 128, heads of 64, one group, vocab padded to
    # 50288) and mistralai/Mamba-Codestral-7B-v0.1 (8 groups, 128 heads, untied head)
    "mamba2-130m": MambaConfig(d_model=768, n_layer=24, vocab_size=50288, layer="mamba2", d_state=128),
    "mamba2-2.7b": MambaConfig(d_model=2560, n_layer=64, vocab_size=50288, layer="mamba2", d_state=128),
    "codestral-7b": MambaConfig(d_model=4096, n_layer=64, vocab_size=32768, layer="mamba2", d_state=128, n_groups=8,
                                tie_embeddings=False),
}

# hybrids' config.json fields as the public checkpoints have them (the layer pattern of
# Nemotron-H's 52-layer models: 24 Mamba-2, 4 attention, 24 MLP sublayers)
HYBRID_SHAPES = {
    "nemotron-h-8b": {
        "model_type": "nemotron_h", "hidden_size": 4096, "vocab_size": 131072, "tie_word_embeddings": False,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504, "mlp_hidden_act": "relu2",
        "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "chunk_size": 128,
        "layer_norm_epsilon": 1e-5, "eos_token_id": 2},
    # ibm-granite/granite-4.0-h-tiny (7B, experts): the values as a public test fixture copies its
    # config.json (GRANITE_H_TINY_HF, found by search; the hub's file itself was not found);
    # 40 layers, 4 key-value heads and head_dim 128 (1536 / 12) as fitmyllm.com's page of the
    # model lists them. Not found, so left at the reader's defaults: embedding_multiplier,
    # residual_multiplier, attention_multiplier, logits_scaling (scalars folded into the weights
    # at load: no bytes, no time), rms_norm_eps, eos_token_id; position_embedding_type absent
    # reads as "nope", as the Granite-4.0-H models are.
    "granite-4.0-h-tiny": {
        "model_type": "granitemoehybrid", "hidden_size": 1536, "num_hidden_layers": 40, "vocab_size": 100352,
        "tie_word_embeddings": True,
        "layer_types": ["mamba"] * 5 + ["attention"] + (["mamba"] * 9 + ["attention"]) * 3 + ["mamba"] * 4,
        "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 512, "shared_intermediate_size": 1024,
        "num_local_experts": 64, "num_experts_per_tok": 6, "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_expand": 2,
        "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_chunk_size": 256},
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B (experts, 23 Mamba-2 + 23 MoE + 6 attention layers):
    # its config.json as public copies of it give it (a test's NEMOTRON3_30B_JSON, of transformers
    # 4.55.4, found by search), each size the same in NVIDIA-NeMo/Megatron-Bridge's
    # Nemotron3NanoProvider (src/megatron/bridge/models/nemotronh/nemotron_h_provider.py: pattern,
    # hidden 2688, 64 Mamba heads of 64, state 128, 32 heads of 128 over 2 key-value heads, 128
    # experts of 1856, top 6 scaled by 2.5, a shared expert of 3712, one group; 8 Mamba groups
    # its base class's)
    "nemotron-3-nano-30b-a3b": {
        "model_type": "nemotron_h", "hidden_size": 2688, "vocab_size": 131072, "tie_word_embeddings": False,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 1856,
        "mlp_hidden_act": "relu2", "mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
        "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": True, "use_bias": False, "n_routed_experts": 128,
        "num_experts_per_tok": 6, "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "layer_norm_epsilon": 1e-5, "eos_token_id": 2},
    # ibm-granite/granite-4.0-h-micro (3B, dense): a public copy of its config.json (the hub
    # user anuj6316's "granite", of the same geometry) and a test that quotes the hub's file
    # agree on every size here; IBM's model card: 4 attention and 36 Mamba-2 layers, NoPE.
    # vocab_size 100352 and a tied head are the family's (granite-4.0-h-350m's config.json,
    # granite-4.0-h-small's GGUF metadata): h-micro's own were not found. Its multipliers fold
    # into the weights at load (no bytes, no time).
    "granite-4.0-h-micro": {
        "model_type": "granitemoehybrid", "hidden_size": 2048, "num_hidden_layers": 40, "vocab_size": 100352,
        "tie_word_embeddings": True, "layer_types": (["mamba"] * 5 + ["attention"] + ["mamba"] * 4) * 4,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192, "shared_intermediate_size": 8192,
        "num_local_experts": 0, "num_experts_per_tok": 0, "mamba_n_heads": 64, "mamba_d_head": 64, "mamba_expand": 2,
        "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_chunk_size": 256,
        "mamba_conv_bias": True, "mamba_proj_bias": False, "embedding_multiplier": 12.0,
        "attention_multiplier": 0.015625, "logits_scaling": 8.0, "position_embedding_type": "nope"},
    # tiiuae/Falcon-H1-7B-Instruct: the sizes as several public copies of its config.json give
    # them (an adapter test's FALCON_H1_7B, NVIDIA-NeMo/Megatron-Bridge's FalconH1ModelProvider7B
    # "based on tiiuae/Falcon-H1-7B-Instruct"); mamba_chunk_size 256 and vocab_size 130049 where
    # copies disagree (128, 130048), with the provider. Its muP multipliers were not found (they
    # depend on the size): left at 1, folded into the weights at load all the same (no bytes,
    # no time).
    "falcon-h1-7b": {
        "model_type": "falcon_h1", "hidden_size": 3072, "num_hidden_layers": 44, "vocab_size": 130049,
        "tie_word_embeddings": False, "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128,
        "intermediate_size": 12288, "mamba_d_ssm": 3072, "mamba_n_heads": 24, "mamba_d_head": 128, "mamba_n_groups": 1,
        "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_rms_norm": True,
        "mamba_conv_bias": True, "mamba_proj_bias": False, "mamba_norm_before_gate": False, "rope_theta": 1e11,
        "projectors_bias": False, "attention_bias": False, "mlp_bias": False, "eos_token_id": 11},
    "nemotron-h-tiny": {  # (a smoke run's; the bundled tokenizer's vocabulary, for a served one)
        "model_type": "nemotron_h", "hidden_size": 256, "vocab_size": 4096, "hybrid_override_pattern": "M-M*-M-",
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "mamba_num_heads": 8,
        "mamba_head_dim": 64, "n_groups": 2, "ssm_state_size": 32, "eos_token_id": 2},
}


def _random_tensor(name: str, shape: tuple[int, ...], n_layer: int, g: torch.Generator, device) -> torch.Tensor:
    """A float32 tensor of a layer, of the spread trained models have, by its name: norms
    near 1, A_log the log of 1..N (per channel) or 1..16 (per head), step-size biases near
    softplus^-1 of e^-4, D near 1, conv taps of 0.5, products by fan-in (out_proj by the
    depth too), a sigmoid router's correction bias zero (a trained one balances the experts'
    load; random ones of 0.1 sent Nemotron 3 Nano's 64 rows to 60-79 of its 128 experts, where
    uniform routing reaches 122 and zero gives 107-121)."""
    def randn(std, mean=0.0):
        return mean + std * torch.randn(shape, device=device, generator=g)

    if name.endswith("A_log"):
        n = shape[-1] if len(shape) == 2 else 16
        a = torch.arange(1, n + 1, device=device, dtype=torch.float32)
        return a.repeat(shape[0], 1).log() if len(shape) == 2 else a.repeat(shape[0] // n + 1)[: shape[0]].log()
    if name.endswith(("norm.weight", "layernorm.weight", "mixer.D", "mamba.D")):
        return randn(0.1, 1.0)
    if name.endswith(("dt_proj.bias", "dt_bias")):
        return randn(1.0, -4.0)
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, device=device)
    if name.endswith("conv1d.weight"):
        return randn(0.5)
    if name.endswith("bias"):
        return randn(0.1)
    fan_in = shape[-1]
    outputs = ("out_proj.weight", "o_proj.weight", "down_proj.weight", "output_linear.weight")
    return randn((fan_in * n_layer) ** -0.5 if name.endswith(outputs) else fan_in**-0.5)


def _random_tensors(c: MambaConfig, device, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of a model of config c by its transformers name (its family's, the layer
    table's kinds), random with _random_tensor's spreads (embedding 0.02, an untied head by
    fan-in, norm_f near 1): float32, the matrices in `dtype`, each rounded as it is made (so
    that a model of 30B weights in bf16 is never held in float32 whole)."""
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    fam = family(c)

    def matrix(name: str, t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if name.endswith("weight") and t.dim() >= 2 and "conv1d" not in name else t

    for sub in sublayers(c):
        for name, shape in LAYER_KINDS[sub.kind].shapes(c, sub, fam).items():
            tensors[name] = matrix(name, _random_tensor(name, shape, c.n_layer, g, device))
    tensors[fam.embedding] = matrix(fam.embedding, 0.02 * torch.randn(c.vocab_size, c.d_model, device=device,
                                                                     generator=g))
    if not c.tie_embeddings:
        tensors[fam.lm_head] = matrix(fam.lm_head, c.d_model**-0.5 * torch.randn(c.vocab_size, c.d_model, device=device,
                                                                                  generator=g))
    tensors[fam.norm_f] = 1.0 + 0.1 * torch.randn(c.d_model, device=device, generator=g)
    return tensors


def random_model(size: str, dtype: torch.dtype, device="cuda", state_dtype: torch.dtype = torch.float32) -> Mamba:
    """A Mamba (either layer kind) with random weights of realistic spread at a public
    shape, built on the device from the layer kind's table of tensors; its states in
    state_dtype. On a CUDA device it runs over the GPU ops (the Triton prefill), as
    `fastmamba.load` builds it; elsewhere over the reference ops."""
    from fastmamba.core.ops import REFERENCE_OPS, triton_ops
    from fastmamba.engine.plan import KERNEL_TILES
    from fastmamba.io.checkpoint import build_weights

    c = SHAPES[size]
    tensors = _random_tensors(c, device)
    weights = build_weights(c, tensors, dict.fromkeys(tensors, "random"), device, dtype)
    ops = triton_ops(KERNEL_TILES) if torch.device(device).type == "cuda" else REFERENCE_OPS
    return Mamba(c, weights, ops, state_dtype=state_dtype)


def write_random_checkpoint(size: str, folder, dtype: torch.dtype = torch.bfloat16) -> None:
    """A checkpoint folder of random weights at a public shape (a Mamba-1 one of SHAPES, as
    random_model's, or a hybrid of HYBRID_SHAPES), made on the CPU, in transformers' format,
    with the bundled model's tokenizer: for benchmarks that load a folder (the server's, Ray
    Serve replicas). The products and the embedding are stored in dtype (the loader stores
    them so), the rest in float32."""
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    raw = HYBRID_SHAPES.get(size)
    c = MambaConfig.from_dict(raw, size) if raw is not None else SHAPES[size]
    tensors = _random_tensors(c, "cpu")
    big = {k: v.to(dtype) for k, v in tensors.items() if k.endswith(("proj.weight", "embeddings.weight", "lm_head.weight"))}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({**tensors, **big}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw if raw is not None else c.to_hf_dict(), indent=2))
    shutil.copy(Path(__file__).parent / "default_model" / "tokenizer.json", folder / "tokenizer.json")


def random_language_model(size: str, dtype: torch.dtype, device="cuda", state_dtype: torch.dtype = torch.float32):
    """random_model as a LanguageModel with no tokenizer, on the GPU engine where the device
    is CUDA (a module-level function: the serving benchmark's engine process makes its own)."""
    from fastmamba.core.ops import REFERENCE_OPS, triton_ops
    from fastmamba.engine.language_model import LanguageModel
    from fastmamba.engine.plan import KERNEL_TILES

    base = random_model(size, dtype, device, state_dtype)
    gpu = torch.device(device).type == "cuda"
    model = Mamba(base.config, base.weights, triton_ops(KERNEL_TILES) if gpu else REFERENCE_OPS, state_dtype=state_dtype)
    return LanguageModel(model, None, engine="triton" if gpu else "reference")


def step_bytes(model: Mamba, batch: int) -> tuple[int, int]:
    """(weight bytes, state bytes) one decode step must move at the least."""
    w = model.weights
    # lm_head is read whole (it is the embedding when tied); of an untied embedding a step
    # reads B rows only
    tensors = [w.lm_head, w.norm_f] + [t for lw in w.layers for t in vars(lw).values() if t is not None]
    weight = sum(nbytes(t) for t in tensors)  # (an FP8 matrix: its values and scales)
    state = 2 * batch * state_bytes(model.config, model.state_dtype.itemsize)  # read and written
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
    from fastmamba.engine.cuda_graphs import capture_graph

    graph, _ = capture_graph(lambda: [f() for f in launches])
    graph.replay()
    torch.cuda.synchronize()
    return min(gpu_ms(graph.replay, reps, 3)) * 1e3 / len(launches)


def time_graph_steps(model: Mamba, batch: int, steps: int = 200, deterministic: bool = False, params=None, plan=None) -> float:
    """Median ms per replayed decode step, sampling included: greedy, or with `params`
    (SamplingParams) the sampler that generation would pick for them. plan: a
    engine/plan.DecodePlan instead of the table's."""
    from fastmamba.core.sampling import pick_sampler
    from fastmamba.core.sampling_params import SamplingParams
    from fastmamba.engine.cuda_graphs import GraphDecoder
    from fastmamba.engine.plan import SAMPLER_TILES

    params = params or SamplingParams()
    dec = GraphDecoder(model, batch, deterministic, plan=plan)
    logits = torch.randn(batch, model.config.vocab_size, device="cuda")
    reqs = [(params, 0, [1])] * batch
    dec.begin(model.new_state(batch), logits, pick_sampler([params], True, SAMPLER_TILES), reqs)
    for _ in range(10):
        dec.next()
    # each replay runs dec.steps steps
    return sorted(gpu_ms(dec.graph.replay, steps // 5 // dec.steps, 5))[2] / dec.steps


def time_graph_steps_abba(variants: dict, batch: int, steps: int = 200) -> dict[str, float]:
    """Mean ms per replayed decode step of each variant, name: (model, plan) (plan None:
    the table's), each timed twice in the order A B .. B A: a GPU's clock drifts as it
    heats, and so drifts alike for every variant."""
    times = {name: [] for name in variants}
    for name in list(variants) + list(reversed(variants)):
        model, plan = variants[name]
        times[name].append(time_graph_steps(model, batch, steps, plan=plan))
        torch.cuda.empty_cache()
    return {name: sum(t) / len(t) for name, t in times.items()}


def floor_ms(model: Mamba, batch: int, bandwidth: float) -> float:
    """The decode step's floor, ms: step_bytes at `bandwidth` (bytes/s, copy_bandwidth's)."""
    return sum(step_bytes(model, batch)) / bandwidth * 1e3


def wall_ms(fn, repeat: int = 3) -> float:
    """Median wall ms of a call of fn, each call synchronised, after one warm-up call: for
    work whose host time counts (an eager prefill, a generation)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def host_us(fn, reps: int, warm: int = 3, sync: bool = True) -> float:
    """Mean µs per call of fn, called `reps` times back to back after `warm` calls: the
    host's time where it exceeds the GPU's (sync=False: on the CPU, nothing to wait for)."""
    for _ in range(warm):
        fn()
    if sync:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if sync:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def prefill_ms(model: Mamba, batch: int, tokens: int, repeat: int = 3) -> float:
    """wall_ms of an eager prefill (the last position's logits, from a fresh state) of
    `batch` prompts of `tokens` random tokens."""
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device="cuda")
    return wall_ms(lambda: model.prefill(ids, model.new_state(batch), last_only=True), repeat)


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
    """transformers' model of this config on the GPU (random weights), or None without it
    (or for Mamba-2 shapes: benchmarks/mamba2.py compares those with mamba_ssm)."""
    try:
        import transformers
    except ImportError:
        return None
    if config.layer != "mamba1":
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
                floor = floor_ms(model, batch, bw)
                # (transformers has no FP8 model to run beside fp8)
                hf_ms = time_hf(size, dtype, batch) if hf and batch == 1 and dtype != torch.float8_e4m3fn else None
                row = dict(
                    model=size, dtype="fp8" if dtype == torch.float8_e4m3fn else str(dtype).replace("torch.", ""),
                    state_dtype=str(state_dtype).replace("torch.", ""),
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
    from fastmamba.core.dtypes import parse_dtype

    sizes = args.models.split(",")
    for s in sizes:
        if s not in SHAPES:
            raise ValueError(f"--models: unknown shape {s!r}; known: {', '.join(SHAPES)}")
    dtypes = [parse_dtype(x) for x in args.dtypes.split(",")]  # (fp8: its floor counts a byte a projection weight)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise ValueError(f"--batches must be comma-separated integers, got {args.batches!r}") from None
    run(sizes, dtypes, batches, args.hf, args.json, args.deterministic, parse_dtype(args.state_dtype))
    return 0


