"""Real ``celery worker`` processes for the tests that need them: started with their log
in a file, in a process group of their own, and killed with their pool children when
the test ends (``Workers`` as a fixture's body).

Importable from every test directory (``tests/`` is on ``sys.path``, see ``waiting``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from waiting import Process

#: what every test worker runs without: no peers to wait for, no heartbeats to send
QUIET = ("--without-mingle", "--without-gossip", "--without-heartbeat")


class Worker(Process):
    """A ``celery worker``; waits that watch it fail at once if it exits."""

    def kill(self) -> None:
        """SIGKILL the main process and its pool children at once (OOM killer, crash)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self) -> None:
        """SIGTERM the main process only: Celery's warm shutdown."""
        self.proc.send_signal(signal.SIGTERM)


class Workers:
    """The workers one test started."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[Worker] = []

    def start(
        self,
        app: str,
        name: str,
        *,
        cwd: Path,
        env: Mapping[str, str],
        options: Sequence[str] = ("-P", "prefork", "-c", "2", "-Q", "celery"),
    ) -> Worker:
        """``celery -A app worker -n name@%h OPTIONS -l info`` and :data:`QUIET`."""
        log_path = self.logs / f"worker-{name}.log"
        command = [sys.executable, "-m", "celery", "-A", app, "worker", "-n", f"{name}@%h"]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [*command, *options, "-l", "info", *QUIET],
                cwd=cwd,
                env=dict(env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        worker = Worker(name, proc, log_path)
        self.started.append(worker)
        return worker

    def kill_all(self) -> None:
        for worker in self.started:
            try:  # the group outlives its leader while orphaned pool children run
                os.killpg(worker.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            worker.proc.wait(timeout=10)


@contextmanager
def workers(logs: Path) -> Iterator[Workers]:
    """Workers killed, pool children and all, when the block ends."""
    started = Workers(logs)
    try:
        yield started
    finally:
        started.kill_all()
