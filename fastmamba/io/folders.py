"""Where a checkpoint is: the bundled model, a folder, or a hub id's snapshot (no torch here:
the HTTP front end finds its folder too)."""

from __future__ import annotations

import os
from pathlib import Path

from fastmamba.io.hub import is_hub_id
from fastmamba.io.hub import resolve as resolve_hub_id


def default_model_dir() -> Path:
    """The folder of the small model that ships inside the package."""
    return Path(__file__).resolve().parents[1] / "default_model"


def checkpoint_folder(path) -> Path:
    """The folder `load` reads for `path`: the bundled model, a folder, or a hub id's snapshot."""
    if path is None:
        return default_model_dir()
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"model must be a checkpoint folder (a str or path) or a hub id org/name, "
                         f"got {type(path).__name__} {path!r:.60}")
    if isinstance(path, str) and not path.strip():
        raise ValueError("the model path is empty: give a checkpoint folder or a hub id org/name")
    if is_hub_id(path):
        return resolve_hub_id(path)
    return Path(path)
