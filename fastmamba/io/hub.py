"""Model ids of the HuggingFace hub (`org/name`) resolved to a checkpoint folder.

huggingface_hub does the work: its cache (`HF_HOME`, `HF_HUB_CACHE`), its offline switch
(`HF_HUB_OFFLINE=1`) and its downloads. The cache is asked first, so that a model once
fetched loads with no network at all.
"""

from __future__ import annotations

import re
from pathlib import Path

from fastmamba.core.errors import CheckpointError
from fastmamba.io.files import INDEX_FILES, WEIGHTS_FILES

# A hub id as the hub spells one: an owner and a name, each of letters, digits and . _ -
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")

# Files a checkpoint folder may need (the chat templates where transformers saves them:
# serve/chat.py; generation_config.json's eos ids: the default stops); weights of one format only
# (see _patterns).
_COMMON = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "chat_template.jinja", "additional_chat_templates/*.jinja"]
_SAFETENSORS = ["model.safetensors", "model.safetensors.index.json", "model-*.safetensors"]
_BIN = ["pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*.bin"]


def is_hub_id(path) -> bool:
    """True for a string shaped like `org/name` (a folder of that name, if it exists, wins)."""
    return isinstance(path, str) and _REPO_ID.fullmatch(path) is not None and not Path(path).exists()


def _complete(folder: Path) -> bool:
    has_weights = any((folder / n).exists() for n in INDEX_FILES + WEIGHTS_FILES)
    return (folder / "config.json").exists() and has_weights


def resolve(repo_id: str) -> Path:
    """The local folder of hub model `repo_id`: from the cache, else downloaded.

    Raises CheckpointError naming the id when it is neither cached nor reachable.
    """
    try:
        import huggingface_hub
        from huggingface_hub import constants
        from huggingface_hub.errors import (
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError:  # a dependency of the package: only a broken install lacks it
        raise CheckpointError(f"{repo_id}: loading a hub id needs huggingface_hub (pip install huggingface_hub)") from None

    try:
        cached = Path(huggingface_hub.snapshot_download(repo_id, local_files_only=True))
        if _complete(cached):
            return cached
    except (LocalEntryNotFoundError, OSError, ValueError):
        pass  # not in the cache (or only part of it): download below, unless offline
    if constants.HF_HUB_OFFLINE:
        raise CheckpointError(
            f"{repo_id}: not in the HuggingFace cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set; "
            f"download it where the hub is reachable (hf download {repo_id}) or give the path of a checkpoint folder"
        )
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=_patterns(repo_id)))
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{repo_id}: no such model on the HuggingFace hub (or it is private: log in with `hf auth login`), "
            "and no folder of that name here"
        ) from None
    except Exception as e:  # no network, a proxy's refusal, a timeout: each library has its own types
        raise CheckpointError(
            f"{repo_id}: not in the HuggingFace cache ({constants.HF_HUB_CACHE}) and the hub cannot be reached "
            f"({type(e).__name__}); download it where the hub is reachable or give the path of a checkpoint folder"
        ) from None


def _patterns(repo_id: str) -> list[str]:
    """What to download: the config, the tokenizer, and the weights in one format (hub
    Mamba repos often hold both .safetensors and .bin; safetensors is preferred)."""
    from huggingface_hub import model_info

    files = [s.rfilename for s in model_info(repo_id).siblings or []]
    return _COMMON + (_SAFETENSORS if any(f.endswith(".safetensors") for f in files) else _BIN)
