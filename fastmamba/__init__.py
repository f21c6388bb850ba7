"""fastmamba: an inference engine for Mamba state-space language models.

The names below are imported on first use, so that `import fastmamba` (and the command
line's start, where Ctrl-C must stay quiet) does not wait for PyTorch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_HOMES = {
    "load": "engine.loader",
    "default_model_dir": "io.folders",
    "CheckpointError": "core.errors",
    "NonFiniteError": "core.errors",
    "SamplingParams": "core.sampling_params",
    "Generation": "engine.language_model",
    "StreamPiece": "engine.language_model",
    "LanguageModel": "engine.language_model",
    "Mamba": "core.model",
    "MambaState": "core.state",
    "MambaConfig": "core.config",
    "Tokenizer": "io.tokenizer",
    "HAVE_TRITON": "kernels._triton",
    "Backbone": "engine.backbone",
    "BackboneConfig": "engine.backbone_config",
    "batch": "serve.deploy",
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'fastmamba' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
