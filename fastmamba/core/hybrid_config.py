"""The hybrids' config.json (Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1, Jamba) as
MambaConfig's fields: the sublayers in order, the Mamba-1 or Mamba-2, attention, MLP and
experts' sizes, the family's multipliers. Every field that changes the math is read, or refused by name; config.py
builds the MambaConfig."""

from __future__ import annotations

import json

from fastmamba.core.config_fields import dt_limit, dt_rank, eos_id, float32_number, get, index
from fastmamba.core.errors import CheckpointError


def _one_of(raw: dict, source: str, keys: tuple[str, ...], kind, default=None):
    """The value of whichever of `keys` (a key and its other names, as hub configs and
    transformers 5 spell it) config.json holds; two of them that disagree name both."""
    present = [k for k in keys if raw.get(k) is not None]
    values = {json.dumps(raw[k], sort_keys=True) for k in present}
    if len(values) > 1:
        raise CheckpointError(f"{source}: keys {' and '.join(repr(k) for k in present)} disagree "
                              f"({', '.join(repr(raw[k]) for k in present)})")
    return get(raw, present[0], kind, source, default) if present else get(raw, keys[0], kind, source, default)


def _refuse_unless(raw: dict, source: str, key: str, allowed, why: str) -> None:
    if key in raw and raw[key] not in allowed:
        raise CheckpointError(f"{source}: key '{key}' is {raw[key]!r}; {why}")


def _attention_fields(raw: dict, source: str, d_model: int, head_dim_keys=("head_dim",), rope: bool = True,
                      partial_rope: float | None = None) -> dict:
    heads = get(raw, "num_attention_heads", int, source)
    kv = get(raw, "num_key_value_heads", int, source, heads)
    if heads % kv:
        raise CheckpointError(f"{source}: key 'num_key_value_heads' ({kv}) must divide 'num_attention_heads' ({heads})")
    head_dim = _one_of(raw, source, head_dim_keys, int, d_model // heads)
    if raw.get("sliding_window") is not None:
        raise CheckpointError(f"{source}: key 'sliding_window' is {raw['sliding_window']!r}; only full attention is "
                              "supported")
    theta, rotary = _rope(raw, source, head_dim, partial_rope) if rope else (0.0, 0)
    return dict(attn_heads=heads, kv_heads=kv, attn_head_dim=head_dim, attn_bias=get(raw, "attention_bias", bool, source, False),
                rope_theta=theta, rotary_dim=rotary)


def _rope(raw: dict, source: str, head_dim: int, partial: float | None) -> tuple[float, int]:
    """RoPE's base and rotated dims, from transformers 5's `rope_parameters` or the older
    top-level `rope_theta` and `rope_scaling`; any RoPE but the default one, in either key,
    is refused by name. partial: None where the family's model rotates whole heads whatever
    the config says (transformers' Granite-4.0-H and Falcon-H1); else the rotated share where
    `rope_parameters` gives no partial_rotary_factor (Bamba: 0.5, which transformers'
    BambaConfig also puts in place of a top-level one)."""
    params = {}
    for key in ("rope_scaling", "rope_parameters"):  # (rope_parameters' values first where both give one)
        given = raw.get(key)
        if given is None:
            continue
        if not isinstance(given, dict):
            raise CheckpointError(f"{source}: key '{key}' must be an object or null, got {given!r}")
        kind = given.get("rope_type", given.get("type", "default"))
        if kind != "default":
            raise CheckpointError(f"{source}: RoPE of type {kind!r} ({key}) is not supported; only the default RoPE is")
        params.update(given)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    factor = 1.0 if partial is None else params.get("partial_rotary_factor", partial)
    theta = get({"rope_theta": theta}, "rope_theta", float, source)
    factor = get({"partial_rotary_factor": factor}, "partial_rotary_factor", float, source)
    rotary = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary % 2:
        raise CheckpointError(f"{source}: key 'partial_rotary_factor' ({factor}) must be in (0, 1] and leave an even "
                              f"number of rotated dims of head_dim {head_dim}")
    return float(theta), rotary


def _hybrid_mamba2(source: str, *, d_model: int, d_inner: int, n_heads: int, n_groups: int, **fields) -> dict:
    """A hybrid's Mamba-2 fields, its sizes checked against each other."""
    if d_inner % n_heads:
        raise CheckpointError(f"{source}: the Mamba layers' width {d_inner} is not a multiple of their {n_heads} heads")
    if n_heads % n_groups:
        raise CheckpointError(f"{source}: the Mamba layers' {n_groups} groups must divide their {n_heads} heads")
    return dict(layer="mamba2", d_model=d_model, d_inner=d_inner, head_dim=d_inner // n_heads, n_groups=n_groups,
                **fields)


def _vocab_and_head(raw: dict, source: str) -> dict:
    return dict(vocab_size=get(raw, "vocab_size", int, source),
                tie_embeddings=get(raw, "tie_word_embeddings", bool, source, False), eos_token_id=eos_id(raw, source))


_NEMOTRON_BLOCKS = {"M": "mamba2", "*": "attention", "-": "mlp", "E": "moe"}
_NEMOTRON_TYPES = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "attention",
                   "full_attention": "attention", "mlp": "mlp", "moe": "moe"}


def _nemotron_h(raw: dict, source: str) -> dict:
    """Nemotron-H (and Nemotron Nano v2, Nemotron 3): one sublayer a layer, "M" Mamba-2, "*"
    attention (no positions), "-" an MLP of squared ReLU, "E" a mixture of experts;
    `hybrid_override_pattern` (hub) or `layers_block_type` (transformers 5)."""
    pattern, types = raw.get("hybrid_override_pattern"), raw.get("layers_block_type")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) and t in _NEMOTRON_TYPES for t in types):
            raise CheckpointError(f"{source}: key 'layers_block_type' must be a list of {sorted(_NEMOTRON_TYPES)}, "
                                  f"got {types!r}")
        blocks = [_NEMOTRON_TYPES[t] for t in types]
        if pattern is not None and pattern != "".join({v: k for k, v in _NEMOTRON_BLOCKS.items()}[b] for b in blocks):
            raise CheckpointError(f"{source}: keys 'hybrid_override_pattern' and 'layers_block_type' disagree")
    elif isinstance(pattern, str) and pattern and set(pattern) <= set(_NEMOTRON_BLOCKS):
        blocks = [_NEMOTRON_BLOCKS[ch] for ch in pattern]
    else:
        raise CheckpointError(f"{source}: key 'hybrid_override_pattern' must be a string of M, *, - and E "
                              f"(or 'layers_block_type' a list), got {pattern!r}")
    moe = _nemotron_experts(raw, source) if "moe" in blocks else {}
    layers = raw.get("num_hidden_layers")
    if layers is not None and layers != len(blocks):
        raise CheckpointError(f"{source}: key 'num_hidden_layers' is {layers}, but the layer pattern has {len(blocks)}")
    if raw.get("num_nextn_predict_layers", 0) not in (0, None):
        raise CheckpointError(f"{source}: key 'num_nextn_predict_layers' is {raw['num_nextn_predict_layers']!r}; "
                              "multi-token prediction layers are not supported")
    _refuse_unless(raw, source, "mamba_hidden_act", ("silu",), "the Mamba layers' activation must be silu")
    _refuse_unless(raw, source, "mlp_hidden_act", ("relu2", "silu"), "the MLP's activation must be relu2 or silu")
    d_model = get(raw, "hidden_size", int, source)
    heads = get(raw, "mamba_num_heads", int, source, 128)
    head_dim = get(raw, "mamba_head_dim", int, source, 64)
    # (transformers' NemotronH reads use_bias and writes mamba_proj_bias unread: the hub's name only where
    # use_bias is absent)
    in_out_bias = get(raw, "use_bias" if raw.get("use_bias") is not None else "mamba_proj_bias", bool, source, False)
    return dict(
        n_layer=len(blocks), blocks=tuple(blocks), family="nemotron_h",
        **_hybrid_mamba2(
            source, d_model=d_model, d_inner=heads * head_dim, n_heads=heads,
            n_groups=_one_of(raw, source, ("n_groups", "mamba_n_groups"), int, 8),
            d_state=get(raw, "ssm_state_size", int, source, 128),
            d_conv=_one_of(raw, source, ("conv_kernel", "mamba_d_conv"), int, 4),
            chunk_size=_one_of(raw, source, ("chunk_size", "mamba_chunk_size"), int, 128),
            conv_bias=_one_of(raw, source, ("use_conv_bias", "mamba_conv_bias"), bool, True),
            proj_bias=in_out_bias,
            dt_limit=dt_limit(raw.get("time_step_limit", raw.get("mamba_dt_limit")), "time_step_limit", source),
        ),
        norm_eps=get(raw, "layer_norm_epsilon", float, source, 1e-5),
        **_attention_fields(raw, source, d_model, ("head_dim", "attention_head_dim"), rope=False),
        mlp_size=get(raw, "intermediate_size", int, source), mlp_act=raw.get("mlp_hidden_act", "relu2"),
        mlp_gated=False, mlp_bias=get(raw, "mlp_bias", bool, source, False), **moe,
        **_vocab_and_head(raw, source),
    )


def _nemotron_experts(raw: dict, source: str) -> dict:
    """Nemotron-H's mixture of experts ("E" layers, Nemotron 3): `n_routed_experts` squared-ReLU
    MLPs of `moe_intermediate_size`, `num_experts_per_tok` a token chosen by sigmoid scores plus
    a correction bias within the `topk_group` best of `n_group` groups, weights renormalized
    (`norm_topk_prob`) and scaled (`routed_scaling_factor`); one shared MLP of
    `moe_shared_expert_intermediate_size`. A latent projection is refused by name."""
    if raw.get("moe_latent_size") is not None:
        raise CheckpointError(f"{source}: key 'moe_latent_size' is {raw['moe_latent_size']!r}; experts behind a "
                              "latent projection are not supported")
    _refuse_unless(raw, source, "n_shared_experts", (1, None), "one shared expert is supported (as transformers "
                   "builds it: one MLP of 'moe_shared_expert_intermediate_size')")
    experts = get(raw, "n_routed_experts", int, source)
    per_token = get(raw, "num_experts_per_tok", int, source)
    groups = get(raw, "n_group", int, source, 1)
    topk_groups = get(raw, "topk_group", int, source, 1)
    if experts % groups or (groups > 1 and experts // groups < 2):
        raise CheckpointError(f"{source}: key 'n_group' ({groups}) must divide 'n_routed_experts' ({experts}) into "
                              "groups of 2 or more")
    if topk_groups > groups:
        raise CheckpointError(f"{source}: key 'topk_group' ({topk_groups}) is more than 'n_group' ({groups})")
    if per_token > topk_groups * (experts // groups):
        raise CheckpointError(f"{source}: key 'num_experts_per_tok' ({per_token}) is more than the experts of "
                              f"'topk_group' ({topk_groups}) groups")
    return dict(n_experts=experts, experts_per_token=per_token, expert_size=get(raw, "moe_intermediate_size", int,
                source), router="sigmoid", expert_groups=groups, topk_groups=topk_groups,
                norm_topk=get(raw, "norm_topk_prob", bool, source, True),
                routed_scaling=float(get(raw, "routed_scaling_factor", float, source, 1.0)),
                shared_size=get(raw, "moe_shared_expert_intermediate_size", int, source))


def _mamba_fields_hf(raw: dict, source: str, d_model: int, d_inner: int) -> dict:
    """The `mamba_*` keys that Bamba, Granite-4.0-H and Falcon-H1 share."""
    heads = get(raw, "mamba_n_heads", int, source, 128)
    head = raw.get("mamba_d_head", "auto")
    if head not in (None, "auto") and (not isinstance(head, int) or isinstance(head, bool) or head <= 0):
        raise CheckpointError(f"{source}: key 'mamba_d_head' must be a positive integer or \"auto\", got {head!r}")
    if head not in (None, "auto") and head * heads != d_inner:
        raise CheckpointError(f"{source}: key 'mamba_d_head' ({head}) x 'mamba_n_heads' ({heads}) must be the Mamba "
                              f"layers' width {d_inner}")
    return _hybrid_mamba2(
        source, d_model=d_model, d_inner=d_inner, n_heads=heads,
        n_groups=get(raw, "mamba_n_groups", int, source, 1), d_state=get(raw, "mamba_d_state", int, source, 256),
        d_conv=get(raw, "mamba_d_conv", int, source, 4), chunk_size=get(raw, "mamba_chunk_size", int, source, 256),
        conv_bias=get(raw, "mamba_conv_bias", bool, source, True), proj_bias=get(raw, "mamba_proj_bias", bool, source, False),
        dt_limit=dt_limit(raw.get("time_step_limit"), "time_step_limit", source),
    )


def _expanded(raw: dict, source: str, d_model: int) -> int:
    return get(raw, "mamba_expand", int, source, 2) * d_model


def _bamba(raw: dict, source: str) -> dict:
    """Bamba: each layer a Mamba-2 or (at `attn_layer_indices`) an attention sublayer, then a
    gated SiLU MLP; partial RoPE."""
    layers = get(raw, "num_hidden_layers", int, source)
    attn = raw.get("attn_layer_indices") or []
    if not isinstance(attn, list) or not all(isinstance(i, int) and 0 <= i < layers for i in attn):
        raise CheckpointError(f"{source}: key 'attn_layer_indices' must be a list of layer indices below {layers}, "
                              f"got {attn!r}")
    _refuse_unless(raw, source, "hidden_act", ("silu",), "the MLP's activation must be silu")
    d_model = get(raw, "hidden_size", int, source)
    blocks = [b for i in range(layers) for b in ("attention" if i in attn else "mamba2", "mlp")]
    return dict(
        n_layer=layers, blocks=tuple(blocks), family="bamba",
        **_mamba_fields_hf(raw, source, d_model, _expanded(raw, source, d_model)),
        norm_eps=get(raw, "rms_norm_eps", float, source, 1e-5),
        **_attention_fields(raw, source, d_model, partial_rope=0.5),
        mlp_size=get(raw, "intermediate_size", int, source), mlp_bias=get(raw, "mlp_bias", bool, source, False),
        **_vocab_and_head(raw, source),
    )


_GRANITE_TYPES = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "attention", "full_attention": "attention"}


# Routing keys of other MoE families that would change Granite's routing: refused unless they
# say what Granite does (softmax over the top-k logits, renormalized, unscaled, no groups).
# (`output_router_logits`, `router_aux_loss_coef` and `router_jitter_noise` are training's.)
_GRANITE_ROUTING = {"scoring_func": ("softmax",), "norm_topk_prob": (True,), "routed_scaling_factor": (1, 1.0),
                    "n_group": (1,), "topk_group": (1,), "topk_method": ("greedy",), "moe_router_bias": (False,),
                    "router_bias": (False,)}


def _granite_experts(raw: dict, source: str) -> dict:
    """Granite's mixture of experts: `num_local_experts` gated MLPs of `intermediate_size`,
    `num_experts_per_tok` a token (core/moe.py); none (a dense model) where it is 0."""
    if raw.get("num_local_experts") in (0, None):
        return {}
    experts = get(raw, "num_local_experts", int, source)
    per_token = get(raw, "num_experts_per_tok", int, source, 2)
    if not 1 <= per_token <= experts:
        raise CheckpointError(f"{source}: key 'num_experts_per_tok' is {per_token}; it must be 1 to "
                              f"'num_local_experts' ({experts})")
    for key, allowed in _GRANITE_ROUTING.items():
        if raw.get(key) is not None:
            _refuse_unless(raw, source, key, allowed, f"Granite's routing is a softmax over the top "
                           f"'num_experts_per_tok' logits, renormalized (only {allowed[0]!r} is supported)")
    return dict(n_experts=experts, experts_per_token=per_token, expert_size=get(raw, "intermediate_size", int, source))


def _granite(raw: dict, source: str) -> dict:
    """Granite-4.0-H: each layer a Mamba-2 or attention sublayer, then the shared gated SiLU
    MLP, with the mixture of experts beside it where `num_local_experts` > 0 (one "moe"
    sublayer: routed experts plus the shared MLP); the embedding, residual, attention and
    logits multipliers; RoPE or none."""
    moe = _granite_experts(raw, source)
    layers = get(raw, "num_hidden_layers", int, source)
    types = raw.get("layer_types") or raw.get("layers_block_type")
    if not isinstance(types, list) or len(types) != layers or not all(isinstance(t, str) and t in _GRANITE_TYPES for t in types):
        raise CheckpointError(f"{source}: key 'layer_types' must list {layers} of 'mamba' and 'attention', got {types!r}")
    position = raw.get("position_embedding_type") or "nope"
    if position not in ("rope", "nope"):
        raise CheckpointError(f"{source}: key 'position_embedding_type' is {position!r}; 'rope' and 'nope' are supported")
    _refuse_unless(raw, source, "hidden_act", ("silu",), "the MLP's activation must be silu")
    d_model = get(raw, "hidden_size", int, source)
    blocks = [b for t in types for b in (_GRANITE_TYPES[t], "moe" if moe else "mlp")]
    attention = _attention_fields(raw, source, d_model, rope=position == "rope")
    attention["attn_scale"] = get(raw, "attention_multiplier", float, source, 1.0)  # (transformers' default)
    return dict(
        n_layer=layers, blocks=tuple(blocks), family="granitemoehybrid",
        **_mamba_fields_hf(raw, source, d_model, _expanded(raw, source, d_model)),
        norm_eps=get(raw, "rms_norm_eps", float, source, 1e-6),
        **attention,
        mlp_size=get(raw, "shared_intermediate_size", int, source), **moe,
        embedding_multiplier=float(get(raw, "embedding_multiplier", float, source, 1.0)),
        logits_multiplier=1.0 / get(raw, "logits_scaling", float, source, 1.0),
        multipliers=(("residual_multiplier", float(get(raw, "residual_multiplier", float, source, 1.0))),),
        **_vocab_and_head(raw, source),
    )


def _multipliers(raw: dict, source: str, key: str, n: int) -> tuple[float, ...]:
    value = raw.get(key)
    if value is None:
        return (1.0,) * n
    if (not isinstance(value, list) or len(value) != n
            or not all(float32_number(v) for v in value)):
        raise CheckpointError(f"{source}: key '{key}' must be a list of {n} numbers within float32's range, got {value!r}")
    return tuple(float(v) for v in value)


def _finite(raw: dict, source: str, key: str) -> float:
    value = raw.get(key, 1.0)
    if value is None:
        return 1.0
    if not float32_number(value):
        raise CheckpointError(f"{source}: key '{key}' must be a number within float32's range, got {value!r}")
    return float(value)


def _falcon_h1(raw: dict, source: str) -> dict:
    """Falcon-H1: each layer attention and Mamba-2 side by side on one norm (their outputs
    summed), then a gated SiLU MLP; muP multipliers on nearly every product."""
    layers = get(raw, "num_hidden_layers", int, source)
    _refuse_unless(raw, source, "hidden_act", ("silu",), "the MLP's activation must be silu")
    d_model = get(raw, "hidden_size", int, source)
    d_ssm = raw.get("mamba_d_ssm")
    d_inner = get(raw, "mamba_d_ssm", int, source) if d_ssm is not None else _expanded(raw, source, d_model)
    mamba = _mamba_fields_hf(raw, source, d_model, d_inner)
    out_bias = get(raw, "projectors_bias", bool, source, False)
    if out_bias != mamba["proj_bias"]:
        raise CheckpointError(f"{source}: keys 'mamba_proj_bias' ({mamba['proj_bias']}) and 'projectors_bias' "
                              f"({out_bias}) differ; only equal in_proj and out_proj biases are supported")
    names = ("ssm_in_multiplier", "ssm_out_multiplier", "attention_in_multiplier", "attention_out_multiplier",
             "key_multiplier")
    return dict(
        n_layer=layers, blocks=("mamba2+attention", "mlp") * layers, family="falcon_h1", **mamba,
        ssm_norm=get(raw, "mamba_rms_norm", bool, source, False),
        norm_before_gate=get(raw, "mamba_norm_before_gate", bool, source, True),
        norm_eps=get(raw, "rms_norm_eps", float, source, 1e-5),
        **_attention_fields(raw, source, d_model),
        mlp_size=get(raw, "intermediate_size", int, source), mlp_bias=get(raw, "mlp_bias", bool, source, False),
        embedding_multiplier=_finite(raw, source, "embedding_multiplier"),
        logits_multiplier=_finite(raw, source, "lm_head_multiplier"),
        multipliers=tuple((n, _finite(raw, source, n)) for n in names)
        + (("ssm_multipliers", _multipliers(raw, source, "ssm_multipliers", 5)),
           ("mlp_multipliers", _multipliers(raw, source, "mlp_multipliers", 2))),
        **_vocab_and_head(raw, source),
    )


# Routing keys of other MoE families that would change Jamba's routing: refused unless they say
# what Jamba does (the top k of a softmax over all experts, not renormalized, unscaled, no groups).
_JAMBA_ROUTING = {**_GRANITE_ROUTING, "norm_topk_prob": (False,)}


def _jamba(raw: dict, source: str) -> dict:
    """Jamba: layer i a Mamba-1 mixer whose dt, B and C are RMS-normalised with weights, or
    attention without positions where i % attn_layer_period == attn_layer_offset; then a
    gated SiLU MLP, or a mixture of `num_experts` of them where i % expert_layer_period ==
    expert_layer_offset (and num_experts > 1), routed by the top `num_experts_per_tok` of a
    softmax over all experts, not renormalized, with no shared MLP. Absent keys take
    transformers' JambaConfig defaults. (`use_mamba_kernels`, `use_mambapy` and
    `use_associative_scan` choose transformers' kernels, `num_logits_to_keep` which logits it
    computes: none changes the math.)"""
    layers = get(raw, "num_hidden_layers", int, source)
    periods = {}
    for what, period, offset in (("attn", 8, 4), ("expert", 2, 1)):
        p, o = get(raw, f"{what}_layer_period", int, source, period), index(raw, f"{what}_layer_offset", source, offset)
        if o >= p:
            raise CheckpointError(f"{source}: key '{what}_layer_offset' ({o}) must be below '{what}_layer_period' ({p})")
        periods[what] = (p, o)
    experts = _one_of(raw, source, ("num_experts", "num_local_experts"), int, 16)
    moe_at = [experts > 1 and i % periods["expert"][0] == periods["expert"][1] for i in range(layers)]
    moe = {}
    if any(moe_at):
        per_token = get(raw, "num_experts_per_tok", int, source, 2)
        if per_token > experts:
            raise CheckpointError(f"{source}: key 'num_experts_per_tok' is {per_token}; it must be 1 to "
                                  f"'num_experts' ({experts})")
        for key, allowed in _JAMBA_ROUTING.items():
            if raw.get(key) is not None:
                _refuse_unless(raw, source, key, allowed, "Jamba's routing is the top 'num_experts_per_tok' of a "
                               f"softmax over all experts, not renormalized (only {allowed[0]!r} is supported)")
        moe = dict(n_experts=experts, experts_per_token=per_token,
                   expert_size=get(raw, "intermediate_size", int, source), router="softmax_all", norm_topk=False)
    _refuse_unless(raw, source, "hidden_act", ("silu",), "the Mamba layers' and the MLPs' activation must be silu")
    _refuse_unless(raw, source, "attention_bias", (False, None), "Jamba's attention has no biases")
    d_model = get(raw, "hidden_size", int, source)
    eps = get(raw, "rms_norm_eps", float, source, 1e-6)
    blocks = [b for i in range(layers) for b in ("attention" if i % periods["attn"][0] == periods["attn"][1]
                                                 else "mamba1_normed", "moe" if moe_at[i] else "mlp")]
    attention = _attention_fields({"num_key_value_heads": 8, **raw}, source, d_model, rope=False)
    return dict(
        n_layer=layers, blocks=tuple(blocks), family="jamba", layer="mamba1", d_model=d_model,
        d_inner=get(raw, "mamba_expand", int, source, 2) * d_model, d_state=get(raw, "mamba_d_state", int, source, 16),
        d_conv=get(raw, "mamba_d_conv", int, source, 4),
        dt_rank=dt_rank(raw.get("mamba_dt_rank"), "mamba_dt_rank", source),
        conv_bias=get(raw, "mamba_conv_bias", bool, source, True),
        proj_bias=get(raw, "mamba_proj_bias", bool, source, False),
        dbc_norm_eps=eps, norm_eps=eps, **{**attention, "attn_bias": False},
        mlp_size=get(raw, "intermediate_size", int, source), **moe,
        **_vocab_and_head({"eos_token_id": 2, **raw}, source),
    )


HYBRIDS = {"nemotron_h": _nemotron_h, "bamba": _bamba, "granitemoehybrid": _granite, "falcon_h1": _falcon_h1,
           "jamba": _jamba}
