"""Small network questions asked from inside the stack's namespace, answered with one record.

The host cannot reach the namespace's loopback, so ``stack`` runs this module there (with whatever
Python runs the project: it needs only the standard library and :mod:`nnsight_repro.channel`):

    python -m nnsight_repro.ndif.probe get [--timeout S] URL [URL ...]
                                 -> {"URL": {"status": 200, "body": "..."} | {"error": "..."}}
    python -m nnsight_repro.ndif.probe ports PORT [...]    -> {"PORT": "listening" | "free"}
"""

import socket
import sys
import urllib.error
import urllib.request

from nnsight_repro import channel


def get(url: str, timeout: float = 5.0) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return {"status": response.status, "body": response.read().decode("utf-8", "replace")}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read().decode("utf-8", "replace")}
    except (OSError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def port_state(port: int) -> str:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return "listening" if sock.connect_ex(("127.0.0.1", port)) == 0 else "free"


def main(argv) -> int:
    action, *args = argv
    if action == "get":
        timeout = 5.0
        if args[:1] == ["--timeout"]:
            timeout, args = float(args[1]), args[2:]
        channel.send({url: get(url, timeout) for url in args})
    elif action == "ports":
        channel.send({port: port_state(int(port)) for port in args})
    else:
        print(f"unknown action {action!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
