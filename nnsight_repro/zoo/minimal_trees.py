"""Minimal trees behind the zoo's two findings beyond ``output``, through nnsight's serializer.

Every zoo worker runs them and reports them with its environment
(``zoo.json``: ``environments.<env>.probes``); ``python -m nnsight_repro.zoo.minimal_trees``
(inside an environment) prints the same JSON object alone: per probe, whether the envoy tree comes back with the same paths and
envoy classes, or the error. Found by the full scan in Flava's image codebook:

- ``path_child``: a submodule named ``path`` (Flava's ``res_path.path``). ``path``
  is an envoy's own per-instance attribute, so the child envoy overwrites it:
  the round trip then disagrees on every line, the series included.
- ``input_and_output_children``: one module with children ``input`` and
  ``output`` (Flava's ``blocks``). 0.7 chains a second synthesized class on the
  first; the question is only whether that tree still round-trips.
"""

from __future__ import annotations

import json
import warnings


def probe_trees():
    import torch

    class ResPath(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.path = torch.nn.Linear(2, 2)

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input = torch.nn.Linear(2, 2)
            self.output = torch.nn.Linear(2, 2)

    return {"path_child": torch.nn.Sequential(ResPath()), "input_and_output_children": torch.nn.Sequential(Blocks())}


def round_trip(module) -> dict:
    from nnsight import NNsight
    from nnsight.intervention import serialization

    wrapper = NNsight(module)
    # What the remoteable wrappers pass (nnsight's _remoteable_persistent_objects), without needing a hub model.
    persistent = {"Interleaver": wrapper.interleaver, **{f"Module:{e.path}": e._module for e in wrapper.modules()}}
    try:
        loaded = serialization.loads(serialization.dumps(wrapper), persistent)
    except Exception as exc:
        return {"ok": False, "error": type(exc).__name__, "message": str(exc).strip().splitlines()[0][:200]}
    paths = [e.path for e in wrapper.modules()]
    return {"ok": paths == [e.path for e in loaded.modules()]
            and all(type(a) is type(b) for a, b in zip(wrapper.modules(), loaded.modules())),
            "path_types": sorted({type(p).__name__ for p in paths}),
            "synthesized_classes": sorted({type(e).__name__ for e in wrapper.modules() if "Preserved" in type(e).__name__})}


def main() -> None:
    warnings.simplefilter("ignore")
    print(json.dumps({name: round_trip(tree) for name, tree in probe_trees().items()}))


if __name__ == "__main__":
    main()
