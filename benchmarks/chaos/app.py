"""The Celery app the chaos workers run: ``celery -A benchmarks.chaos.app worker``.

Built from the environment (set by :func:`benchmarks.chaos.procs.spawn_worker`):

* ``CHAOS_DSN``, ``CHAOS_SCHEMA``: database and broker schema of the run.
* ``CHAOS_RUN``: the run id; executions go to ``chaos_ledger."<run>_exec"``.
* ``CHAOS_OPTIONS``: the transport options, as JSON.
* ``CHAOS_PREFETCH``: ``worker_prefetch_multiplier``.

Every task is ``acks_late`` with ``reject_on_worker_lost``. A task writes its start
and its end to the ledger in autocommit statements on its own connection, which it
re-opens and retries (for up to ``LEDGER_PATIENCE`` seconds) while the database is
down, so the ledger holds every execution even across a server restart. A start row
carries a client-made id and is inserted with ``ON CONFLICT DO NOTHING``: a retried
insert whose first attempt did commit is not counted twice. It also carries how the
task's message came (:func:`delivery`): handed off or claimed, its id and attempt.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from celery import Celery
from celery.signals import worker_ready
from psycopg import sql

import celery_pgqueue

LEDGER_SCHEMA = "chaos_ledger"
#: seconds a task keeps retrying its ledger writes while the database is away
LEDGER_PATIENCE = 300.0


class LedgerWriter:
    """One autocommit connection per process, re-opened after a fork or an error."""

    def __init__(self, dsn: str, run: str) -> None:
        self.dsn = dsn
        self.exec_table = sql.Identifier(LEDGER_SCHEMA, f"{run}_exec")
        self.event_table = sql.Identifier(LEDGER_SCHEMA, f"{run}_event")
        self._conn: psycopg.Connection | None = None
        self._pid = 0

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._pid != os.getpid():
            self._conn = psycopg.connect(
                self.dsn, autocommit=True, connect_timeout=5, application_name="chaos-ledger"
            )
            self._pid = os.getpid()
        return self._conn

    def execute(self, query: sql.Composable, params: tuple[Any, ...]) -> None:
        deadline = time.monotonic() + LEDGER_PATIENCE
        while True:
            try:
                self._connection().execute(query, params)
                return
            except psycopg.OperationalError:
                if self._conn is not None and self._pid == os.getpid():
                    try:
                        self._conn.close()
                    except psycopg.Error:
                        pass
                self._conn = None
                if time.monotonic() > deadline:
                    raise
                threading.Event().wait(0.5)

    def start(self, task_id: str, worker: str, request: Any = None) -> str:
        """Write down an execution's start; with the task's ``request``, how it came."""
        run_id = uuid.uuid4().hex
        handoff, message_id, attempts = delivery(request)
        self.execute(
            sql.SQL(
                "INSERT INTO {} (run_id, task_id, worker, pid, handoff, message_id, attempts) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (run_id) DO NOTHING"
            ).format(self.exec_table),
            (run_id, task_id, worker, os.getpid(), handoff, message_id, attempts),
        )
        return run_id

    def finish(self, run_id: str) -> None:
        self.execute(
            sql.SQL("UPDATE {} SET finished_at = clock_timestamp() WHERE run_id = %s").format(
                self.exec_table
            ),
            (run_id,),
        )

    def event(self, kind: str, worker: str | None, pid: int | None) -> None:
        self.execute(
            sql.SQL("INSERT INTO {} (kind, worker, pid) VALUES (%s, %s, %s)").format(
                self.event_table
            ),
            (kind, worker, pid),
        )


def delivery(request: Any) -> tuple[bool | None, int | None, int | None]:
    """(handed off?, message id, attempt) of a task's delivery; None where unknown.

    The transport's delivery_info (``pgqueue_id``, ``pgqueue_attempts``, and
    ``pgqueue_handoff`` True for a handoff) reaches a Celery task whole only in
    ``request.properties["delivery_info"]``: Celery's ``Request`` builds
    ``request.delivery_info`` from four keys of it (exchange, routing_key, priority,
    redelivered). Both are read, so that either place will do.
    """
    if request is None:
        return None, None, None
    info = dict((getattr(request, "properties", None) or {}).get("delivery_info") or {})
    info.update(getattr(request, "delivery_info", None) or {})
    if info.get("pgqueue_id") is None:
        return None, None, None
    attempts = info.get("pgqueue_attempts")
    return (
        info.get("pgqueue_handoff") is True,
        int(info["pgqueue_id"]),
        None if attempts is None else int(attempts),
    )


def make_app(dsn: str, schema: str, run: str, options: dict[str, Any], prefetch: int) -> Celery:
    app = Celery("chaos", set_as_current=False)
    celery_pgqueue.configure(app, dsn, results=False, schema=schema, **options)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        task_default_queue="celery",
        worker_prefetch_multiplier=prefetch,
        worker_hijack_root_logger=True,
        broker_connection_retry=True,
        broker_connection_max_retries=None,
    )
    ledger = LedgerWriter(dsn, run)

    @app.task(name="chaos.work", bind=True, shared=False)
    def work(self: Any, seconds: float = 0.0) -> None:
        run_id = ledger.start(self.request.id, self.request.hostname or "", self.request)
        if seconds:
            threading.Event().wait(seconds)
        ledger.finish(run_id)

    @app.task(name="chaos.poison", bind=True, shared=False)
    def poison(self: Any, how: str = "kill") -> None:
        """Kill the pool process running it, every time (segfault, OOM killer)."""
        ledger.start(self.request.id, self.request.hostname or "")
        if how == "exit":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGKILL)

    @worker_ready.connect(weak=False)
    def ready(sender: Any = None, **_: Any) -> None:
        ledger.event("ready", getattr(sender, "hostname", None), os.getpid())

    return app


def from_environment(factory: Callable[..., Any] = make_app) -> Any:
    """The app ``factory`` builds from what the chaos runner puts in the environment."""
    env = os.environ
    return factory(
        env["CHAOS_DSN"],
        env["CHAOS_SCHEMA"],
        env["CHAOS_RUN"],
        json.loads(env.get("CHAOS_OPTIONS", "{}")),
        int(env.get("CHAOS_PREFETCH", "4")),
    )


def lazy_app(namespace: dict[str, Any], factory: Callable[..., Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that builds ``app`` on first use (``celery -A module``
    looks it up), from the environment."""

    def __getattr__(name: str) -> Any:
        if name == "app":
            namespace["app"] = built = from_environment(factory)
            return built
        raise AttributeError(name)

    return __getattr__


__getattr__ = lazy_app(globals(), make_app)
