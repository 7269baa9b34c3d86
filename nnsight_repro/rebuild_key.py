"""Rebuilds model keys the way a server would, in a fresh interpreter (``python -m nnsight_repro.rebuild_key``).

Started by :func:`nnsight_repro.checks.rebuild_without_package` with a JSON list of ``[name, key]`` on
stdin; sends one record ``{name: {"ok", "rebuilt_class"} | failure, "_imported": [...]}``. It imports only
nnsight and transformers (through the wrapper class a key names), never a model's own package, so
``_imported`` says which of those a rebuild pulled in by itself.
"""

import importlib
import json
import sys
import warnings

from nnsight_repro import channel


def wrapper(key: str, **kwargs):
    """The nnsight wrapper a server builds from ``key``: the class the key's import path names, through its
    ``from_model_key`` (``kwargs`` go to it, e.g. ``dispatch=True`` as a model actor loads)."""
    import_path, _, _fields = key.partition(":")
    module, _, cls = import_path.rpartition(".")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(importlib.import_module(module), cls).from_model_key(key, **kwargs)


def rebuild(key: str) -> dict:
    try:
        rebuilt = wrapper(key)
        return {"ok": True, "rebuilt_class": type(rebuilt._module).__name__}
    except Exception as exc:  # the failure is the finding
        return {"ok": False, "error": type(exc).__name__, "message": str(exc).strip().splitlines()[0][:300]}


def main() -> None:
    out = {name: rebuild(key) for name, key in json.loads(sys.stdin.read())}
    out["_imported"] = sorted(m for m in ("multimolecule", "antiberty") if m in sys.modules)
    channel.send(out)


if __name__ == "__main__":
    main()
