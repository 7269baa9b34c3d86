"""Can our model panel run on NDIF? Probes declared as data (``probes.toml`` beside this file), sent to a
live host, results as JSON in ``results/ndif_feasibility/``.

    python3 scripts/ndif_feasibility/probe_ndif.py [--probes FILE] [--pairing main,patched,...]
                                                   [--host URL] [--out DIR]

The command line only; the runner is :mod:`nnsight_repro.ndif.feasibility.runner`, which says what
each option does, and the declarations' schema is at the top of ``probes.toml``.
"""

import sys
from pathlib import Path

# Run as a file, so the repository root is not on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nnsight_repro.ndif.feasibility.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
