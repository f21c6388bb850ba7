"""Reading config.json's values: each one type-checked, and a missing or malformed one named
with its file and key (a CheckpointError)."""

from __future__ import annotations

import math

from fastmamba.core.errors import CheckpointError

# The model computes in float32 at most: a number past its range is inf there (a norm's
# epsilon of 1e39 made every logit 0, silently).
FLOAT32_MAX = 3.4028234663852886e38


def float32_number(value) -> bool:
    """A JSON number (not a bool) float32 can hold: finite, within its range."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= FLOAT32_MAX


def get(raw: dict, key: str, kind, source: str, default=None):
    """One config value, type-checked; a missing required key or a wrong type names the key."""
    if key not in raw or raw[key] is None:
        if default is None:
            raise CheckpointError(f"{source}: missing required key '{key}'")
        return default
    value = raw[key]
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    elif kind is float:
        ok = float32_number(value) and value > 0
    else:
        ok = isinstance(value, kind)
    if not ok:
        expected = {int: "a positive integer", float: "a positive number within float32's range", bool: "true or false"}
        raise CheckpointError(f"{source}: key '{key}' must be {expected.get(kind, kind.__name__)}, got {value!r}")
    return value


def index(raw: dict, key: str, source: str, default: int) -> int:
    """A non-negative integer (a layer index or offset); a wrong type or sign names the key."""
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointError(f"{source}: key '{key}' must be a non-negative integer, got {value!r}")
    return value


def dt_rank(value, key: str, source: str) -> int:
    if value in (None, "auto"):
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise CheckpointError(f"{source}: key '{key}' must be \"auto\" or a positive integer, got {value!r}")


def dt_limit(value, key: str, source: str) -> tuple[float, float]:
    """A [low, high] pair of step-size bounds (JSON may spell infinity `Infinity`)."""
    if value is None:
        return (0.0, math.inf)
    if isinstance(value, (list, tuple)):  # (transformers writes infinity as {"__float__": "Infinity"})
        value = [_json_float(v) for v in value]
    ok = (isinstance(value, (list, tuple)) and len(value) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
          and 0 <= value[0] < value[1])
    if not ok:
        raise CheckpointError(f"{source}: key '{key}' must be [low, high] with 0 <= low < high, got {value!r}")
    return (float(value[0]), float(value[1]))


def _json_float(v):
    if isinstance(v, dict) and set(v) == {"__float__"} and isinstance(v["__float__"], str):
        try:
            return float(v["__float__"])
        except ValueError:
            return v
    return v


def eos_ids(raw: dict, source: str) -> tuple[int, ...]:
    """`eos_token_id`: one id or a list of them (a chat model's end of text and end of turn)."""
    eos = raw.get("eos_token_id", 0)
    ids = eos if isinstance(eos, list) and eos else [eos]
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise CheckpointError(f"{source}: key 'eos_token_id' must be a non-negative integer or a list of them, "
                                  f"got {eos!r}")
    return tuple(dict.fromkeys(ids))


def eos_id(raw: dict, source: str) -> int:
    """The first of `eos_token_id`'s ids (MambaConfig.stop_token_ids keeps them all)."""
    return eos_ids(raw, source)[0]
