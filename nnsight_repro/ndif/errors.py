"""What a local NDIF stack's operations tell their user: the errors they raise, and their progress lines.

Owns :class:`StackError` and its kinds, :data:`USER_ERRORS` (the failures the CLI reports as one line), and
:func:`say`, the default progress printer. Does not own when any of them is raised or said: that is the
module doing the work (:mod:`.stack`, :mod:`.stack_state`, :mod:`.services`, :mod:`.memory_watch`, :mod:`.stack_clients`).
Kept apart so that every one of those can raise the same errors without importing the others.

Stdlib only.
"""

from __future__ import annotations

import sys

from .. import envs
from . import config, deploy, netns


class StackError(Exception):
    """The stack cannot be brought up, used or found; the message says what to do."""


class OutOfMemory(StackError):
    """The kernel killed processes of the stack for want of memory (counted in its memory cgroup)."""


class RayStartRace(StackError):
    """Ray's GCS aborted as it started, on :data:`.services.RAY_START_RACE`; ``up`` starts the stack once more."""


#: The failures every ``ndif`` command reports as ``error: <message>`` with exit status 2 instead of a
#: traceback: each one's message already names the problem and the fix.
USER_ERRORS = (StackError, config.ConfigError, netns.NetnsError, deploy.DeployError, envs.EnvError)


def say(message: str) -> None:
    """One progress line on stderr, as every stack operation says what it does unless told otherwise."""
    print(f"[ndif] {message}", file=sys.stderr, flush=True)

