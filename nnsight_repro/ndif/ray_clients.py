"""Ray clients connecting to a stack's Ray the way ndif's API does, one after another, each attempt
sent as one record. ``stack`` runs this module with the server environment's Python (it needs Ray,
the standard library and :mod:`nnsight_repro.channel`) inside the stack's namespace:

    python -m nnsight_repro.ndif.ray_clients ADDRESS COUNT
                                   -> COUNT records {"ok": bool, "seconds": float, "error": str}

Every connect makes Ray's client server start a server of its own for that client; why some of those
died at start, and what the stack does about it: ``generations.RAY_ENV``.
"""

import sys
import time

from nnsight_repro import channel


def connect_once(ray, address: str) -> dict:
    started = time.monotonic()
    error = ""
    try:
        ray.init(address, logging_level="error")
    except Exception as exc:  # the failed connect is the finding: record it and go on
        error = f"{type(exc).__name__}: {exc}"[:400]
    finally:
        try:
            ray.shutdown()
        except Exception as exc:
            error = error or f"shutdown: {type(exc).__name__}: {exc}"[:400]
    return {"ok": not error, "seconds": round(time.monotonic() - started, 2), "error": error}


def main(argv) -> int:
    address, count = argv[0], int(argv[1])
    import ray

    for _ in range(count):
        channel.send(connect_once(ray, address))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
