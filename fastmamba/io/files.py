"""A checkpoint folder's files, opened only where they lie inside it (no torch here: the HTTP
front end reads config.json and tokenizer.json through it too)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from fastmamba.core.errors import CheckpointError

# The files a folder's weights may come in, in the order they are looked for.
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")


def inside(folder: Path, name) -> Path:
    """folder / name, refused unless it names a file inside the checkpoint folder: no
    absolute path, no '..', no symlink that leads out. The one exception is the HF cache's
    own layout, where a snapshot's files are links into the repo's `blobs` folder."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{folder}: file name {name!r} is not a non-empty string")
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(f"{folder}: file name {name!r} points outside the checkpoint folder")
    path = folder / name
    try:
        home = folder.resolve()
        real = path.resolve()
    except RuntimeError:  # Path.resolve's word for a symlink loop
        raise CheckpointError(f"{path}: is a symlink loop") from None
    except OSError as e:  # a permission error on the way
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path}: is a symlink loop") from None
        raise CheckpointError(f"{path}: cannot resolve the path ({type(e).__name__}: {e})") from None
    roots = [home] + ([home.parent.parent / "blobs"] if home.parent.name == "snapshots" else [])
    if not any(real == r or r in real.parents for r in roots):
        raise CheckpointError(f"{path}: leads to {real}, outside the checkpoint folder")
    _not_special(path, real)
    return path


# A folder's files that are neither files nor folders, by what they are: reading a FIFO waits
# for a writer forever, a character device (/dev/zero) never ends.
_SPECIAL = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
            (stat.S_ISSOCK, "a socket"))


def _not_special(path: Path, real: Path) -> None:
    try:
        mode = os.stat(real).st_mode
    except OSError:  # (missing or unreadable: its reader names that)
        return
    for test, kind in _SPECIAL:
        if test(mode):
            raise CheckpointError(f"{path}: is {kind}, not a regular file")


def readable_file(path: Path) -> Path:
    """path, if it is a file this process can read; else a CheckpointError saying what it is
    (the libraries' own errors for these cases mislead: a folder reads as 'No such device')."""
    if path.is_dir():
        raise CheckpointError(f"{path}: is a folder, not a weights file")
    try:
        with open(path, "rb"):
            pass
    except PermissionError:
        raise CheckpointError(f"{path}: cannot be read: permission denied") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be opened ({e.strerror or type(e).__name__})") from None
    return path
