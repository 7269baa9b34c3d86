"""What the server's model actors built: one JSON line per model load, the evidence of which class a key became.

Written inside the server, both generations (the CPU model actor of ``adaptations_0_0_1`` and of
``adaptations_0_1_2`` call :func:`record` once a model is loaded), to the file :data:`VARIABLE` names
(``<stack>/logs/built.jsonl``, set by :mod:`nnsight_repro.ndif.config`); read on the host by
:func:`nnsight_repro.ndif.stack_clients.built_models`. Each record: the key, the wrapper, its automodel or task, the
torch module's class, its dtype, and the server's nnsight (version and file).

Stdlib only at import: every 0.0.1 server process imports the adaptations that import this.
"""

from __future__ import annotations

import json
import os
import time

from .. import settings

VARIABLE = settings.variable("NDIF_BUILT_LOG")


def record(model_key: str, model) -> dict:
    """Append what ``model`` (an nnsight wrapper, just loaded for ``model_key``) is; also printed to the actor's log."""
    import nnsight

    entry = {"model_key": model_key, "wrapper": type(model).__name__,
             "automodel": getattr(getattr(model, "automodel", None), "__name__", None),
             "task": getattr(model, "task", None) if isinstance(getattr(model, "task", None), str) else None,
             "module_class": type(model._module).__name__,
             "dtype": str(next(model._module.parameters()).dtype),
             "nnsight": getattr(nnsight, "__version__", None),
             "nnsight_file": os.path.realpath(nnsight.__file__), "pid": os.getpid(), "time": time.time()}
    print(f"[nnsight-repro] BUILT {json.dumps(entry)}", flush=True)
    where = os.environ.get(VARIABLE)
    if where:
        with open(where, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
    return entry
