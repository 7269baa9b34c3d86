"""Facts about a server environment, asked with its own Python (``python -m nnsight_repro.ndif.server_facts``).

- ``nnsight``: where ``import nnsight`` would load it from, and whether the 0.0.1 adaptations' import
  hook is installed; resolved, not imported: the same lookup an import makes, without nnsight's ~5 s of
  torch and transformers imports (on two cores they would delay every service that starts after it).
- ``inline-cap``: the largest result the 0.1.2 server hands back inline (derived from our Redis's limits).

Each sends one record through :mod:`nnsight_repro.channel`.
"""

import importlib.metadata
import importlib.util
import os
import sys

from nnsight_repro import channel


def nnsight() -> dict:
    spec = importlib.util.find_spec("nnsight")
    return {"nnsight": importlib.metadata.version("nnsight"), "file": os.path.realpath(spec.origin),
            "adaptations": any(type(f).__name__ == "_AdaptingFinder" for f in sys.meta_path)}


def inline_cap() -> dict:
    from ndif.common.providers.redis import RedisProvider

    return {"inline_cap": RedisProvider.max_publish_bytes()}


def main(argv) -> int:
    facts = {"nnsight": nnsight, "inline-cap": inline_cap}
    if len(argv) != 1 or argv[0] not in facts:
        print(f"usage: python -m nnsight_repro.ndif.server_facts {'|'.join(facts)}", file=sys.stderr)
        return 2
    channel.send(facts[argv[0]]())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
