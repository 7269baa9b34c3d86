"""Sends the versions an environment's interpreter reports (``python -m nnsight_repro.env_versions``).

Run by :func:`nnsight_repro.envs.reported_versions` in any of the project's environments, the NDIF server
ones included; ``nnsight_file`` is where nnsight is really imported from (the patched server links the
``patched`` build in front of its own). pip's freeze names sdist and wheel installs by path, so the
versions come from the installed metadata instead.
"""

import importlib.metadata as metadata
import os

from nnsight_repro import channel

NAMES = ["nnsight", "torch", "transformers", "ndif", "multimolecule"]


def main() -> None:
    import nnsight

    found = {}
    for name in NAMES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    found["nnsight_file"] = os.path.realpath(nnsight.__file__)
    channel.send(found)


if __name__ == "__main__":
    main()
