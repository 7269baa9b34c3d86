"""A stand-in probe client for tests/test_probe_ndif.py: the real one's events, no server.

Reads the probes as JSON on stdin like :mod:`nnsight_repro.ndif.feasibility.client`; a probe whose id
starts with ``hangs`` reports a status and then waits for ever (a request whose last status never
came); every other probe is done at once.
"""

import json
import sys
import time

from nnsight_repro import channel


def main() -> int:
    channel.send({"event": "context", "client": {"line": "stand-in"}, "server_env": None})
    for probe in json.load(sys.stdin):
        channel.send({"event": "start", "probe": probe["id"]})
        if probe["id"].startswith("hangs"):
            channel.send({"event": "status", "probe": probe["id"], "status": "RUNNING"})
            time.sleep(60)  # far past the test's limit; bounded if the limit breaks
        channel.send({"event": "done", "probe": probe["id"], "observed": {"status": "ok", "seconds": 0.0}})
    channel.send({"event": "context", "client": {"line": "stand-in"}, "server_env": {"python": "3.11"}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
