"""Small network questions asked from inside the stack's namespace, answered as one JSON line.

The host cannot reach the namespace's loopback, so ``stack`` runs this file there (as a script, with
whatever Python runs the project: it needs only the standard library and imports nothing of ours):

    probe.py get [--timeout S] URL [URL ...]
                                 -> {"URL": {"status": 200, "body": "..."} | {"error": "..."}}
    probe.py ports PORT [...]    -> {"PORT": "listening" | "free"}
"""

import json
import socket
import sys
import urllib.error
import urllib.request


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
        print(json.dumps({url: get(url, timeout) for url in args}))
    elif action == "ports":
        print(json.dumps({port: port_state(int(port)) for port in args}))
    else:
        print(json.dumps({"error": f"unknown action {action!r}"}))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
