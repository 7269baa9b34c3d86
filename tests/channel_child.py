"""A tiny child for tests/test_channel.py: ``python tests/channel_child.py <behaviour>``.

Each behaviour does what a real child's libraries might do around :func:`nnsight_repro.channel.send`.
"""

import os
import signal
import sys
import time

from nnsight_repro import channel

RECORD = {"trace:bert-mlm:0.08": {"ok": True, "max_abs_diff": 0.037, "text": "line one\nline two {\"}"}}
#: What nnsight's remote status display draws: an erase code, a frame, no newline.
SPINNER = "\x1b[K\u280f [7d92bcee] QUEUED     (2.9s) Moved to position 1 in Queue."


def noise() -> None:
    sys.stdout.write(SPINNER)
    sys.stdout.write("{not json\n" + '{"a decoy": "record"}\n' + SPINNER)
    sys.stdout.flush()
    sys.stderr.write(SPINNER + "warning: something\n" + SPINNER)
    sys.stderr.flush()


def main(behaviour: str) -> None:
    if behaviour == "noisy":
        noise()
        channel.send(RECORD)
        noise()
    elif behaviour == "large":
        channel.send({"blob": "x" * 1_000_000})
    elif behaviour == "silent":
        print("I printed but sent nothing")
    elif behaviour == "two":
        channel.send({"n": 1})
        channel.send({"n": 2})
    elif behaviour == "malformed":
        with open(os.environ[channel.RESULT_FILE], "a") as fh:
            fh.write("{'python': 'repr, not json'}\n")
    elif behaviour == "unfinished":
        with open(os.environ[channel.RESULT_FILE], "a") as fh:
            fh.write('{"half": ')
    elif behaviour == "failing":
        print("about to fail", file=sys.stderr)
        raise SystemExit("the child's own error message")
    elif behaviour == "signal":
        print("dying by signal", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    elif behaviour == "hang":
        print("hanging", file=sys.stderr, flush=True)
        time.sleep(600)
    elif behaviour == "stream-then-crash":
        for n in range(3):
            noise()
            channel.send({"n": n})
        print("segfaulting now", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    elif behaviour == "stream-then-hang":
        channel.send({"n": 0})
        time.sleep(600)
    elif behaviour == "ready-client":  # what a remote_client `first:` case sends, around its libraries' noise
        noise()
        channel.send({"ready": "first:gpt2"})
        noise()
        channel.send({"cases": {}})
    elif behaviour == "echo-stdin":
        channel.send({"stdin": sys.stdin.read()})
    else:
        raise SystemExit(f"unknown behaviour {behaviour!r}")


if __name__ == "__main__":
    main(sys.argv[1])
