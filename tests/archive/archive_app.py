"""The Celery app of the failed-task archive tests, for real ``celery worker`` processes.

``celery -A archive_app worker`` builds it from ``PGQUEUE_DSN`` and ``PGQUEUE_SCHEMA``,
with the setting ``pgqueue_keep_failed`` on (``PGQUEUE_KEEP_FAILED=0``: off; ``=default``:
not set, as ``configure()`` leaves it) and results in the same database;
``PGQUEUE_SWEEP_INTERVAL`` is the setting ``pgqueue_sweep_interval``. Every task fails
with :class:`Declined` until the gate named by its label is opened (a row in the
schema's ``gate`` table: ``helpers.open_gate``), and writes each run to the ``runs``
table first, so the tests count executions exactly.

* ``archive.charge``: early acks (Celery's default);
* ``archive.charge_late``: late acks, a failed task's message acked after it ran;
* ``archive.charge_rejected``: late acks, a failed task's message rejected
  (``acks_on_failure_or_timeout=False``);
* ``archive.retried``: retried twice on :class:`Declined`, then failed for good;
* ``archive.crash``: late acks without ``reject_on_worker_lost``: kills its own process,
  and Celery's main process fails it (``WorkerLostError``);
* ``archive.slow``: runs into its hard time limit (3 s: its run when the gate is open
  fits well inside), which the main process enforces.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import psycopg
from celery import Celery
from celery_apps import celery_app, lazy_app
from psycopg import sql

#: longer than any test waits: a task that waits this long is killed by its time limit
SLOW_SECONDS = 120.0


class Declined(Exception):
    """What every task here raises until its gate is open."""


def create_tables(conn: psycopg.Connection, schema: str) -> None:
    """The gate and runs tables in ``schema`` (which must exist)."""
    conn.execute(
        sql.SQL("CREATE TABLE {} (name text PRIMARY KEY)").format(sql.Identifier(schema, "gate"))
    )
    conn.execute(
        sql.SQL(
            "CREATE TABLE {} (run bigint GENERATED ALWAYS AS IDENTITY, task_id text, "
            "label text, retries integer, handoff boolean)"
        ).format(sql.Identifier(schema, "runs"))
    )


def _handed_off(request: Any) -> bool:
    """Whether the run's message came by handoff (docs/lifecycle.md, "Handoff")."""
    delivery = (getattr(request, "properties", None) or {}).get("delivery_info") or {}
    return bool(delivery.get("pgqueue_handoff"))


def make_app(
    dsn: str, schema: str, *, keep_failed: bool | None = True, sweep_interval: str | None = None
) -> Celery:
    """``keep_failed``: the setting (None: not set); ``sweep_interval``: seconds, or None."""
    conf: dict[str, object] = {"worker_hijack_root_logger": True}
    if keep_failed is not None:
        conf["pgqueue_keep_failed"] = keep_failed
    if sweep_interval is not None:
        conf["pgqueue_sweep_interval"] = float(sweep_interval)
    app = celery_app(dsn, schema, main="archive", conf=conf)

    def run(task: Any, label: str) -> str:
        """Write the run down; fail unless gate ``label`` is open."""
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (task_id, label, retries, handoff) VALUES (%s, %s, %s, %s)"
                ).format(sql.Identifier(schema, "runs")),
                (task.request.id, label, task.request.retries, _handed_off(task.request)),
            )
            gate = sql.SQL("SELECT 1 FROM {} WHERE name = %s").format(
                sql.Identifier(schema, "gate")
            )
            if conn.execute(gate, (label,)).fetchone() is None:
                raise Declined(f"card declined: {label}")
        return f"paid {label}"

    @app.task(name="archive.charge", bind=True, shared=False)
    def charge(self: Any, label: str, amount: int, *, currency: str = "EUR") -> str:
        return run(self, label) + f" {amount} {currency}"

    @app.task(name="archive.charge_late", bind=True, shared=False, acks_late=True)
    def charge_late(self: Any, label: str, amount: int, *, currency: str = "EUR") -> str:
        return run(self, label) + f" {amount} {currency}"

    @app.task(
        name="archive.charge_rejected",
        bind=True,
        shared=False,
        acks_late=True,
        acks_on_failure_or_timeout=False,
    )
    def charge_rejected(self: Any, label: str, amount: int, *, currency: str = "EUR") -> str:
        return run(self, label) + f" {amount} {currency}"

    @app.task(
        name="archive.retried",
        bind=True,
        shared=False,
        autoretry_for=(Declined,),
        max_retries=2,
        default_retry_delay=0,
    )
    def retried(self: Any, label: str) -> str:
        return run(self, label)

    @app.task(
        name="archive.crash",
        bind=True,
        shared=False,
        acks_late=True,
        reject_on_worker_lost=False,
    )
    def crash(self: Any, label: str) -> str:
        try:
            return run(self, label)
        except Declined:
            os.kill(os.getpid(), signal.SIGKILL)
            raise

    @app.task(name="archive.slow", bind=True, shared=False, time_limit=3)
    def slow(self: Any, label: str) -> str:
        try:
            return run(self, label)
        except Declined:
            threading.Event().wait(SLOW_SECONDS)
            raise

    return app


def app_from_environment() -> Celery:
    keep = {"0": False, "default": None}.get(os.environ.get("PGQUEUE_KEEP_FAILED", "1"), True)
    return make_app(
        os.environ["PGQUEUE_DSN"],
        os.environ["PGQUEUE_SCHEMA"],
        keep_failed=keep,
        sweep_interval=os.environ.get("PGQUEUE_SWEEP_INTERVAL"),
    )


__getattr__ = lazy_app(globals(), app_from_environment)
