"""Hugging Face Hub model IDs wherever a model directory is accepted: one resolver, `model_dir`.

A local path wins. Otherwise a name shaped like `org/name` is fetched with `huggingface_hub.snapshot_download` into
the HF cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub), only the files the caller needs
(config.json alone for a model description; the tokenizer's files; or the weights). $HF_HUB_OFFLINE=1 reads the
cache only; a model that is not there is one error line that says how to get it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mcorekit.errors import MCoreKitError

# org/name as the Hub spells repository ids (letters, digits, '-', '_', '.'; no '..', no leading or trailing '.' or '-')
HUB_ID_RE = re.compile(r"^(?!.*\.\.)[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?$")

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json"]
FILES = {
    "config": ["config.json"],
    "tokenizer": ["config.json", *TOKENIZER_FILES],
    "weights": ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json"],
    "model": ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", *TOKENIZER_FILES],
}
# what must be in the folder afterwards for each kind (a cached snapshot may hold less than was asked for)
REQUIRED = {"config": ["config.json"], "tokenizer": [], "weights": ["config.json", "*.safetensors"],
            "model": ["config.json", "*.safetensors"]}


class HubError(MCoreKitError):
    """A Hub model ID that cannot be had: offline and not cached, unknown or gated, or the download failed."""


def is_hub_id(name: str | Path, base: str | None = None) -> bool:
    """Whether `name` is no local path (in `base`, default the current directory) but is shaped like an `org/name`
    Hub model ID."""
    text = str(name)
    return not Path(base or "", text).expanduser().exists() and bool(HUB_ID_RE.fullmatch(text))


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def cache_dir() -> Path:
    """The HF hub cache as huggingface_hub finds it, read now (not when huggingface_hub was imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def model_dir(name: str | Path, need: str = "model", what: str = "model") -> Path:
    """A local folder for `name`: the path itself when it exists (or is not shaped like a Hub ID: the caller's own
    checks then say what is wrong with it), else the Hub snapshot holding the files `need` names ("config",
    "tokenizer", "weights" or "model"), downloaded unless $HF_HUB_OFFLINE is set. `what` names the input in errors."""
    if need not in FILES:
        raise ValueError(f"need must be one of {', '.join(FILES)}, got {need!r}")
    if not is_hub_id(name):
        return Path(name)
    repo = str(name)
    offline = _offline()
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError:
        raise HubError(f"{what} {repo}: no such local path, and huggingface_hub (needed for Hub model IDs) is not "
                       f"installed; pip install huggingface_hub, or give a local model folder") from None
    where = cache_dir()
    try:
        folder = Path(snapshot_download(repo, allow_patterns=FILES[need], cache_dir=where, local_files_only=offline))
    except LocalEntryNotFoundError:
        if offline:
            raise HubError(f"{what} {repo}: not in the Hugging Face cache {where} and HF_HUB_OFFLINE=1; download it "
                           f"once online (unset HF_HUB_OFFLINE, or `hf download {repo}`) or give a local model "
                           f"folder") from None
        raise HubError(f"{what} {repo}: not in the Hugging Face cache {where} and the Hub cannot be reached; check "
                       f"the network (or HF_ENDPOINT), or give a local model folder") from None
    except GatedRepoError:
        raise HubError(f"{what} {repo}: a gated model; accept its terms on huggingface.co and log in (`hf auth "
                       f"login` or HF_TOKEN), or give a local model folder") from None
    except RepositoryNotFoundError:
        raise HubError(f"{what} {repo}: no such local path, and no such model on the Hub (or it is private: log in "
                       f"with `hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubError(f"{what} {repo}: the Hub has no such revision") from None
    except (HfHubHTTPError, OSError) as e:
        text = " ".join(str(e).split())[:200]
        raise HubError(f"{what} {repo}: download into {where} failed ({type(e).__name__}: {text}); retry, or give "
                       f"a local model folder") from None
    missing = [pattern for pattern in REQUIRED[need] if not any(folder.glob(pattern))]
    if missing:
        raise HubError(f"{what} {repo}: the snapshot in {folder} has no {' or '.join(missing)}"
                       f"{' (HF_HUB_OFFLINE=1: only what is cached is read; download the rest online)' if offline else ''}")
    return folder
