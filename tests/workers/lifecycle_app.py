"""The Celery app that the worker-lifecycle tests run in real worker processes.

``celery -A lifecycle_app worker`` builds it from the environment:

* ``PGQUEUE_DSN`` (required): libpq DSN or URL of the test database.
* ``PGQUEUE_SCHEMA`` (required): the test's broker schema; the ledger lives there too.
* ``PGQUEUE_LEDGER`` (``ledger``): table in that schema where every task execution
  is written down (``ledger.Ledger``).
* ``PGQUEUE_VISIBILITY_TIMEOUT``, ``PGQUEUE_LEASE_RENEWAL_INTERVAL``,
  ``PGQUEUE_MAX_ATTEMPTS``, ``PGQUEUE_POLLING_INTERVAL`` (0.5),
  ``PGQUEUE_AUTO_MIGRATE``: the transport options of the same name.
* ``PGQUEUE_PREFETCH`` (1): ``worker_prefetch_multiplier``.

Every task is ``acks_late`` with ``reject_on_worker_lost``: a message leaves the
broker only once its task has run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

from celery import Celery
from celery_apps import celery_app, lazy_app
from celery_workers import app_env
from ledger import Ledger

#: how long a task waits for its gate before giving up (it must never outlive a test)
GATE_LIMIT = 90.0

_OPTIONS = {
    "PGQUEUE_VISIBILITY_TIMEOUT": ("visibility_timeout", float),
    "PGQUEUE_LEASE_RENEWAL_INTERVAL": ("lease_renewal_interval", float),
    "PGQUEUE_MAX_ATTEMPTS": ("max_attempts", int),
    "PGQUEUE_POLLING_INTERVAL": ("polling_interval", float),
    "PGQUEUE_AUTO_MIGRATE": ("auto_migrate", str),
}


#: ``worker_env(dsn, schema, **settings)``: the environment for a process running
#: ``celery -A lifecycle_app ...``; ``settings`` are the variables above without their
#: ``PGQUEUE_`` prefix, in lower case (``visibility_timeout=3``)
worker_env = partial(app_env, Path(__file__).resolve().parent)


def pgqueue_cli(
    app: str, dsn: str, schema: str, *args: str, stdin: str = "", **settings: Any
) -> subprocess.CompletedProcess[str]:
    """``celery -A APP pgqueue ARGS`` as a user runs it, from this directory, with
    :func:`worker_env`'s environment; its exit status is the caller's to check."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, "pgqueue", *args],
        cwd=os.path.dirname(os.path.abspath(__file__)),
        env=worker_env(dsn, schema, **settings),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def make_app(
    dsn: str,
    schema: str,
    *,
    ledger: str = "ledger",
    prefetch: int = 1,
    **transport_options: Any,
) -> Celery:
    app = celery_app(
        dsn,
        schema,
        main="lifecycle",
        results=False,
        conf={
            "task_acks_late": True,
            "task_reject_on_worker_lost": True,
            "task_ignore_result": True,
            "worker_prefetch_multiplier": prefetch,
            # the tests read the worker's log (" ready.", "Warm shutdown")
            "worker_hijack_root_logger": True,
        },
        **transport_options,
    )
    book = Ledger(dsn, schema, ledger)
    # shared=False: Celery's default (shared) registers a task with every app finalized
    # later, so a second make_app() would run the first one's closures (its DSN and ledger)
    # and warn DuplicateTaskNameWarning

    @app.task(name="lifecycle.work", bind=True, shared=False)
    def work(self: Any, label: str, *_: Any) -> str:
        """Run, and be done (further arguments are carried, not used)."""
        book.finish(book.start(self, label))
        return label

    @app.task(name="lifecycle.block", bind=True, shared=False)
    def block(self: Any, label: str, gate: str) -> str:
        """Run until gate ``gate`` is opened (``helpers.open_gate``, table ``<ledger>_gate``)."""
        run = book.start(self, label)
        book.wait_gate(gate, GATE_LIMIT)
        book.finish(run)
        return label

    @app.task(name="lifecycle.poison", bind=True, shared=False)
    def poison(self: Any, label: str) -> None:
        """Kill the process running it, as a segfault or the OOM killer would."""
        book.start(self, label)
        os.kill(os.getpid(), signal.SIGKILL)

    return app


def app_from_environment(env: Mapping[str, str] = os.environ) -> Celery:
    options: dict[str, Any] = {}
    for variable, (option, kind) in _OPTIONS.items():
        if env.get(variable):
            options[option] = kind(env[variable])
    return make_app(
        env["PGQUEUE_DSN"],
        env["PGQUEUE_SCHEMA"],
        ledger=env.get("PGQUEUE_LEDGER", "ledger"),
        prefetch=int(env.get("PGQUEUE_PREFETCH", "1")),
        **options,
    )


__getattr__ = lazy_app(globals(), app_from_environment)
