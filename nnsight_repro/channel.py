"""The one way a process in another environment (or inside an NDIF namespace) hands results back.

Owns both halves of that channel:

- the child side, :func:`send`: one JSON record appended to the result file whose path the parent put
  into ``NNSIGHT_REPRO_RESULT_FILE``;
- the parent side: :func:`run` (every record of a child that must exit 0), :func:`run_one` (exactly one
  record), and :func:`start`, a :class:`Stream` whose records are read one by one with a timeout (the
  zoo worker, the remote and probe clients);
- :class:`ChannelError`, the one error for a child that died, was killed, ran past its timeout, or sent
  a malformed or missing result. Its message names what ran, where, the command and its stderr's tail.

Why a file the parent names, and not stdout or an inherited descriptor: libraries write to stdout and
stderr whenever they like (nnsight's remote status spinner draws frames without a newline, so a result
printed after one shares its line), so neither can carry a result. A path survives ``ip netns exec``,
``sudo`` and any ``close_fds`` a grandchild's launcher applies, and it can never point at an unrelated
file the way an inherited descriptor number can once a grandchild has reused it.

The child's stdout and stderr go to files (never pipes, which deadlock once a child fills one nobody
reads); they are logs, kept for error messages and never parsed for results.

Does not own: what a record means (each caller's), building environments (:mod:`nnsight_repro.envs`),
or entering a namespace (:mod:`nnsight_repro.ndif.netns` gives the argv). Stdlib only: the host side
runs before anything is installed.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Union

from . import settings

#: The variable naming the result file; set by the parent for each child, read by :func:`send`.
RESULT_FILE = settings.variable("RESULT_FILE")
#: Lines of a child's stderr (and stdout) quoted in an error.
TAIL_LINES = 20

PathLike = Union[str, os.PathLike]


class ChannelError(Exception):
    """A child did not deliver its result; the message names what ran where, the command and why."""

    def __init__(self, what: str, argv: Sequence[str], reason: str, *, returncode: Optional[int] = None,
                 stderr_tail: str = "", stdout_tail: str = ""):
        self.what, self.argv, self.reason = what, list(argv), reason
        self.returncode, self.stderr_tail, self.stdout_tail = returncode, stderr_tail, stdout_tail
        message = f"{what}: `{shlex.join(self.argv)}` {reason}."
        message += ("\nIts stderr ends:\n" + stderr_tail) if stderr_tail.strip() else "\nIts stderr was empty."
        if stdout_tail.strip():
            message += "\nIts stdout ends:\n" + stdout_tail
        super().__init__(message)


class ChannelTimeout(ChannelError):
    """The child ran past its timeout and was killed."""


# Child side ------------------------------------------------------------------------------------------------

def connected() -> bool:
    """Whether this process was started with a result channel (else a command run by hand prints for a
    person instead of sending)."""
    return bool(os.environ.get(RESULT_FILE))


def send(record: dict) -> None:
    """Deliver ``record`` (JSON-serializable) to the parent that started this process.

    One ``write`` of one line, appended: records from one child never interleave, and a child killed
    mid-record leaves a line without its newline, which the parent reports instead of half-reading it.
    """
    path = os.environ.get(RESULT_FILE)
    if not path:
        raise RuntimeError(f"channel.send: no result channel ({RESULT_FILE} is not set); this process was "
                           f"not started by nnsight_repro.channel.run/run_one/start.")
    if not isinstance(record, dict):
        raise TypeError(f"channel.send takes a dict, not {type(record).__name__}")
    data = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        while data:  # a regular file takes it in one write; the loop only guards a short one
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


# Parent side -----------------------------------------------------------------------------------------------

class Stream:
    """A running child and the records it has sent so far; see :func:`start`."""

    def __init__(self, argv: Sequence[str], *, what: str, env: Optional[Mapping[str, str]] = None,
                 cwd: Optional[PathLike] = None, input: Optional[str] = None,
                 stderr: Optional[PathLike] = None, new_session: bool = False):
        self.argv, self.what, self.new_session = [str(a) for a in argv], what, new_session
        self.folder = Path(tempfile.mkdtemp(prefix="nnsr-channel-"))
        self.result_path = self.folder / "result.jsonl"
        self.result_path.touch()
        self.stdout_path = self.folder / "stdout"
        # A caller's log file gathers every child's stderr; our tail starts where this child's begins.
        self.stderr_path = Path(stderr) if stderr else self.folder / "stderr"
        self._stderr_from = self.stderr_path.stat().st_size if self.stderr_path.exists() else 0
        child_env = dict(os.environ if env is None else env)
        child_env[RESULT_FILE] = str(self.result_path)
        stdin = subprocess.DEVNULL
        if input is not None:
            (self.folder / "stdin").write_text(input)
            stdin = open(self.folder / "stdin")
        self._offset, self._buffer, self._pending, self.killed_after = 0, b"", [], None
        try:
            with open(self.stdout_path, "wb") as out, open(self.stderr_path, "ab") as err:
                self.process = subprocess.Popen(self.argv, env=child_env, cwd=cwd, stdin=stdin, stdout=out,
                                                stderr=err, start_new_session=new_session)
        except OSError as exc:
            self.close()
            raise ChannelError(what, self.argv, f"could not start ({exc})") from None
        finally:
            if stdin is not subprocess.DEVNULL:
                stdin.close()

    # Reading records ------------------------------------------------------------------------------------

    def _read_new(self) -> None:
        with open(self.result_path, "rb") as fh:
            fh.seek(self._offset)
            chunk = fh.read()
        self._offset += len(chunk)
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            if line.strip():
                self._pending.append(self._parse(line))

    def _parse(self, line: bytes) -> dict:
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise self.error(f"sent a malformed result ({exc}: {line[:200]!r})") from None
        if not isinstance(record, dict):
            raise self.error(f"sent a result that is not a JSON object: {line[:200]!r}")
        return record

    def next(self, timeout: Optional[float] = None) -> Optional[dict]:
        """The next record; None once the child exited 0 with every record read.

        Raises :class:`ChannelTimeout` (after killing the child) when none arrives within ``timeout``
        seconds, and :class:`ChannelError` when the child exited non-zero or was killed with no record left
        unread, or left a record unfinished.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.005
        while True:
            if self._pending:
                return self._pending.pop(0)
            # Exit status first, then one more read: a record written just before exiting is not lost.
            exited = self.process.poll() is not None
            self._read_new()
            if self._pending:
                continue
            if exited:
                if self._buffer.strip():
                    raise self.error(f"left an unfinished result ({self._buffer[:200]!r}) and "
                                      f"{self._exit_status()}")
                if self.process.returncode:
                    raise self.error(self._exit_status())
                return None
            if deadline is not None and time.monotonic() >= deadline:
                self.kill()
                self.killed_after = timeout
                raise self.error(f"sent no result within {timeout:g} s and was killed", ChannelTimeout)
            # Polling, not a pipe or inotify: a file is what survives every launcher; the pause grows so an
            # idle wait costs nothing measurable and a quick child still answers within milliseconds.
            time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic())))
            pause = min(pause * 2, 0.1)

    def records(self, timeout: Optional[float] = None) -> List[dict]:
        """Every remaining record once the child exited 0; ``timeout`` bounds the whole wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        found = []
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                record = self.next(left)
            except ChannelTimeout:
                raise self.error(f"did not finish within {timeout:g} s and was killed", ChannelTimeout) from None
            if record is None:
                return found
            found.append(record)

    # The process ----------------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> Optional[int]:
        return self.process.poll()

    def kill(self) -> None:
        """SIGKILL the child (its whole session when started with ``new_session``) and reap it."""
        if self.process.poll() is None:
            try:
                if self.new_session:
                    os.killpg(self.process.pid, signal.SIGKILL)
                else:
                    self.process.kill()
            except ProcessLookupError:
                pass
        self.process.wait()

    def close(self) -> None:
        """Kill the child if it still runs and remove the channel's files (not a caller's stderr log)."""
        if hasattr(self, "process"):
            self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Errors ---------------------------------------------------------------------------------------------

    def _exit_status(self) -> str:
        code = self.process.returncode
        if code is None:
            return "is still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"was killed by {name}"
        return f"exited with code {code}"

    def stderr_tail(self, lines: int = TAIL_LINES) -> str:
        return _tail(self.stderr_path, lines, self._stderr_from)

    def stdout_tail(self, lines: int = TAIL_LINES) -> str:
        return _tail(self.stdout_path, lines)

    def error(self, reason: str, kind: type = ChannelError) -> ChannelError:
        """The error to raise for this child, ``reason`` with its exit status and output tails: a caller that
        finds its records wrong (not the channel) says so in the same form."""
        return kind(self.what, self.argv, reason, returncode=self.process.returncode,
                    stderr_tail=self.stderr_tail(), stdout_tail=self.stdout_tail())



def _tail(path: Path, lines: int, start: int = 0) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    # A spinner redraws with carriage returns and ANSI erase codes; keep what a reader would see last.
    shown = [line.rsplit("\r", 1)[-1].replace("\x1b[K", "") for line in text.rstrip().splitlines()]
    return "\n".join(shown[-lines:])


def start(argv: Sequence[str], *, what: str, env: Optional[Mapping[str, str]] = None,
          cwd: Optional[PathLike] = None, input: Optional[str] = None, stderr: Optional[PathLike] = None,
          new_session: bool = False) -> Stream:
    """Start ``argv`` with a fresh result channel; read its records from the returned :class:`Stream`.

    ``what`` says what runs where ("the 'patched' environment: the check routine"); every error quotes it.
    ``input`` is given on stdin (from a file, so a large one cannot block). ``stderr``: append the child's
    stderr to this file instead of a private one. ``new_session``: the child leads its own process group,
    and a kill reaches everything it started.
    """
    return Stream(argv, what=what, env=env, cwd=cwd, input=input, stderr=stderr, new_session=new_session)


def run(argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None, cwd: Optional[PathLike] = None,
        timeout: Optional[float] = None, what: str, input: Optional[str] = None,
        new_session: bool = False) -> List[dict]:
    """Every record ``argv`` sends; it must exit 0 within ``timeout`` seconds (else killed, and an error)."""
    with start(argv, what=what, env=env, cwd=cwd, input=input, new_session=new_session) as stream:
        return stream.records(timeout)


def run_one(argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None, cwd: Optional[PathLike] = None,
            timeout: Optional[float] = None, what: str, input: Optional[str] = None,
            new_session: bool = False) -> dict:
    """The one record ``argv`` sends (see :func:`run`); none or several is an error."""
    with start(argv, what=what, env=env, cwd=cwd, input=input, new_session=new_session) as stream:
        records = stream.records(timeout)
        if len(records) != 1:
            raise stream.error("exited 0 without sending a result" if not records else
                                f"sent {len(records)} results where one was expected")
        return records[0]

