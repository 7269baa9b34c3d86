"""Sends the ids of the tests a pytest run would select (``python tests/collect_marked.py TARGET -m MARKER``).

pytest's ``--collect-only`` output is for people; :mod:`tests.test_negative_control` needs the ids as
data, from the environment under test, so they come through :mod:`nnsight_repro.channel`.
"""

import sys

import pytest

from nnsight_repro import channel


class Collected:
    def __init__(self):
        self.ids = []

    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid.split("::", 1)[1] for item in session.items]


def main(argv) -> int:
    collected = Collected()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *argv], plugins=[collected])
    if code != 0:
        return int(code)
    channel.send({"ids": collected.ids})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
