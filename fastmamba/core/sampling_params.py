"""SamplingParams: what a request asks of the sampler, validated when it is made (at the edge:
`generate`, the HTTP front end), and the seed a slot's random stream starts from. No torch
here: the HTTP front end builds these without loading the model stack."""

from __future__ import annotations

import json
import numbers
import secrets
from dataclasses import dataclass, fields, replace

MASK32 = 0xFFFFFFFF
FLOAT32_MAX = 3.4028234663852886e38  # the sampler computes in float32: larger values cannot be held
MAX_LOGIT_BIAS = 100.0  # OpenAI's bounds: a bias of -100 bans a token, +100 all but forces it
MAX_LOGIT_BIAS_TOKENS = 300
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty, as OpenAI bounds them
# a guide's kinds (structured output), and the spec each takes: json_object none (""), json_schema
# a JSON schema (a dict, or its JSON text), regex a regular expression, choice a list of strings
# (or its JSON text)
GUIDE_KINDS = ("json_object", "json_schema", "regex", "choice")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1.0 = off; HF semantics, over prompt and generated tokens
    seed: int | None = None  # 0 <= seed < 2**32 (a slot's random stream is 32-bit); None = a fresh random seed
    stop_token_ids: tuple[int, ...] | None = None  # None = the model's eos; () = none
    # OpenAI's, applied to the raw logits before everything above (vLLM's formula; vLLM puts
    # its repetition penalty first, so the two differ where both kinds are set):
    # logits[j] += logit_bias[j] - presence_penalty * (count[j] > 0) - frequency_penalty * count[j],
    # count[j]: how often token j came in this request's output so far (not its prompt)
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], at most 300; {} = None
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    # structured output: (kind, spec), one of GUIDE_KINDS; the output is held to it (xgrammar,
    # `pip install 'fastmamba[structured]'`), and it ends ("stop") where the grammar is complete
    guide: tuple[str, str] | None = None

    def __post_init__(self):
        # numpy's scalars (np.int64, np.float32) are numbers too: held as Python's own
        for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed",
                     "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, numbers.Integral) and not isinstance(v, (int, bool)) and type(v).__name__ != "bool_":
                object.__setattr__(self, name, int(v))
            elif isinstance(v, numbers.Real) and not isinstance(v, (int, float)):
                object.__setattr__(self, name, float(v))
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (str, bytes)):
            try:
                object.__setattr__(self, "stop_token_ids", tuple(
                    int(i) if isinstance(i, numbers.Integral) and not isinstance(i, bool) else i
                    for i in self.stop_token_ids))
            except TypeError:
                pass
        if isinstance(self.logit_bias, dict):  # a copy of its own, numpy's keys and values as Python's
            object.__setattr__(self, "logit_bias", {
                int(k) if isinstance(k, numbers.Integral) and not isinstance(k, bool) else k:
                float(v) if isinstance(v, numbers.Real) and not isinstance(v, (int, float, bool)) else v
                for k, v in self.logit_bias.items()} or None)

        if isinstance(self.guide, (list, tuple)) and len(self.guide) == 2 and not isinstance(self.guide[1], str):
            kind, spec = self.guide  # a schema's dict or a choice's list as its JSON text
            if isinstance(spec, (dict, list, tuple)):
                object.__setattr__(self, "guide", (kind, json.dumps(spec, ensure_ascii=False)))
        if isinstance(self.guide, list):
            object.__setattr__(self, "guide", tuple(self.guide))

        def bad(name, rule):
            raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):  # finite, and within float32's range, which the sampler computes in
            return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= FLOAT32_MAX

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not is_num(self.temperature) or not 0 <= self.temperature < float("inf"):
            bad("temperature", "must be a number >= 0 within float32's range")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not is_num(self.repetition_penalty) or not 0 < self.repetition_penalty < float("inf"):
            bad("repetition_penalty", "must be a number > 0 within float32's range")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MASK32):
            bad("seed", "must be None or an integer from 0 to 2**32 - 1")
        if self.stop_token_ids is not None:
            try:
                ids = tuple(self.stop_token_ids)
            except TypeError:
                ids = (None,)
            if isinstance(self.stop_token_ids, (str, bytes)) or not all(is_int(i) and i >= 0 for i in ids):
                bad("stop_token_ids", "must be None or a list of token ids >= 0")
            object.__setattr__(self, "stop_token_ids", ids)
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                bad(name, f"must be a number from {-MAX_PENALTY:g} to {MAX_PENALTY:g}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must be None or a dict of token ids to numbers")
            if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
                raise ValueError(f"SamplingParams.logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                                 f"got {len(self.logit_bias)}")
            for token, bias in self.logit_bias.items():
                if not is_int(token) or token < 0:
                    raise ValueError(f"SamplingParams.logit_bias holds the key {token!r}, not a token id (an integer >= 0)")
                if not is_num(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise ValueError(f"SamplingParams.logit_bias gives token {token} the bias {bias!r}: it must be a "
                                     f"number from {-MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}")
            object.__setattr__(self, "logit_bias", {k: float(v) for k, v in self.logit_bias.items()})

        if self.guide is not None:
            _check_guide(self.guide)

    @property
    def penalized(self) -> bool:
        """Whether the request uses OpenAI's logit_bias, presence_penalty or frequency_penalty."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0

    @classmethod
    def from_kwargs(cls, params: "SamplingParams | dict | None", kwargs: dict) -> "SamplingParams":
        """`params` (a SamplingParams, a dict of its fields, or None) with any keyword
        overrides; an unknown field is a TypeError naming it."""
        if isinstance(params, dict):
            params, kwargs = None, {**params, **kwargs}
        elif params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, a dict of its fields or None, got {type(params).__name__}")
        names = {f.name for f in fields(cls)}
        for key in kwargs:
            if key not in names:
                raise TypeError(f"unknown sampling option {key!r}; options are {', '.join(sorted(names))}")
        return replace(params if params is not None else cls(), **kwargs)


def _check_guide(guide) -> None:
    rule = (f"SamplingParams.guide must be None or (kind, spec), kind one of {', '.join(GUIDE_KINDS)}, "
            f"got {guide!r}"[:300])
    if not isinstance(guide, tuple) or len(guide) != 2 or guide[0] not in GUIDE_KINDS or not isinstance(guide[1], str):
        raise ValueError(rule)
    kind, spec = guide
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except ValueError:
            schema = None
        if not isinstance(schema, dict):
            raise ValueError(f"SamplingParams.guide's JSON schema must be a JSON object, got {spec[:80]!r}")
    elif kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"SamplingParams.guide's choices must be a non-empty list of non-empty strings, "
                             f"got {spec[:80]!r}")
    elif kind == "regex" and not spec:
        raise ValueError("SamplingParams.guide's regex is empty")


def resolve_seed(seed: int | None) -> int:
    """The 32-bit seed a slot's random stream starts from; None draws a fresh one."""
    return secrets.randbits(32) if seed is None else seed
