"""Real ``celery worker`` processes for the tests that need them: started with their log
in a file, in a process group of their own, and killed with their pool children when
the test ends (``Workers`` as a fixture's body).

The ``spawn`` fixture (``tests/conftest.py``) starts workers of the :class:`WorkerApp`
that a test directory gives as its ``worker_app`` fixture. :func:`app_env` is the
environment of every process that runs a test app (worker, beat, ``celery pgqueue``,
an exporter).

Importable from every test directory (``tests/`` is on ``sys.path``, see ``waiting``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from waiting import Process, wait_for

#: what every test worker runs without: no peers to wait for, no heartbeats to send
QUIET = ("--without-mingle", "--without-gossip", "--without-heartbeat")

TESTS = Path(__file__).resolve().parent


def app_env(
    app_dir: Path, dsn: str, schema: str, *, prefix: str = "PGQUEUE", **settings: object
) -> dict[str, str]:
    """The environment of a process that imports a test app of ``app_dir`` (``celery -A
    module ...``): this process's, with ``app_dir``, ``tests/`` (the app's helpers) and
    the checkout (its packages, not another installed copy) first on ``PYTHONPATH``;
    ``PREFIX_DSN``, ``PREFIX_SCHEMA``, and each setting as ``PREFIX_NAME``
    (``visibility_timeout=3``: ``PGQUEUE_VISIBILITY_TIMEOUT=3``)."""
    path = [str(app_dir), str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path).rstrip(os.pathsep),
        f"{prefix}_DSN": dsn,
        f"{prefix}_SCHEMA": schema,
    }
    env.update({f"{prefix}_{key.upper()}": str(value) for key, value in settings.items()})
    return env


class Worker(Process):
    """A ``celery worker``; waits that watch it fail at once if it exits."""

    def kill(self) -> None:
        """SIGKILL the main process and its pool children at once (OOM killer, crash)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self) -> None:
        """SIGTERM the main process only: Celery's warm shutdown."""
        self.proc.send_signal(signal.SIGTERM)


@dataclass(frozen=True)
class WorkerApp:
    """``celery -A module worker``, run from ``cwd`` with the environment ``env(**settings)``."""

    module: str
    cwd: Path
    env: Callable[..., Mapping[str, str]]


class Workers:
    """The workers one test started."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[Worker] = []

    def run(
        self, name: str, args: Sequence[str], *, cwd: Path, env: Mapping[str, str], log: str = ""
    ) -> Worker:
        """``python -m celery ARGS``, its output in ``log`` (default ``NAME.log``)."""
        log_path = self.logs / (log or f"{name}.log")
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", *args],
                cwd=cwd,
                env=dict(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        worker = Worker(name, proc, log_path)
        self.started.append(worker)
        return worker

    def start(
        self,
        app: str,
        name: str,
        *,
        cwd: Path,
        env: Mapping[str, str],
        options: Sequence[str] = ("-P", "prefork", "-c", "2", "-Q", "celery"),
    ) -> Worker:
        """``celery -A app worker -n name@%h OPTIONS -l info`` and :data:`QUIET` (a
        ``name`` with ``@`` is the whole hostname)."""
        hostname = name if "@" in name else f"{name}@%h"
        command = ["-A", app, "worker", "-n", hostname, *options, "-l", "info", *QUIET]
        return self.run(name, command, cwd=cwd, env=env, log=f"worker-{name}.log")

    def spawn(
        self,
        app: WorkerApp,
        name: str | None = None,
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        queues: str | None = "celery",
        ready: bool = False,
        **settings: object,
    ) -> Worker:
        """A worker of ``app`` (``name``: ``<pool><n>``) with ``-P pool -c concurrency``,
        ``-Q queues`` unless None, ``app.env(**settings)``; ``ready``: once consuming."""
        name = name or f"{pool}{len(self.started)}"
        options = ["-P", pool, "-c", str(concurrency)]
        if queues is not None:
            options += ["-Q", queues]
        worker = self.start(app.module, name, cwd=app.cwd, env=app.env(**settings), options=options)
        if ready:
            wait_for(lambda: worker.says(" ready."), 60, f"worker {name} to start", worker)
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
