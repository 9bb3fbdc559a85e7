"""The one way the tests wait: for a condition, with a deadline, said in words.

``wait_for(condition, timeout, what)`` returns the first truthy value of ``condition()``
and fails the test with ``what`` if ``timeout`` seconds pass first. ``condition`` may
be a :class:`threading.Event` instead, waited on directly. Nothing else in the tests
pauses for a fixed time; a look at a condition that no event announces (a row, a log
line, an HTTP answer) is repeated every :data:`POLL_SECONDS`.

``never=True`` turns it round, for the few checks that something does NOT happen and
that no event could tell: the condition must stay falsy for all of ``timeout``.

Importable from every test directory (``tests/`` is on ``sys.path`` through
``tests/conftest.py``) and from the worker processes the tests start, whose
``PYTHONPATH`` includes ``tests/``; it raises :class:`WaitTimeout`, an
``AssertionError``, so a task that waits in a worker fails like a test does.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

#: seconds between two looks at a condition that no event announces
POLL_SECONDS = 0.05

#: never set: between two looks at a condition that no event announces, the helper
#: waits on it for POLL_SECONDS
_between_looks = threading.Event()


class WaitTimeout(AssertionError):
    """What was awaited did not come in time (or, with ``never=True``, came)."""


@dataclass
class Process:
    """A process started by a test; a wait that watches it fails as soon as it exits."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def says(self, text: str) -> bool:
        """Whether ``text`` is in its log (``" ready."``: a Celery worker is consuming)."""
        return text in self.log()


def wait_for(
    condition: Callable[[], T] | threading.Event,
    timeout: float,
    what: str,
    *watched: Process,
    ignore: tuple[type[BaseException], ...] = (),
    details: Callable[[], object] | None = None,
    never: bool = False,
) -> T:
    """Wait until ``condition`` holds; fail with ``what`` after ``timeout`` seconds.

    * ``watched``: processes that must stay alive meanwhile; their logs end the
      failure message.
    * ``ignore``: exceptions of ``condition`` that mean "not yet" (a server still
      starting); the last one is reported if the time runs out.
    * ``details``: called on failure, its value added to the message (what was seen).
    * ``never``: ``condition`` is what must NOT happen within ``timeout``; returns
      ``None`` once that time has passed without it.
    """
    __tracebackhide__ = True
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        if isinstance(condition, threading.Event):
            found: Any = condition.wait(max(0.0, min(POLL_SECONDS, deadline - time.monotonic())))
        else:
            try:
                found = condition()
            except ignore as exc:
                found, last_error = None, exc
        if found:
            if never:
                _fail(f"{what} happened within {timeout}s", watched, details, last_error)
            return found  # type: ignore[no-any-return]
        for process in watched:
            if process.proc.poll() is not None:
                _fail(
                    f"{process.name} exited ({process.proc.returncode}) while waiting for {what}",
                    watched,
                    details,
                    last_error,
                )
        left = deadline - time.monotonic()
        if left <= 0:
            if never:
                return None  # type: ignore[return-value]
            _fail(f"timed out after {timeout}s waiting for {what}", watched, details, last_error)
        if not isinstance(condition, threading.Event):
            _between_looks.wait(min(POLL_SECONDS, left))


def _fail(
    message: str,
    watched: tuple[Process, ...],
    details: Callable[[], object] | None,
    last_error: BaseException | None,
) -> None:
    __tracebackhide__ = True
    if details is not None:
        message += f"\nseen: {details()!r}"
    if last_error is not None:
        message += f"\nlast error: {last_error!r}"
    for process in watched:
        message += f"\n--- {process.name} ({process.log_path}):\n{process.log()[-3000:]}"
    raise WaitTimeout(message)
