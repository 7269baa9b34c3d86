"""Where a MODEL's ``config.json`` is, offline: a checkpoint directory, a ``config.json`` file, or a hub id
already in the local Hugging Face cache; and whether that config can be read at all.

Owns the one-line errors for bad input (:class:`InputError`, exit 2). Does not read weights, tokenizers, or
the network: a hub id that is not cached is refused with how to provide its config. The cache layout is
huggingface_hub's (``<cache>/models--<org>--<name>/refs/main`` names the snapshot); read here with the
standard library so bad input is refused before any environment starts.

Stdlib only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


class InputError(Exception):
    """MODEL or its config cannot be used; the message names it and how to provide one."""


@dataclass(frozen=True)
class Checkpoint:
    #: What the user gave.
    given: str
    #: The folder that holds its config.json.
    folder: Path
    #: The ``repo_id`` a client's key carries: the hub id, or the checkpoint directory as given.
    repo_id: str
    config: dict

    @property
    def model_type(self) -> str:
        return self.config["model_type"]


def hub_cache() -> Path:
    """The cache huggingface_hub reads (its own variables, in its order of precedence)."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo_id: str, cache: Optional[Path] = None) -> Optional[Path]:
    """The cached snapshot of ``repo_id``'s main revision that holds a config.json, or None."""
    repo = (cache or hub_cache()) / ("models--" + repo_id.replace("/", "--"))
    try:
        snapshot = repo / "snapshots" / (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    return snapshot if (snapshot / "config.json").is_file() else None


def looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not text.startswith((".", "~"))


def read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise InputError(f"{path} is not JSON ({exc}); a transformers checkpoint's config.json is") from None
    if not isinstance(config, dict):
        raise InputError(f"{path} holds a JSON {type(config).__name__}, not the object a config.json is")
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise InputError(f"{path} has no model_type: transformers cannot tell which architecture it is. Fix: add "
                         f"\"model_type\" (e.g. \"bert\"), as `config.save_pretrained()` writes it")
    return config


def resolve(model: str) -> Checkpoint:
    """The checkpoint ``model`` names; :class:`InputError` when there is none offline."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(f"{model} is a directory without a config.json; point at the checkpoint directory "
                             f"(the one `save_pretrained()` wrote)")
        return Checkpoint(model, path, model, read_config(path / "config.json"))
    if path.is_file():
        return Checkpoint(model, path.parent, str(path.parent), read_config(path))
    if looks_like_hub_id(model):
        snapshot = cached_snapshot(model)
        if snapshot is not None:
            return Checkpoint(model, snapshot, model, read_config(snapshot / "config.json"))
    raise InputError(f"{model!r} is neither a checkpoint directory nor a model in the local Hugging Face cache "
                     f"({hub_cache()}), and preflight reads nothing from the hub. Fix: pass a directory holding its "
                     f"config.json (`huggingface-cli download {model} config.json --local-dir DIR` fetches only "
                     f"that file), or set HF_HUB_CACHE to a cache that has it")
