"""ServeOptions: every option of `fastmamba serve`, spelled once. The command line's flags,
the Ray deployment's arguments (`serve run fastmamba.serve.deploy:app key=value ...`) and
`serve` itself read these fields; the engine's own (model, device, slots, budgets) are
engine.options.EngineOptions, which a ServeOptions holds."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from fastmamba.engine.options import EngineOptions, flag, option

STREAM_INTERVAL_MS = 50  # --stream-interval-ms's default (deploy.py says why)


@dataclass(frozen=True)
class ServeOptions:
    engine: EngineOptions = field(default_factory=EngineOptions)
    host: str = field(default="127.0.0.1", metadata=option("address to bind (default: 127.0.0.1, this machine only)"))
    port: int = field(default=8000, metadata=option("port (default: 8000)"))
    served_model_name: str | None = field(default=None, metadata=option(
        "the model's name in the API (default: the --model folder's name or hub id, or fastmamba-default)",
        metavar="NAME"))
    max_queue: int = field(default=256, metadata=option(
        "requests that may wait for a slot; more get 429 (default: 256)"))
    max_model_len: int = field(default=32768, metadata=option(
        "prompt + max_tokens of one request, at most; a request over it gets a 400 (default: 32768)"))
    replicas: int = field(default=0, metadata=option(
        "run N engine replicas on Ray Serve (one GPU each on CUDA), requests routed by prefix; needs pip install "
        "'fastmamba[ray]' (default: 0, one engine without Ray)"))
    autoscale: str | None = field(default=None, metadata=option(
        "with Ray Serve: between MIN and MAX replicas as the load asks (in place of --replicas)", metavar="MIN:MAX"))
    stream_interval_ms: float = field(default=STREAM_INTERVAL_MS, metadata=option(
        "with Ray Serve: a replica sends each stream's new tokens on every this many ms, in one message (each "
        "message costs Ray a fixed time); 0 = each token at once (default: 50)"))
    chat_template: str | None = field(default=None, metadata=option(
        "a jinja chat template file to use in place of the model's own (default: the model folder's "
        "chat_template.jinja, else tokenizer_config.json's chat_template, else a plain 'role: content' one)",
        metavar="FILE"))
    chat_template_name: str | None = field(default=None, metadata=option(
        "which of the model's named chat templates to use: additional_chat_templates/NAME.jinja or an entry of "
        "tokenizer_config.json's list (default: default)", metavar="NAME"))
    api_key: str | None = field(default=None, metadata=option("require 'Authorization: Bearer KEY' (not on /health)"))
    max_body_mb: float = field(default=8, metadata=option(
        "largest request body, MiB; a larger one gets a 413 before it is read (default: 8)"))
    shutdown_timeout: float = field(default=10, metadata=option(
        "on SIGTERM or Ctrl-C, seconds to let running requests finish before they are cancelled and the server "
        "exits (default: 10)"))
    engine_timeout: float = field(default=30, metadata=option(
        "seconds the engine process may go without a word (it reports twice a second, and after each step) before "
        "it is taken for wedged: /health and its open requests get 503 until it answers again (default: 30)"))
    client_timeout: float = field(default=10, metadata=option(
        "seconds a client may take to send a request's headers, or between two pieces of its body, before the "
        "connection is closed (default: 10)"))

    def __post_init__(self):
        for name in ("max_queue", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.replicas < 0:
            raise ValueError(f"--replicas must be at least 0, got {self.replicas}")
        if not 0 <= self.stream_interval_ms <= 10_000:
            raise ValueError(f"--stream-interval-ms must be from 0 to 10000, got {self.stream_interval_ms}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be from 1 to 65535, got {self.port}")
        if not 0 < self.max_body_mb <= 4096:
            raise ValueError(f"--max-body-mb must be above 0 and at most 4096, got {self.max_body_mb:g}")
        if not 0 <= self.shutdown_timeout <= 3600:
            raise ValueError(f"--shutdown-timeout must be from 0 to 3600 seconds, got {self.shutdown_timeout:g}")
        if not 1 <= self.engine_timeout <= 3600:
            raise ValueError(f"--engine-timeout must be from 1 to 3600 seconds, got {self.engine_timeout:g}")
        if not 0.1 <= self.client_timeout <= 3600:
            raise ValueError(f"--client-timeout must be from 0.1 to 3600 seconds, got {self.client_timeout:g}")
        if self.autoscale is not None:
            autoscaling(self.autoscale, 1)  # its own error, naming --autoscale
            if self.replicas:
                raise ValueError(f"--autoscale {self.autoscale} takes the place of --replicas: give one of them, not both")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty (an unset variable?): give a key, or leave the flag out for a server "
                             "without one")

    @property
    def model_name(self) -> str:
        """The model's name in the API: --served-model-name, else the --model folder's own name
        (a path's last part: `/data/models/mamba-130m/` is "mamba-130m") or the hub id as given,
        else "fastmamba-default" (the bundled model)."""
        if self.served_model_name:
            return self.served_model_name
        model = self.engine.model
        if model is None:
            return "fastmamba-default"
        local = Path(model).expanduser()
        return local.resolve().name if local.is_dir() else model

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    @property
    def ray(self) -> bool:
        """Whether the engines run as Ray Serve replicas."""
        return bool(self.replicas or self.autoscale)

    def autoscaling(self) -> dict | None:
        """Ray Serve's autoscaling config, each replica aiming at --max-batch requests in flight."""
        return autoscaling(self.autoscale, self.engine.max_batch or 16) if self.autoscale else None

    @classmethod
    def from_namespace(cls, args) -> "ServeOptions":
        """From the command line's parsed flags (cli.py makes them from these fields)."""
        return cls.from_dict(vars(args), strict=False)

    @classmethod
    def from_dict(cls, values: dict, strict: bool = True) -> "ServeOptions":
        """From {field name: value} over both ServeOptions' and EngineOptions' fields (strict:
        another key is a ValueError naming it; else ignored, as the command line's own are).
        Values that are strings (Ray's command line passes key=value) are converted to the
        field's type; a bad one is a ValueError naming the option."""
        known = {f.name for f in fields(EngineOptions)} | {f.name for f in fields(cls)} - {"engine"}
        unknown = sorted(set(values) - known)
        if strict and unknown:
            raise ValueError(f"unknown option {unknown[0]!r}; the options are {', '.join(sorted(known))}")
        engine = {f.name: _typed(f, values[f.name]) for f in fields(EngineOptions) if values.get(f.name) is not None}
        serve = {f.name: _typed(f, values[f.name]) for f in fields(cls)
                 if f.name != "engine" and values.get(f.name) is not None}
        return cls(engine=EngineOptions(**engine), **serve)


def _typed(f, value):
    """A field's value from a string where the field is not a string."""
    if not isinstance(value, str) or "str" in str(f.type):
        return value
    kind = str(f.type).split(" |")[0]
    try:
        if kind == "bool":
            if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
                raise ValueError
            return value.lower() in ("1", "true", "yes")
        return {"int": int, "float": float}[kind](value)
    except (ValueError, KeyError):
        raise ValueError(f"{flag(f.name)} takes {'an integer' if kind == 'int' else 'a number' if kind == 'float' else 'true or false'}, got {value!r}") from None


def autoscaling(spec: str, target: int = 16) -> dict:
    """Ray Serve's autoscaling config from "MIN:MAX" replicas (each aiming at `target`
    requests in flight); a ValueError naming --autoscale otherwise."""
    try:
        low, high = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--autoscale takes MIN:MAX replicas, got {spec!r}") from None
    if not 0 <= low <= high or high < 1:
        raise ValueError(f"--autoscale MIN:MAX needs 0 <= MIN <= MAX and MAX >= 1, got {spec!r}")
    return {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": target}
