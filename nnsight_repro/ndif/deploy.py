"""Which panel models a local NDIF stack serves, under which keys, and how they get deployed.

A server finds a model by its key, and a client computes the key itself, so the stack is deployed under
exactly the keys its clients mint: :mod:`nnsight_repro.ndif.remote_client` mints them in the client
environment (``upstream-0.8`` for the 0.8 stack; for the 0.7 stack the build its server runs, ``main`` or
``patched``), which also saves the models, once; :func:`minted` remembers them.
Offline, ndif could not mint them: ``ndif deploy`` would ask the Hub to canonicalize the id. So the keys
are given verbatim, and each names the saved model's local path, which the server loads from disk.

Two ways in, both ndif's own: the controller deploys the keys in ``NDIF_DEPLOYMENTS`` as it starts (the
path ``up`` takes, on both generations: the models load while the API is still starting), and, on 0.1.2,
``ndif deploy -f`` with a deploy file (what ``up`` falls back to for a model the controller dropped,
because it waits for each replica and reports, per model, the exception that model failed with).

Stdlib only.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Dict, List

from .. import ROOT, channel, envs, fsutil

#: The decoder control and the two masked LMs the remote tests need (what each generation deploys at
#: ``up``: :attr:`.generations.Generation.served`).
SERVED: List[str] = ["gpt2", "bert-mlm", "esm-mlm"]

class DeployError(Exception):
    """A model could not be deployed; the message names it and says why."""


def mint_command(names: List[str], client: str) -> List[str]:
    env = envs.ensure(client)
    return [str(env.python), "-m", "nnsight_repro.ndif.remote_client", "mint", "--models", ",".join(names)]


def mint(names: List[str], client: str) -> Dict[str, dict]:
    """``{name: {path, task, key}}``: each panel model saved, with the key ``client`` sends for it."""
    env = envs.ensure(client)
    try:
        return channel.run_one(mint_command(names, client), env=env.environ(), cwd=ROOT, timeout=600,
                               what=env.what("minting the model keys"))
    except channel.ChannelError as exc:
        raise DeployError(f"Minting the model keys failed: {exc}") from None


#: The sources a minted key and a saved model's path depend on, besides the client environment.
_MINT_SOURCES = ["models.py", "lines.py", "checks.py", "ndif/remote_client.py"]


def _mint_digest(client: str) -> str:
    package = Path(__file__).resolve().parent.parent
    blob = hashlib.sha256()
    blob.update(client.encode())
    blob.update(envs.ensure(client, build=False).stamp["digest"].encode())
    for source in _MINT_SOURCES:
        blob.update((package / source).read_bytes())
    return blob.hexdigest()[:16]


def minted(names: List[str], cache: Path, client: str) -> Dict[str, dict]:
    """:func:`mint`, remembered in ``cache`` (starting a client costs seconds on two cores, in every ``up``).

    An entry is reused only while the client environment and the sources that decide paths and keys are
    unchanged and its saved model is still there; only the models without one are minted.
    """
    digest = _mint_digest(client)
    try:
        remembered = json.loads(cache.read_text())
        known = remembered["models"] if remembered["digest"] == digest else {}
    except (OSError, ValueError, KeyError):
        known = {}
    known = {name: m for name, m in known.items() if (Path(m["path"]) / "config.json").is_file()}
    missing = [name for name in names if name not in known]
    if missing:
        known.update(mint(missing, client))
        fsutil.write_text(cache, json.dumps({"digest": digest, "models": known}, indent=1))
    return {name: known[name] for name in names}


def write_file(path: Path, minted: Dict[str, dict], dtype: str) -> Path:
    """The deploy file ``ndif deploy -f`` reads (JSON, which is YAML too); every model in ``dtype``."""
    specs = [{"checkpoint": m["path"], "task": m["task"], "model_key": m["key"], "pinned": True,
              "dtype": dtype} for m in minted.values()]
    path.write_text(json.dumps({"models": specs}, indent=1) + "\n")
    return path


def failures(output: str, minted: Dict[str, dict]) -> Dict[str, str]:
    """``{name: reason}`` from ``ndif deploy`` output: every line it marks with ✗, matched to its model.

    A model whose actor died while loading is marked with Ray's "the actor died ..." sentence, and the
    exception it died of follows as a traceback; its last line (``SomeError: ...``) is the cause.
    """
    found: Dict[str, str] = {}
    lines = output.splitlines()
    for at, line in enumerate(lines):
        if "✗" not in line:
            continue
        for name, m in minted.items():
            if m["key"] not in line and m["path"] not in line:
                continue
            reason = line.split("✗", 1)[1].replace(m["key"], "").strip(" :")
            cause = None
            for following in lines[at + 1:]:
                if following.lstrip().startswith(("✗", "✓", "⋯")):
                    break
                if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b.*:", following):
                    cause = following.strip()
            if cause and cause.split(": ", 1)[-1] not in reason:
                reason = f"{reason} -- caused by {cause}"
            found.setdefault(name, reason)
    return found
